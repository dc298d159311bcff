package fakecuda

// Device memory accounting, shared by the process (Malloc, Restore) and the node (gpu/fake's
// inventory), as the driver keeps it for a real GPU:
//
//   - A GPU's used memory is the size of the device memory files in its directory: those of
//     processes (mem-<nspid>-<tag>-<seq>, see processFile) and any other mem-* file, which stands
//     for memory held by something that is not a CUDA process of this node (the tests' way to
//     fill a GPU) and is counted but never freed by the accounting.
//   - A process's file is live while some process has it open or mapped. Whether one has is the
//     kernel's own reference count on the file: a write lease (F_SETLEASE F_WRLCK) is granted
//     only when no other open file description refers to the file, and a MAP_SHARED mapping keeps
//     the one it was made from. The kernel drops those references when the process exits, however
//     it exits (exit, SIGKILL, a restore that failed and was killed), before it is even reaped, so
//     no pid, start time or namespace is involved and a pid reused by another process changes
//     nothing. A process file that is not live is the memory of a dead process: the accounting
//     deletes it (the driver frees a dead process's memory) before it counts.
//   - Every check-and-allocate (Malloc, Restore) and every accounting pass holds the GPU's lock
//     (flock on LockFile), so that concurrent processes cannot over-commit a GPU.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// LockWait bounds how long an allocation or an accounting pass waits for a GPU's lock.
const LockWait = 10 * time.Second

// processFile matches the name of a process's device memory file: MemPrefix, the process's pid
// in its PID namespace, its context's tag (8 hex digits) and a sequence number.
// Compiled by the first use: the shim links this package.
var processFile = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^` + MemPrefix + `[0-9]+-[0-9a-f]{8}-[0-9]+$`) })

// IsProcessFile reports whether name (a file name in a GPU directory) is a process's device
// memory file, which the accounting frees once no process holds it.
func IsProcessFile(name string) bool { return processFile().MatchString(name) }

// lockGPUs takes the lock of every GPU directory in dirs (in sorted order, each once) and returns
// the function that releases them. It fails naming the lock it could not take within LockWait.
func lockGPUs(dirs ...string) (func(), error) {
	dirs = slices.Clone(dirs)
	slices.Sort(dirs)
	dirs = slices.Compact(dirs)
	var fds []int
	unlock := func() {
		for _, fd := range fds {
			unix.Close(fd) // releases the flock
		}
	}
	for _, d := range dirs {
		p := filepath.Join(d, LockFile)
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
		if err != nil {
			unlock()
			return nil, fmt.Errorf("GPU lock %s: %w", p, err)
		}
		fds = append(fds, fd)
		deadline := time.Now().Add(LockWait)
		for {
			err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
			if err == nil {
				break
			}
			if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
				unlock()
				return nil, fmt.Errorf("GPU lock %s: %w", p, err)
			}
			if time.Now().After(deadline) {
				unlock()
				return nil, fmt.Errorf("GPU lock %s: still held after %v", p, LockWait)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	return unlock, nil
}

// freeIfDead deletes the device memory file at p when no process holds it open or mapped, and
// reports whether it did (or found it gone). It keeps the file when it cannot tell (no lease
// permitted on this file system or for this user, or the file cannot be deleted): memory is
// never freed on a guess.
func freeIfDead(p string) bool {
	// O_NONBLOCK: an open that would wait for another's lease to be broken fails instead.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return errors.Is(err, unix.ENOENT)
	}
	defer unix.Close(fd) // also releases the lease
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_WRLCK); err != nil {
		return false // EAGAIN: open or mapped elsewhere; anything else: cannot tell
	}
	// Nobody else holds it: delete it under the lease (an open by another waits for the lease to
	// be released, and then finds the name gone).
	err = unix.Unlink(p)
	return err == nil || errors.Is(err, unix.ENOENT)
}

// Memory is a GPU directory's device memory as the accounting sees it.
type Memory struct {
	// Used is the size of the live device memory files, in bytes.
	Used uint64
	// Files are the live device memory files (names) and their sizes.
	Files map[string]uint64
	// Freed are the files of exited processes this pass deleted.
	Freed []string
}

// account frees the device memory of exited processes in GPU directory dir and returns what
// remains. The caller holds dir's lock.
func account(dir string) (Memory, error) {
	m := Memory{Files: map[string]uint64{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return m, err
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, MemPrefix) {
			continue
		}
		p := filepath.Join(dir, name)
		if IsProcessFile(name) && freeIfDead(p) {
			m.Freed = append(m.Freed, name)
			continue
		}
		fi, err := e.Info()
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return m, err
		}
		m.Files[name] = uint64(fi.Size())
		m.Used += uint64(fi.Size())
	}
	return m, nil
}

// Account frees the device memory of exited processes in GPU directory dir (deleting their
// files) and returns the GPU's memory that remains, under the GPU's lock.
func Account(dir string) (Memory, error) {
	unlock, err := lockGPUs(dir)
	if err != nil {
		return Memory{}, err
	}
	defer unlock()
	return account(dir)
}

// restoreWhenFull returns the GPU directory's RestoreWhenFullFile mode (FullRefuse when absent).
func restoreWhenFull(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, RestoreWhenFullFile))
	if errors.Is(err, os.ErrNotExist) {
		return FullRefuse, nil
	}
	if err != nil {
		return "", err
	}
	switch m := strings.TrimSpace(string(b)); m {
	case "", FullRefuse:
		return FullRefuse, nil
	case FullHang:
		return FullHang, nil
	default:
		return "", fmt.Errorf("%s: %q: want %q or %q", filepath.Join(dir, RestoreWhenFullFile), m, FullRefuse, FullHang)
	}
}
