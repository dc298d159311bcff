package cuda

import (
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/berth-dev/berth/gpu"
)

// The C structures of the checkpoint API, laid out as cuda.h (CUDA 12.8+) declares them; the
// layout tests compare Sizeof/Offsetof with these comments and with a C compiler. Every reserved
// field must be zero: the driver rejects non-zero reserved fields with CUDA_ERROR_INVALID_VALUE.

// lockArgs is CUcheckpointLockArgs (64 bytes): timeoutMs at 0, reserved0 at 4, reserved1 at 8.
type lockArgs struct {
	timeoutMs uint32    // milliseconds to wait for the lock; 0 waits forever
	reserved0 uint32    // must be zero
	reserved1 [7]uint64 // must be zero
}

// checkpointArgs is CUcheckpointCheckpointArgs (64 bytes, all reserved).
type checkpointArgs struct {
	_ [8]uint64 // reserved, must be zero
}

// unlockArgs is CUcheckpointUnlockArgs (64 bytes, all reserved).
type unlockArgs struct {
	_ [8]uint64 // reserved, must be zero
}

// cuUUID is CUuuid: the 16 bytes of a GPU UUID.
type cuUUID [16]byte

// gpuPair is CUcheckpointGpuPair (32 bytes): oldUuid at 0, newUuid at 16.
type gpuPair struct {
	oldUUID cuUUID
	newUUID cuUUID
}

// restoreArgs is CUcheckpointRestoreArgs (64 bytes): gpuPairs (pointer) at 0, gpuPairsCount at
// 8, reserved[52-sizeof(pointer)] at 12, reserved1 at 56. This layout is for 64-bit pointers,
// the only kind NVIDIA's Linux driver ships (x86_64, aarch64).
type restoreArgs struct {
	gpuPairs      *gpuPair
	gpuPairsCount uint32
	reserved      [44]byte
	reserved1     uint64
}

// Result is a CUresult, the status every CUDA driver call returns (0 is CUDA_SUCCESS).
type Result int32

// The CUresult codes berth tells apart (values from cuda.h's enum cudaError_enum).
const (
	Success                   Result = 0
	ErrorInvalidValue         Result = 1
	ErrorOutOfMemory          Result = 2
	ErrorNotInitialized       Result = 3
	ErrorDeinitialized        Result = 4
	ErrorNoDevice             Result = 100
	ErrorInvalidDevice        Result = 101
	ErrorOperatingSystem      Result = 304
	ErrorInvalidHandle        Result = 400
	ErrorIllegalState         Result = 401
	ErrorNotFound             Result = 500
	ErrorNotReady             Result = 600
	ErrorNotPermitted         Result = 800
	ErrorNotSupported         Result = 801
	ErrorSystemNotReady       Result = 802
	ErrorSystemDriverMismatch Result = 803
	ErrorCompatNotSupported   Result = 804
	ErrorMPSConnectionFailed  Result = 805
	ErrorMPSRPCFailure        Result = 806
	ErrorMPSServerNotReady    Result = 807
	ErrorMPSMaxClientsReached Result = 808
	ErrorMPSMaxConnsReached   Result = 809
	ErrorMPSClientTerminated  Result = 810
	ErrorTimeout              Result = 909
	ErrorUnknown              Result = 999
)

