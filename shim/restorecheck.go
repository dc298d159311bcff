package shim

import (
	"fmt"
	"os"

	"github.com/berth-dev/berth/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// checkRestoreFits refuses, before anything is created, a restore that CRIU would fail on this
// node for a reason the spec already shows: a bind mount whose source does not exist here
// (ErrMountSource), or a memory limit below the memory the checkpoint holds (ErrOutOfMemory).
// Each refusal names the field, its value and what the checkpoint needs.
func checkRestoreFits(plan *restorePlan, spec *specs.Spec) error {
	for i, m := range spec.Mounts {
		if !oci.IsBindMount(m) {
			continue
		}
		if _, err := os.Stat(m.Source); err != nil {
			return mark(fmt.Errorf("mounts[%d] (destination %s): bind source %s: %w; create it on this node with what it held on the source node, or restore where it exists",
				i, m.Destination, m.Source, err), ErrMountSource)
		}
	}
	if plan == nil {
		return nil
	}
	need, limit := plan.manifest.MemoryBytes(), oci.MemoryLimit(spec)
	if limit > 0 && need > limit {
		return mark(fmt.Errorf("linux.resources.memory.limit is %d bytes, below the %d bytes of memory pages checkpoint %s holds: CRIU would be OOM-killed restoring it; raise the limit to at least %d bytes (the pages and what CRIU charges to the container's cgroup while it restores)",
			limit, need, plan.name(), need+restoreHeadroom), ErrOutOfMemory)
	}
	return nil
}
