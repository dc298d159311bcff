package fakecuda

import "github.com/berth-dev/berth/gpu"

// Defaults of the container view of the fake GPU.
const (
	// DefaultDevRoot is the directory under which a container sees its fake GPUs, one directory
	// per GPU named by the container's device order ("/dev/berth-gpu/0").
	DefaultDevRoot = "/dev/berth-gpu"
	// DefaultSocketDir is the directory, inside the container, where a fake CUDA process listens
	// on "<pid>.sock" (pid in its own PID namespace) for checkpoint control requests.
	DefaultSocketDir = "/run/berth-fakecuda"
	// UUIDFile is the file in a GPU directory that holds the GPU's UUID.
	UUIDFile = "uuid"
	// MemoryFile is the file in a GPU directory that holds its memory size in bytes (decimal).
	MemoryFile = "memory"
	// DriverFile is the file in a GPU directory that holds the node's driver version.
	DriverFile = "driver"
	// MemPrefix starts the name of every device memory file in a GPU directory.
	MemPrefix = "mem-"
	// LockFile is the file in a GPU directory whose flock serializes its memory accounting.
	LockFile = "lock"
	// RestoreWhenFullFile is the file in a GPU directory that says what a restore onto the GPU
	// does when the GPU lacks the free memory the process needs: FullRefuse (the default, also
	// when the file is absent) or FullHang.
	RestoreWhenFullFile = "restore-when-full"
)

// Modes of RestoreWhenFullFile.
const (
	// FullRefuse: the restore fails with CodeOutOfMemory (gpu.ErrOutOfMemory) and the process
	// stays CHECKPOINTED, nothing placed on any GPU.
	FullRefuse = "refuse"
	// FullHang: the restore never answers, as the real driver's can on a full GPU; the process
	// stays CHECKPOINTED, its control thread stuck (every later control call goes unanswered),
	// until it exits. Nothing is placed on any GPU, and no GPU lock is held meanwhile.
	FullHang = "hang"
)

// Ops of the control protocol: one JSON Request per line, answered by one JSON Response line.
const (
	OpState           = "state"
	OpRestoreThreadID = "restoreThreadId"
	OpLock            = "lock"
	OpCheckpoint      = "checkpoint"
	OpRestore         = "restore"
	OpUnlock          = "unlock"
	OpUsage           = "usage"
)

// Error codes of a Response.
const (
	CodeIllegalState = "illegal-state"
	CodeTimeout      = "timeout"
	CodeUnsupported  = "unsupported"
	CodeFailed       = "failed"
	CodeBadRequest   = "bad-request"
	CodeOutOfMemory  = "out-of-memory"
)

// Request is one control request.
type Request struct {
	Op string `json:"op"`
	// TimeoutMs is Lock's timeout in milliseconds.
	TimeoutMs int64 `json:"timeoutMs,omitempty"`
	// Pairs remap GPUs on Restore.
	Pairs []gpu.UUIDPair `json:"pairs,omitempty"`
	// Driver is the node's driver version ("580.65.06"), for Restore; empty: read it from the
	// DriverFile of the process's first GPU directory.
	Driver string `json:"driver,omitempty"`
}

// Response answers a Request. Error is empty on success; Code classifies it.
type Response struct {
	State gpu.ProcessState `json:"state"`
	TID   int              `json:"tid,omitempty"`
	// Usage is the device memory of the process per GPU UUID, in bytes (OpUsage).
	Usage map[string]uint64 `json:"usage,omitempty"`
	Error string            `json:"error,omitempty"`
	Code  string            `json:"code,omitempty"`
}
