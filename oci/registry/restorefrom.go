package registry

import (
	"context"
	"fmt"

	"github.com/berth-dev/berth/oci/registry/reference"
)

// RestoreFromScheme prefixes a registry reference in the berth.dev/restore-from annotation
// (reference.RestoreFromScheme).
const RestoreFromScheme = reference.RestoreFromScheme

// RestoreFrom is a parsed berth.dev/restore-from value (reference.RestoreFrom).
type RestoreFrom = reference.RestoreFrom

// ParseRestoreFrom parses a berth.dev/restore-from value: reference.ParseRestoreFrom.
func ParseRestoreFrom(v string) (RestoreFrom, error) { return reference.ParseRestoreFrom(v) }

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
