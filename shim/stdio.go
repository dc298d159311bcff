package shim

import (
	"fmt"
	"os"
	"path/filepath"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"golang.org/x/sys/unix"
)

// restoreStdio gives a task that is restored from a checkpoint pipes for the standard streams
// it was created without. runc's restore hands the restored process runc's own stdin, stdout and
// stderr in place of the pipes it had when it was dumped; without a stream that is the host's
// /dev/null, which the process's mount namespace cannot name, so CRIU could never dump the task
// again (a second move would fail with "Can't lookup mount ... path=/dev/null"). A stdin FIFO in
// the bundle, held open by the shim for the task's life, and output to file:///dev/null give the
// runc shim pipes to pass instead. It returns the held FIFO (closed on Delete), or nil.
func restoreStdio(r *taskAPI.CreateTaskRequest) (*os.File, error) {
	if r.Terminal {
		return nil, nil
	}
	var hold *os.File
	if r.Stdin == "" {
		fifo := filepath.Join(r.Bundle, "berth-stdin")
		if err := unix.Mkfifo(fifo, 0o600); err != nil && !os.IsExist(err) {
			return nil, fmt.Errorf("stdin FIFO for the restored task: %w", err)
		}
		// read-write: a reader exists from now on, so the runc shim can open the write side
		// without blocking; nothing is ever written, the process sees an idle stdin
		f, err := os.OpenFile(fifo, os.O_RDWR, 0)
		if err != nil {
			return nil, fmt.Errorf("stdin FIFO for the restored task: %w", err)
		}
		hold, r.Stdin = f, fifo
	}
	if r.Stdout == "" && r.Stderr == "" {
		r.Stdout, r.Stderr = "file:///dev/null", "file:///dev/null"
	}
	return hold, nil
}
