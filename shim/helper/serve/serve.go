// Package serve is berth-shim-helper's work: Handlers serve the shim's requests (package
// shim/helper) with package oci/registry (resolve, pull) and package criu/images (the
// credentials in a CRIU images directory), and OpenInventory opens the GPU inventory that
// `berth-shim-helper gpu-inventory` serves (gpu/nvml). It is apart from package helper so that
// the shim links the protocol but neither the registry client, go-criu's image bindings nor NVML;
// cmd/berth-shim-helper and the shim's tests (which serve the helper's requests in their own
// process) use it.
package serve

import (
	"context"
	"errors"
	"fmt"
	"os"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"oras.land/oras-go/v2/errdef"

	"github.com/berth-dev/berth/criu/images"
	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/nvml"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/privilege/seccompbpf"
	"github.com/berth-dev/berth/oci/privilege/seccompload"
	"github.com/berth-dev/berth/oci/registry"
	"github.com/berth-dev/berth/oci/registry/reference"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/shim/helper"
)

// Handlers returns the helper's handlers: Resolve is registry.Resolve (the manifest's digest,
// "sha256:<hex>"), Pull is registry.Pull, both with the request's registry options (plain HTTP,
// Docker config, limits); ReadProcesses is images.ReadProcesses; ParseRestoreFrom is
// reference.ParseRestoreFrom. Their errors are those packages', and those that match oras-go's
// errdef.ErrNotFound also match regdef.ErrNotFound (the shim names that one: it links no
// oras-go).
func Handlers() helper.Handlers {
	return helper.Handlers{
		ParseRestoreFrom: reference.ParseRestoreFrom,
		Resolve: func(ctx context.Context, ref string, o helper.RegistryOptions) (string, error) {
			desc, err := registry.Resolve(ctx, ref, options(o))
			if err != nil {
				return "", markNotFound(err)
			}
			return desc.Digest.String(), nil
		},
		Pull: func(ctx context.Context, ref, dir string, o helper.RegistryOptions) error {
			return markNotFound(registry.Pull(ctx, ref, dir, options(o)))
		},
		ReadProcesses: func(_ context.Context, dir string) ([]privilege.Process, error) {
			return images.ReadProcesses(dir)
		},
		CheckSeccomp: CheckSeccomp,
	}
}

// CheckSeccomp compares the filter chain of every process in the CRIU images directory dir that
// runs a seccomp filter with the filter runc installs for profile (seccompload.Compile, by this
// executable run as `berth-shim-helper seccomp-load`), with seccompbpf.Compare over the host's
// architectures. nil when no process has a filter (one without, where the profile asks for one,
// is privilege.CheckProcesses's to refuse) or none lets a system call do more. Errors name the
// process and wrap seccompbpf's sentinels, or images.ReadSeccompChains's.
func CheckSeccomp(ctx context.Context, dir string, profile *specs.LinuxSeccomp) error {
	chains, err := images.ReadSeccompChains(dir)
	if err != nil || len(chains) == 0 {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("%w: %w", seccompbpf.ErrCompile, err)
	}
	raw, err := seccompload.Compile(ctx, profile, exe, seccompload.ChildCommand)
	if err != nil {
		return err
	}
	want, err := seccompbpf.Parse(raw)
	if err != nil {
		return fmt.Errorf("the profile as runc compiled it: %w", err)
	}
	arches := seccompbpf.HostArches()
	seen := map[string]bool{} // a chain shared by threads is compared once
	for _, c := range chains {
		key := fmt.Sprint(c.Filters)
		if seen[key] {
			continue
		}
		seen[key] = true
		var progs []seccompbpf.Program
		for i, f := range c.Filters {
			p, err := seccompbpf.Parse(f)
			if err != nil {
				return fmt.Errorf("process %d (%s) thread %d: filter %d: %w", c.PID, c.Comm, c.TID, i, err)
			}
			progs = append(progs, p)
		}
		if err := seccompbpf.Compare(progs, want, arches); err != nil {
			return fmt.Errorf("process %d (%s) thread %d: %w", c.PID, c.Comm, c.TID, err)
		}
	}
	return nil
}

// OpenInventory opens the node's GPU inventory for helper.ServeInventory: NVML
// (nvml.OpenInventory; its error wraps gpu.ErrUnsupported when the library is missing).
func OpenInventory() (gpu.Inventory, error) { return nvml.OpenInventory() }

// options are registry.Options for the shim's RegistryOptions.
func options(o helper.RegistryOptions) registry.Options {
	return registry.Options{PlainHTTP: o.PlainHTTP, DockerConfig: o.DockerConfig, Limits: o.Limits}
}

// markNotFound returns err, also matching regdef.ErrNotFound when it matches oras-go's
// errdef.ErrNotFound; its message is err's. nil for nil.
func markNotFound(err error) error {
	if err == nil || !errors.Is(err, errdef.ErrNotFound) {
		return err
	}
	return notFound{err}
}

// notFound is an error of the registry's that names something it does not have.
type notFound struct{ error }

func (e notFound) Unwrap() error { return e.error }

// Is reports whether target is regdef.ErrNotFound (the rest is Unwrap's).
func (e notFound) Is(target error) bool { return target == regdef.ErrNotFound }