// Kind returns the gpu sentinel error a CUresult means, or nil when it means none of them (the
// error then carries only the code and the driver's message):
//
//   - CUDA_ERROR_TIMEOUT, CUDA_ERROR_NOT_READY -> gpu.ErrTimeout (cuCheckpointProcessLock
//     documents NOT_READY, never TIMEOUT, for a lock that did not complete within timeoutMs: the
//     process is left RUNNING)
//   - CUDA_ERROR_OUT_OF_MEMORY -> gpu.ErrOutOfMemory (driver 580 answers it for a restore onto a
//     GPU without the free memory, cuda-checkpoint#44; the process is then wedged)
//   - CUDA_ERROR_ILLEGAL_STATE -> gpu.ErrIllegalState (wrong checkpoint state for the call)
//   - CUDA_ERROR_NOT_FOUND, CUDA_ERROR_INVALID_VALUE -> gpu.ErrNotCUDA (the driver's answer for a
//     PID that holds no CUDA context; berth passes only well-formed arguments, so an invalid
//     value is the PID)
//   - CUDA_ERROR_NOT_SUPPORTED, NOT_INITIALIZED, DEINITIALIZED, NO_DEVICE, NOT_PERMITTED,
//     SYSTEM_NOT_READY, SYSTEM_DRIVER_MISMATCH, COMPAT_NOT_SUPPORTED_ON_DEVICE and the MPS errors
//     -> gpu.ErrUnsupported (no usable driver, MIG or MPS in use, or not permitted)
//
// Error.Unwrap refines this by call (KindOf).
func (r Result) Kind() error {
	switch r {
	case ErrorTimeout, ErrorNotReady:
		return gpu.ErrTimeout
	case ErrorOutOfMemory:
		return gpu.ErrOutOfMemory
	case ErrorIllegalState:
		return gpu.ErrIllegalState
	case ErrorNotFound, ErrorInvalidValue:
		return gpu.ErrNotCUDA
	case ErrorNotSupported, ErrorNotInitialized, ErrorDeinitialized, ErrorNoDevice,
		ErrorNotPermitted, ErrorSystemNotReady, ErrorSystemDriverMismatch, ErrorCompatNotSupported,
		ErrorMPSConnectionFailed, ErrorMPSRPCFailure, ErrorMPSServerNotReady,
		ErrorMPSMaxClientsReached, ErrorMPSMaxConnsReached, ErrorMPSClientTerminated:
		return gpu.ErrUnsupported
	}
	return nil
}

// KindOf is Kind for the CUresult r of the driver call named call: the state queries
// (cuCheckpointProcessGetState, cuCheckpointProcessGetRestoreThreadId) answer NOT_INITIALIZED
// for a live PID that never initialised CUDA (NVIDIA's checkpoint agent takes it, like
// INVALID_VALUE, as "no CUDA state"), so there it means gpu.ErrNotCUDA: a container whose PID 1
// is a shell or tini is not refused for it. berth calls them only after cuInit succeeded.
func KindOf(call string, r Result) error {
	if r == ErrorNotInitialized && (call == "cuCheckpointProcessGetState" || call == "cuCheckpointProcessGetRestoreThreadId") {
		return gpu.ErrNotCUDA
	}
	return r.Kind()
}

// Error is a failed CUDA driver call: the C function (Call), its CUresult (Code) and the
// driver's name and description of the code (cuGetErrorName, cuGetErrorString; empty when the
// driver has none). It unwraps to KindOf(Call, Code), so errors.Is(err, gpu.ErrTimeout) works.
type Error struct {
	Call    string
	Code    Result
	Name    string
	Message string
}

// Error names the CUDA driver call, its CUresult name (or code), the driver's message, and
// the berth class of the code (gpu.Err*) when it has one.
func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = fmt.Sprintf("CUresult %d", int32(e.Code))
	}
	s := e.Call + ": " + name
	if e.Message != "" {
		s += " (" + e.Message + ")"
	}
	if k := KindOf(e.Call, e.Code); k != nil {
		s += ": " + k.Error()
	}
	return s
}

// Unwrap returns the gpu sentinel error the code means for the call (KindOf), or nil.
func (e *Error) Unwrap() error { return KindOf(e.Call, e.Code) }

// parseUUID turns "GPU-<8>-<4>-<4>-<4>-<12>" (NVML's and nvidia-smi's form; the "GPU-" prefix is
// optional) into the 16 bytes of a CUuuid.
func parseUUID(s string) (cuUUID, error) {
	var u cuUUID
	h := strings.ReplaceAll(strings.TrimPrefix(s, "GPU-"), "-", "")
	if len(h) != 2*len(u) {
		return u, fmt.Errorf("GPU UUID %q: want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", s)
	}
	if _, err := hex.Decode(u[:], []byte(h)); err != nil {
		return u, fmt.Errorf("GPU UUID %q: %w", s, err)
	}
	return u, nil
}
