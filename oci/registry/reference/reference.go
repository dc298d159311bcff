package reference

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
	"oras.land/oras-go/v2/errdef"
	orasreg "oras.land/oras-go/v2/registry"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/quote"
	"github.com/berth-dev/berth/oci/registry/regdef"
)

// RestoreFromScheme is regdef.RestoreFromScheme: "oci://" prefixes a registry reference in the
// berth.dev/restore-from annotation.
const RestoreFromScheme = regdef.RestoreFromScheme

// RestoreFrom is regdef.RestoreFrom: a parsed berth.dev/restore-from value, a path or a
// registry reference.
type RestoreFrom = regdef.RestoreFrom

// ParseRestoreFrom parses a berth.dev/restore-from value (see RestoreFromScheme). A value
// without a scheme is returned as Path, unchecked: checkpoint.ResolveRestoreFrom checks paths against
// the checkpoint root.
//
// Errors wrap checkpoint.ErrInvalidRef and quote the value: empty, a NUL byte or other control
// character or whitespace in a reference, another scheme, a reference that does not parse
// (OCI distribution grammar: lowercase repository, tag of at most 128 characters, sha256 digest)
// or that has neither tag nor digest.
func ParseRestoreFrom(v string) (RestoreFrom, error) {
	if path, ok, err := regdef.ParseRestoreFromPath(v); err != nil || ok {
		return path, err
	}
	rest := strings.TrimPrefix(v, RestoreFromScheme)
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

// ErrCredentialsInReference is regdef.ErrCredentialsInReference: a reference names a user (and
// password) before the host ("user:pass@host/repo:tag"); credentials come from Options.
var ErrCredentialsInReference = regdef.ErrCredentialsInReference

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

// Errors of package registry, declared in package regdef (so that the shim can name them without
// linking oras-go) and named here too for package registry's callers.
var (
	// ErrNotCheckpoint is regdef.ErrNotCheckpoint: not a berth checkpoint artifact.
	ErrNotCheckpoint = regdef.ErrNotCheckpoint
	// ErrLayerMismatch is regdef.ErrLayerMismatch: the layers are not the files berth.json lists.
	ErrLayerMismatch = regdef.ErrLayerMismatch
	// ErrNoTag is regdef.ErrNoTag: Push was given a reference without a tag.
	ErrNoTag = regdef.ErrNoTag
	// ErrUnauthorized is regdef.ErrUnauthorized: the registry requires valid credentials (HTTP 401).
	ErrUnauthorized = regdef.ErrUnauthorized
)
