package registry

import (
	"context"
	"fmt"
	"strings"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/quote"
)

// RestoreFromScheme prefixes a registry reference in the berth.dev/restore-from annotation:
//
//	berth.dev/restore-from: oci://HOST[:PORT]/REPOSITORY:TAG
//	berth.dev/restore-from: oci://HOST[:PORT]/REPOSITORY@sha256:HEX
//
// HOST[:PORT] is the registry exactly as the shim config's allowed_registries lists it. A tag or
// a digest is required (there is no implicit "latest"). Any other value is a checkpoint path
// under the shim's checkpoint root (checkpoint.ResolveRestoreFrom); values with another "scheme://" are
// refused rather than taken as paths.
const RestoreFromScheme = "oci://"

// RestoreFrom is a parsed berth.dev/restore-from value: a path (Path set) or a registry
// reference (Registry, Repository and Tag or Digest set).
type RestoreFrom struct {
	// Path is the value as given when it is not a registry reference.
	Path string
	// Registry is "host[:port]", Repository the repository path; exactly one of Tag and Digest
	// ("sha256:<hex>") is set. When the value names both, Digest wins and Tag is dropped.
	Registry, Repository, Tag, Digest string
}

// IsOCI reports whether r is a registry reference.
func (r RestoreFrom) IsOCI() bool { return r.Registry != "" }

// Ref returns the reference without the scheme ("host[:port]/repository:tag" or
// "...@sha256:<hex>"), as Push and Pull take it; "" for a path.
func (r RestoreFrom) Ref() string {
	switch {
	case !r.IsOCI():
		return ""
	case r.Digest != "":
		return r.Registry + "/" + r.Repository + "@" + r.Digest
	default:
		return r.Registry + "/" + r.Repository + ":" + r.Tag
	}
}

// String returns the annotation value r stands for (canonical for a reference).
func (r RestoreFrom) String() string {
	if r.IsOCI() {
		return RestoreFromScheme + r.Ref()
	}
	return r.Path
}

// ParseRestoreFrom parses a berth.dev/restore-from value (see RestoreFromScheme). A value
// without a scheme is returned as Path, unchecked: checkpoint.ResolveRestoreFrom checks paths against
// the checkpoint root.
//
// Errors wrap checkpoint.ErrInvalidRef and quote the value: empty, a NUL byte or other control
// character or whitespace in a reference, another scheme, a reference that does not parse
// (OCI distribution grammar: lowercase repository, tag of at most 128 characters, sha256 digest)
// or that has neither tag nor digest.
func ParseRestoreFrom(v string) (RestoreFrom, error) {
	if v == "" {
		return RestoreFrom{}, fmt.Errorf("%w: empty", checkpoint.ErrInvalidRef)
	}
	rest, ok := strings.CutPrefix(v, RestoreFromScheme)
	if !ok {
		if scheme, _, found := strings.Cut(v, "://"); found && !strings.Contains(scheme, "/") {
			return RestoreFrom{}, fmt.Errorf("%w: %s: scheme %s is not supported (a registry reference is %sHOST[:PORT]/REPOSITORY:TAG; anything else is a path under the checkpoint root)",
				checkpoint.ErrInvalidRef, quote.Ref(v), quote.Value(scheme+"://"), RestoreFromScheme)
		}
		return RestoreFrom{Path: v}, nil
	}
	for _, c := range rest {
		if c <= ' ' || c == 0x7f {
			return RestoreFrom{}, fmt.Errorf("%w: %s: control character or space in a registry reference", checkpoint.ErrInvalidRef, quote.Ref(v))
		}
	}
	r, err := parseRef(rest)
	if err != nil {
		return RestoreFrom{}, fmt.Errorf("%w: %w", checkpoint.ErrInvalidRef, err)
	}
	if r.Registry == "" || r.Repository == "" || r.Reference == "" {
		return RestoreFrom{}, fmt.Errorf("%w: %s: want %sHOST[:PORT]/REPOSITORY:TAG or ...@sha256:HEX (a tag or digest is required)",
			checkpoint.ErrInvalidRef, quote.Ref(v), RestoreFromScheme)
	}
	out := RestoreFrom{Registry: r.Registry, Repository: r.Repository}
	if d, err := r.Digest(); err == nil {
		if d.Algorithm() != "sha256" {
			return RestoreFrom{}, fmt.Errorf("%w: %s: digest algorithm %s (want sha256)", checkpoint.ErrInvalidRef, quote.Ref(v), quote.Value(string(d.Algorithm())))
		}
		out.Digest = d.String()
	} else {
		out.Tag = r.Reference
	}
	return out, nil
}

// Resolve returns the descriptor of the OCI manifest ref ("host[:port]/repository:tag" or
// "...@sha256:...") names, asking the registry. Errors: ref's parse errors; ErrUnauthorized;
// the registry's (errdef.ErrNotFound for an unknown tag) and network errors, naming the
// reference and the registry.
func Resolve(ctx context.Context, ref string, opts Options) (Descriptor, error) {
	t, err := newTarget(ref, opts)
	if err != nil {
		return Descriptor{}, fmt.Errorf("resolve %s: %w", refName(ref), err)
	}
	if err := t.ref.ValidateReference(); err != nil {
		return Descriptor{}, fmt.Errorf("resolve %s: %w", refName(ref), err)
	}
	desc, err := t.repo.Resolve(ctx, t.ref.Reference)
	if err != nil {
		return Descriptor{}, fmt.Errorf("resolve %s: %w", refName(ref), classify(shortURL(err)))
	}
	return desc, nil
}
