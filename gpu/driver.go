package gpu

import (
	"errors"
	"fmt"
	"time"
)

// ProcessState is a process's CUDA checkpoint state, as cuCheckpointProcessGetState reports it
// (CUprocessState).
type ProcessState int

// The states of CUprocessState. A process moves RUNNING -> LOCKED (Lock) -> CHECKPOINTED
// (Checkpoint: device memory copied into host memory, GPU resources released) -> LOCKED (Restore,
// on the same or mapped GPUs) -> RUNNING (Unlock). FAILED is terminal.
const (
	StateRunning      ProcessState = 0
	StateLocked       ProcessState = 1
	StateCheckpointed ProcessState = 2
	StateFailed       ProcessState = 3
)

// String returns the driver's name for the state ("running", "locked", ...).
func (s ProcessState) String() string {
	switch s {
	case StateRunning:
		return "running"
	case StateLocked:
		return "locked"
	case StateCheckpointed:
		return "checkpointed"
	case StateFailed:
		return "failed"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// UUIDPair maps a GPU of the checkpoint (Old) to a GPU of this node (New), both "GPU-<uuid>".
type UUIDPair struct {
	Old string `json:"old"`
	New string `json:"new"`
}

// Versions are a node's driver versions.
type Versions struct {
	// Driver is the kernel driver version ("580.65.06"); DriverMajor its first number (580).
	Driver      string `json:"driver"`
	DriverMajor int    `json:"-"`
	// CUDA is the CUDA driver API version ("12.8", from cuDriverGetVersion 12080).
	CUDA string `json:"cuda"`
}

// Driver is the CUDA driver's process checkpoint API (CUDA driver >= 570; UUID remapping on
// restore >= 580). Every method takes a host PID. Implementations: gpu/cuda (libcuda.so.1) and
// gpu/fake.
type Driver interface {
	// Versions returns the driver and CUDA driver versions.
	Versions() (Versions, error)
	// State returns pid's checkpoint state; ErrNotCUDA when the process holds no CUDA context.
	State(pid int) (ProcessState, error)
	// RestoreThreadID returns the thread id (TID) that performs pid's restore.
	RestoreThreadID(pid int) (int, error)
	// Lock stops pid's CUDA work: new calls block, in-flight work finishes. It needs pid's
	// threads to run (a frozen cgroup never locks) and fails with ErrTimeout after timeout.
	Lock(pid int, timeout time.Duration) error
	// Checkpoint copies a locked process's device memory into its host memory and releases its
	// GPU resources (state CHECKPOINTED).
	Checkpoint(pid int) error
	// Restore brings a checkpointed process's device memory back onto GPUs (state LOCKED). pairs
	// remap the checkpoint's GPUs to this node's (nil: the same GPUs); remapping needs driver >= 580.
	// A GPU without the free memory the process needs refuses it with ErrOutOfMemory, or, as the
	// real driver can, never answers: the caller bounds it (and kills the process on expiry).
	Restore(pid int, pairs []UUIDPair) error
	// Unlock lets a locked process's CUDA work run again (state RUNNING).
	Unlock(pid int) error
}

// Errors a Driver returns, wrapped with the PID and the step.
var (
	// ErrNotCUDA: the process has no CUDA state (it is not a CUDA process).
	ErrNotCUDA = errors.New("not a CUDA process")
	// ErrTimeout: Lock did not complete in time (the workload is busy, or its threads cannot run).
	ErrTimeout = errors.New("timed out")
	// ErrIllegalState: the call is not valid in the process's current state.
	ErrIllegalState = errors.New("illegal state for this call")
	// ErrUnsupported: the driver lacks the API (too old, MIG or MPS in use, no driver).
	ErrUnsupported = errors.New("not supported by this driver")
	// ErrOutOfMemory: the GPU has too little free device memory for the call (an allocation, or
	// a Restore of a checkpointed process onto it; CUDA_ERROR_OUT_OF_MEMORY). A refused Restore
	// leaves the process CHECKPOINTED. The real driver may instead never return from a Restore
	// onto a full GPU: callers bound Restore with their own timeout.
	ErrOutOfMemory = errors.New("out of memory")
)

// Minimum driver versions for the checkpoint API and for UUID remapping on restore.
const (
	MinDriverCheckpoint = 570
	MinDriverRemap      = 580
)

// CheckDriver returns nil when v supports the checkpoint API (and remapping when remap is set),
// else an error wrapping ErrUnsupported that names the version found and the one needed.
// CheckDevice refuses a GPU the CUDA checkpoint API cannot take: one in MIG mode ("MIG isn't
// supported right now", an NVIDIA maintainer on cuda-checkpoint#42; a checkpoint then fails with
// an out-of-memory error that names nothing). The error wraps ErrUnsupported and names the GPU.
func CheckDevice(d Device) error {
	if d.MIG {
		return fmt.Errorf("GPU %s (%s) is in MIG mode, which NVIDIA's CUDA checkpoint API does not support: %w", d.UUID, d.Name, ErrUnsupported)
	}
	return nil
}

func CheckDriver(v Versions, remap bool) error {
	if v.DriverMajor < MinDriverCheckpoint {
		return fmt.Errorf("CUDA checkpoint API needs NVIDIA driver >= %d, this node has %s: %w", MinDriverCheckpoint, v.Driver, ErrUnsupported)
	}
	if remap && v.DriverMajor < MinDriverRemap {
		return fmt.Errorf("restoring onto other GPUs (UUID remapping) needs NVIDIA driver >= %d, this node has %s: %w", MinDriverRemap, v.Driver, ErrUnsupported)
	}
	return nil
}
