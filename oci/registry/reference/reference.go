package reference

import (
	"errors"
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
	"oras.land/oras-go/v2/errdef"
	orasreg "oras.land/oras-go/v2/registry"

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
	r, err := Parse(rest)
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

// ErrCredentialsInReference: a reference names a user (and password) before the host
// ("user:pass@host/repo:tag"). Credentials come from Options (a password never travels in a
// reference, which ends up in errors and logs); the error quotes the reference without them.
var ErrCredentialsInReference = errors.New("reference holds credentials")

// MaxReferenceBytes bounds a registry reference, in bytes: the distribution registry's names
// are at most 255 bytes, a tag 128 and a digest about 100.
const MaxReferenceBytes = 1024

// Parse parses ref ("host[:port]/repository[:tag|@digest]", without a scheme). Its errors quote ref cut and without user information (quote.Ref), never
// oras-go's parse error when ref holds any: that would quote it whole.
func Parse(ref string) (orasreg.Reference, error) {
	if strings.HasPrefix(ref, "oci://") {
		return orasreg.Reference{}, fmt.Errorf("reference %s: drop the oci:// prefix (it belongs in berth.dev/restore-from only): %w", quote.Ref(ref), errdefs.ErrInvalidArgument)
	}
	if len(ref) > MaxReferenceBytes {
		return orasreg.Reference{}, fmt.Errorf("reference %s: %w: longer than %d bytes", quote.Ref(ref), errdef.ErrInvalidReference, MaxReferenceBytes)
	}
	if quote.StripCredentials(ref) != ref {
		return orasreg.Reference{}, fmt.Errorf("reference %s: %w: credentials come from a Docker config.json or a user name and password given apart, never from the reference", quote.Ref(ref), ErrCredentialsInReference)
	}
	r, err := orasreg.ParseReference(ref)
	if err != nil {
		if len(ref) > quote.MaxBytes { // oras-go's error quotes it whole
			return orasreg.Reference{}, fmt.Errorf("reference %s: %w", quote.Ref(ref), errdef.ErrInvalidReference)
		}
		return orasreg.Reference{}, fmt.Errorf("reference %s: %w", quote.Ref(ref), err)
	}
	return r, nil
}

// Errors of package registry, here so that code which only parses references and classifies
// errors (the shim) can name them without linking the registry client; they are returned
// wrapped, with the reference and registry.
var (
	// ErrNotCheckpoint: the reference names something that is not a berth checkpoint artifact
	// (another manifest media type, artifact type or config media type, or a layer of another
	// media type or without a title).
	ErrNotCheckpoint = errors.New("not a berth checkpoint artifact")
	// ErrLayerMismatch: the artifact's layers are not exactly the files its berth.json lists
	// (path, size and digest, in order).
	ErrLayerMismatch = errors.New("layers do not match berth.json")
	// ErrNoTag: Push was given a reference without a tag.
	ErrNoTag = errors.New("reference has no tag")
	// ErrUnauthorized: the registry requires credentials and none were given, or it refused
	// them (HTTP 401).
	ErrUnauthorized = errors.New("registry requires valid credentials")
)
