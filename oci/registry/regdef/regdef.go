// Package regdef holds what code that never parses a registry reference itself still needs to
// name: the berth.dev/restore-from scheme (RestoreFromScheme), the shape of a parsed value
// (RestoreFrom), the path half of its parsing (ParseRestoreFromPath: no grammar there) and the
// sentinel errors of package registry and package reference.
//
// It is apart from package reference so that the shim, which names these but sends the parsing
// of an oci:// value to berth-shim-helper, links no oras-go: oras-go's reference grammar
// compiles its regular expressions at package init, which every shim start (one per container)
// would pay in time and heap.
//
// What does not belong here: parsing a registry reference (package reference, the one parser,
// oras-go's grammar) and talking to a registry (package registry).
package regdef

import (
	"errors"
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
// reference (Registry, Repository and Tag or Digest set). Package reference's ParseRestoreFrom
// makes it; it crosses the shim/helper boundary as JSON.
type RestoreFrom struct {
	// Path is the value as given when it is not a registry reference.
	Path string `json:"path,omitempty"`
	// Registry is "host[:port]", Repository the repository path; exactly one of Tag and Digest
	// ("sha256:<hex>") is set. When the value names both, Digest wins and Tag is dropped.
	Registry   string `json:"registry,omitempty"`
	Repository string `json:"repository,omitempty"`
	Tag        string `json:"tag,omitempty"`
	Digest     string `json:"digest,omitempty"`
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

// ParseRestoreFromPath parses a berth.dev/restore-from value that is not a registry reference:
// it returns it as Path, unchecked (checkpoint.ResolveRestoreFrom checks paths against the
// checkpoint root). ok is false, with no error, for a value with RestoreFromScheme: that one is
// package reference's to parse (reference.ParseRestoreFrom).
//
// Errors wrap checkpoint.ErrInvalidRef and quote the value: empty, or another "scheme://".
func ParseRestoreFromPath(v string) (r RestoreFrom, ok bool, err error) {
	if v == "" {
		return RestoreFrom{}, false, fmt.Errorf("%w: empty", checkpoint.ErrInvalidRef)
	}
	if strings.HasPrefix(v, RestoreFromScheme) {
		return RestoreFrom{}, false, nil
	}
	if scheme, _, found := strings.Cut(v, "://"); found && !strings.Contains(scheme, "/") {
		return RestoreFrom{}, false, fmt.Errorf("%w: %s: scheme %s is not supported (a registry reference is %sHOST[:PORT]/REPOSITORY:TAG; anything else is a path under the checkpoint root)",
			checkpoint.ErrInvalidRef, quote.Ref(v), quote.Value(scheme+"://"), RestoreFromScheme)
	}
	return RestoreFrom{Path: v}, true, nil
}

// Errors of package registry and package reference, here so that code which only classifies
// them (the shim) can name them without linking oras-go; they are returned wrapped, with the
// reference and registry.
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
	// ErrCredentialsInReference: a reference names a user (and password) before the host
	// ("user:pass@host/repo:tag"). Credentials come from the registry options (a password never
	// travels in a reference, which ends up in errors and logs); the error quotes the reference
	// without them.
	ErrCredentialsInReference = errors.New("reference holds credentials")
	// ErrNotFound: the registry has no manifest or blob of that name (oras-go's
	// errdef.ErrNotFound, which berth-shim-helper marks with this one so that the shim can
	// classify it without linking oras-go).
	ErrNotFound = errors.New("not found in the registry")
)
