package shim

import (
	"fmt"
	"strings"
	"time"

	"github.com/berth-dev/berth/gpu"
)

// restoreBounded calls drv.Restore(pid, remap) and waits at most timeout for it. The driver can
// hang a restore onto a GPU without the free memory the process needs (cuCheckpointProcessRestore
// never returns), and the call cannot be cancelled: past the bound restoreBounded returns an error
// wrapping gpu.ErrTimeout that names the process, the bound and the destination GPUs (pairs' New,
// with the free memory the inventory reports now), and leaves the call behind; the caller kills
// the process, which ends it. An error of the driver itself is returned wrapped with the PID.
func (s *Service) restoreBounded(drv gpu.Driver, pid int, remap, pairs []gpu.UUIDPair, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = DefaultConfig().GPURestoreTimeout()
	}
	done := make(chan error, 1) // buffered: a call that returns after the bound does not block
	go func() { done <- drv.Restore(pid, remap) }()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("GPU restore of pid %d: %w", pid, err)
		}
		return nil
	case <-t.C:
		return fmt.Errorf("GPU restore of pid %d did not finish within %v; %s may be full (gpu_restore_timeout_ms in %s): %w",
			pid, timeout, s.restoreTargets(pairs), s.configName(), gpu.ErrTimeout)
	}
}

// restoreTargets names the GPUs a restore maps onto, with the free memory each has now where
// the inventory tells ("GPU-a (0 bytes free)"), joined with " or ".
func (s *Service) restoreTargets(pairs []gpu.UUIDPair) string {
	devs, _ := s.deps.GPU.Inventory().Devices()
	var names []string
	for _, p := range pairs {
		if d, ok := findDevice(devs, p.New); ok {
			names = append(names, fmt.Sprintf("%s (%d bytes free)", p.New, d.MemoryFree()))
		} else {
			names = append(names, p.New)
		}
	}
	if len(names) == 0 {
		return "its GPU"
	}
	return strings.Join(names, " or ")
}
