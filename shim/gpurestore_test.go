package shim

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/api/types/task"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// hangDriver is a scriptDriver whose Restore never returns until release is closed, as the real
// driver's cuCheckpointProcessRestore onto a full GPU.
type hangDriver struct {
	*scriptDriver
	release chan struct{}
}

func (d hangDriver) Restore(int, []gpu.UUIDPair) error {
	<-d.release
	return gpu.ErrOutOfMemory
}

// TestRestoreGPUsTimeout: a GPU restore that never answers is abandoned after
// gpu_restore_timeout_ms with an error that names the process, the bound and the destination GPU
// with its free memory, of class Unavailable; no process is unlocked.
func TestRestoreGPUsTimeout(t *testing.T) {
	s, inner, drv := gpuFixture(t, task.Status_RUNNING)
	drv.state[101], drv.state[102] = gpu.StateCheckpointed, gpu.StateCheckpointed
	hd := hangDriver{scriptDriver: drv, release: make(chan struct{})}
	defer close(hd.release)
	be := s.deps.GPU.(*scriptBackend)
	be.devs[0].MemoryUsed = be.devs[0].MemoryTotal
	s.deps.GPU = hangBackend{scriptBackend: be, drv: hd}
	s.cfg.GPURestoreTimeoutMs = 50
	_ = inner
	start := time.Now()
	err := s.restoreGPUs(context.Background(), "c", []gpu.UUIDPair{{Old: "GPU-x", New: "GPU-a"}}, nil, 0, checkpoint.NewPhases(time.Now))
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("restoreGPUs took %v with a 50ms bound", took)
	}
	if !errors.Is(err, gpu.ErrTimeout) || errorClass(err).Error() != "unavailable" {
		t.Fatalf("error %v (class %v), want gpu.ErrTimeout, Unavailable", err, errorClass(err))
	}
	for _, want := range []string{"GPU restore of pid 101 did not finish within 50ms", "GPU-a (0 bytes free) may be full", "gpu_restore_timeout_ms"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	for _, c := range drv.calls {
		if strings.HasPrefix(c, "unlock") {
			t.Errorf("unlocked after a timed-out restore: %v", drv.calls)
		}
	}
}

// TestRestoreGPUsOutOfMemory: a driver that refuses the restore (a full GPU) answers
// ResourceExhausted, naming the process.
func TestRestoreGPUsOutOfMemory(t *testing.T) {
	s, _, drv := gpuFixture(t, task.Status_RUNNING)
	drv.state[101] = gpu.StateCheckpointed
	hd := hangDriver{scriptDriver: drv, release: make(chan struct{})}
	close(hd.release)
	s.deps.GPU = hangBackend{scriptBackend: s.deps.GPU.(*scriptBackend), drv: hd}
	err := s.restoreGPUs(context.Background(), "c", []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-a"}}, nil, 0, checkpoint.NewPhases(time.Now))
	if !errors.Is(err, gpu.ErrOutOfMemory) || !strings.Contains(err.Error(), "GPU restore of pid 101") {
		t.Fatalf("error %v, want the pid and gpu.ErrOutOfMemory", err)
	}
	if c := errorClass(err); c.Error() != "resource exhausted" {
		t.Errorf("class %v, want resource exhausted", c)
	}
}

// TestRestoreGPUsRecordedProcess (issue 21): a CUDA process the checkpoint recorded that the
// driver does not report CHECKPOINTED after the CRIU restore, or that the restored task lacks,
// fails the restore naming it; once it was skipped, left locked without its device memory.
func TestRestoreGPUsRecordedProcess(t *testing.T) {
	for _, tc := range []struct {
		name     string
		recorded []int
		want     string
	}{
		{"running, not checkpointed", []int{101, 102}, "CUDA process 102"},
		{"not a process of the task", []int{101, 103}, "CUDA process 103 (its PID in the container)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _, drv := gpuFixture(t, task.Status_RUNNING)
			drv.state[101] = gpu.StateCheckpointed // 102 stays RUNNING
			err := s.restoreGPUs(context.Background(), "c", []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-a"}}, tc.recorded, 0, checkpoint.NewPhases(time.Now))
			if !errors.Is(err, gpu.ErrIllegalState) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want gpu.ErrIllegalState naming %q", err, tc.want)
			}
			if len(drv.calls) != 0 {
				t.Errorf("driver calls %v before the check", drv.calls)
			}
		})
	}
	s, _, drv := gpuFixture(t, task.Status_RUNNING)
	drv.state[101], drv.state[102] = gpu.StateCheckpointed, gpu.StateCheckpointed
	if err := s.restoreGPUs(context.Background(), "c", nil, []int{101, 102}, 0, checkpoint.NewPhases(time.Now)); err != nil {
		t.Fatalf("every recorded process checkpointed: %v", err)
	}
}

// TestGPURestoreBound: the bound grows a second per GiB of recorded device memory.
func TestGPURestoreBound(t *testing.T) {
	c := DefaultConfig()
	if got := c.GPURestoreBound(0); got != 2*time.Minute {
		t.Errorf("no device memory: %v", got)
	}
	if got := c.GPURestoreBound(141 << 30); got != 2*time.Minute+141*time.Second {
		t.Errorf("an H200's 141 GiB: %v", got)
	}
}

type hangBackend struct {
	*scriptBackend
	drv gpu.Driver
}

func (b hangBackend) Driver() gpu.Driver       { return b.drv }
func (b hangBackend) Inventory() gpu.Inventory { return b.scriptBackend }
