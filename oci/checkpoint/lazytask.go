package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The lazy restore's task record: how the destination shim (which restores a task from a
// checkpoint taken in lazy mode) and the guard of that checkpoint's `criu lazy-pages` daemon
// (oci/transfer's lazy guard, which outlives the receiver) agree on which task has pages
// missing. Both work in LazyPagesDir. The shim holds LazyLockFile locked (flock, exclusive)
// from before runc's restore until it wrote LazyTaskFile (or gave up); the guard takes the same
// lock before it decides that the stream failed, writes LazyFailedFile under it, and kills the
// task LazyTaskFile names. So a restore either finished before the guard looked (its task is
// killed) or starts after (the shim sees LazyFailedFile and refuses): no task restored from the
// checkpoint runs on once its pages stopped coming.

const (
	// LazyLockFile is the lock file in LazyPagesDir (flock, exclusive; LockLazy).
	LazyLockFile = "berth-task.lock"
	// LazyTaskFile is the task record in LazyPagesDir: a LazyTask as JSON.
	LazyTaskFile = "berth-task.json"
	// LazyFailedFile in LazyPagesDir says that the lazy page stream failed; it holds the reason.
	LazyFailedFile = "berth-lazy-failed"
	// LazyFailedBundleFile is the file the guard writes into the bundle of a task it killed
	// because its pages stopped coming: the reason, as text (the shim reports it).
	LazyFailedBundleFile = "berth-lazy-failed"
)

// LazyTask is the task restored from a lazy checkpoint, as its shim saw it right after runc's
// restore.
type LazyTask struct {
	// Pid is the task's init process (host PID namespace).
	Pid int `json:"pid"`
	// Procs is the cgroup.procs file of the task's cgroup (v1: the freezer hierarchy's; v2: the
	// unified one): every process of the task.
	Procs string `json:"procs"`
	// Bundle is the task's bundle directory.
	Bundle string `json:"bundle"`
	// Namespace and ID are the containerd namespace and container id; Address containerd's
	// socket ("" when the shim does not know it).
	Namespace string `json:"namespace"`
	ID        string `json:"id"`
	Address   string `json:"address,omitempty"`
}

// LockLazy locks LazyLockFile in lazyDir (creating it), waiting for another holder; unlock
// releases it. Errors: the directory is missing (no daemon serves the checkpoint) or the lock
// cannot be taken.
func LockLazy(lazyDir string) (unlock func(), _ error) {
	f, err := os.OpenFile(filepath.Join(lazyDir, LazyLockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	return func() {
		_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	}, nil
}

// WriteLazyTask writes t as LazyTaskFile into lazyDir (the caller holds LockLazy).
func WriteLazyTask(lazyDir string, t LazyTask) error {
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(lazyDir, LazyTaskFile), b, 0o600)
}

// ReadLazyTask reads LazyTaskFile from lazyDir: nil, nil when no task was restored.
func ReadLazyTask(lazyDir string) (*LazyTask, error) {
	b, err := os.ReadFile(filepath.Join(lazyDir, LazyTaskFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var t LazyTask
	if err := json.Unmarshal(b, &t); err != nil {
		return nil, fmt.Errorf("%s: %w", LazyTaskFile, err)
	}
	return &t, nil
}

// LazyFailed returns the reason in lazyDir's LazyFailedFile and whether it exists.
func LazyFailed(lazyDir string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(lazyDir, LazyFailedFile))
	if err != nil {
		return "", false
	}
	return string(b), true
}

// MarkLazyFailed writes reason as LazyFailedFile into lazyDir (the caller holds LockLazy).
func MarkLazyFailed(lazyDir, reason string) error {
	return os.WriteFile(filepath.Join(lazyDir, LazyFailedFile), []byte(reason), 0o600)
}
