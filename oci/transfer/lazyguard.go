package transfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// The lazy guard. A task restored from a lazy checkpoint gets its missing pages through a
// userfaultfd that only the `criu lazy-pages` daemon holds; when the daemon exits, the kernel
// unregisters the ranges and every page not yet copied reads as zeros. The daemon exits as soon
// as its page socket ends, so a receiver that died (with the berthctl it ran in) would let the
// task run on with corrupt memory. The guard is the daemon's parent and outlives the receiver
// (its own session, SIGHUP/SIGINT/SIGTERM ignored): it holds a duplicate of the receiver's end of
// the daemon's page socket, so that the daemon never sees that socket end while the guard lives,
// and a control pipe from the receiver. If the control pipe ends (the receiver ended the stream
// or died) or the daemon exits unsuccessfully before every page arrived, the guard first kills
// the task restored from the checkpoint (checkpoint.LazyTask: SIGKILL to every process of its
// cgroup, until none is left), then lets the daemon go, removes the checkpoint, its stamp and the
// daemon's directory, and asks LazyGuardOptions.Cleanup to remove the task's container.
//
// The receiver starts it as Receiver.LazyGuard with these open files:
//
//	fd 3: the daemon's end of the page socket (handed on to criu lazy-pages as --ps-socket 3);
//	fd 4: the write end of the daemon's status pipe (handed on as --status-fd 4);
//	fd 5: a duplicate of the receiver's end of the page socket (held);
//	fd 6: the read end of the control pipe (the receiver holds the write end and never writes).
//
// and the checkpoint's directory as its last argument. Its exit status is the daemon's verdict:
// 0 only when the daemon exited successfully (every page arrived, or the task exited).

// Lazy guard file descriptors (see above).
const (
	lazyGuardSocketFD = 3
	lazyGuardStatusFD = 4
	lazyGuardHeldFD   = 5
	lazyGuardCtlFD    = 6
)

// LazyGuardKillTimeout bounds how long the guard waits for a killed task's processes to be gone.
const LazyGuardKillTimeout = 30 * time.Second

// LazyGuardOptions configure RunLazyGuard.
type LazyGuardOptions struct {
	// CRIU is the criu binary ("" means "criu" on PATH).
	CRIU string
	// Checkpoint is the checkpoint directory the daemon serves (in a receiver's root).
	Checkpoint string
	// Log receives the guard's own messages (the daemon logs into its directory).
	Log io.Writer
	// Cleanup, when set, removes the killed task's container (task record, container, writable
	// layer) through containerd; its error is logged.
	Cleanup func(ctx context.Context, t *checkpoint.LazyTask) error
}

// RunLazyGuard is the guard's process (see above): it starts `criu lazy-pages` for
// o.Checkpoint on the inherited files and returns nil once the daemon exited successfully, or
// an error naming why the stream failed (the task restored from the checkpoint, if any, then
// killed and gone before the daemon lost its input). It ignores SIGHUP, SIGINT, SIGTERM and
// SIGPIPE.
func RunLazyGuard(ctx context.Context, o LazyGuardOptions) error {
	signal.Ignore(syscall.SIGHUP, syscall.SIGINT, syscall.SIGTERM, syscall.SIGPIPE)
	if o.Log == nil {
		o.Log = io.Discard
	}
	logf := func(format string, args ...any) {
		fmt.Fprintf(o.Log, "%s lazy guard %d: %s\n", time.Now().UTC().Format(time.RFC3339Nano), os.Getpid(), fmt.Sprintf(format, args...))
	}
	final, err := filepath.Abs(o.Checkpoint)
	if err != nil {
		return err
	}
	sock := os.NewFile(lazyGuardSocketFD, "lazy-pages-socket")
	status := os.NewFile(lazyGuardStatusFD, "lazy-pages-status")
	held := os.NewFile(lazyGuardHeldFD, "lazy-pages-held")
	ctl := os.NewFile(lazyGuardCtlFD, "lazy-guard-control")
	if sock == nil || status == nil || held == nil || ctl == nil {
		return errors.New("lazy guard: started without its files (fds 3-6)")
	}
	dir := checkpoint.LazyPagesDir(final)
	logFile := filepath.Join(dir, "lazy-pages.log")
	criuPath := o.CRIU
	if criuPath == "" {
		criuPath = "criu"
	}
	cmd := exec.Command(criuPath, "lazy-pages", "--page-server", "--ps-socket", "3",
		"--images-dir", filepath.Join(final, checkpoint.ImagesDir), "--work-dir", dir,
		"-o", logFile, "-v2", "--status-fd", "4")
	cmd.ExtraFiles = []*os.File{sock, status}
	err = cmd.Start()
	sock.Close()
	status.Close()
	if err != nil {
		held.Close()
		return fmt.Errorf("start criu lazy-pages: %w", err)
	}
	logf("criu lazy-pages %d serves %s", cmd.Process.Pid, final)
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ctlEnded := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, ctl)
		close(ctlEnded)
	}()
	// the daemon's exit wins over the control stream's end when both happened
	var werr error
	daemonGone := true
	select {
	case werr = <-exited:
	case <-ctlEnded:
		select {
		case werr = <-exited:
		default:
			daemonGone = false
		}
	}
	reason := "the lazy page stream ended before every page arrived (the receiver ended it, or died)"
	if daemonGone {
		if werr == nil {
			held.Close()
			logf("criu lazy-pages exited successfully")
			return nil
		}
		reason = fmt.Sprintf("criu lazy-pages exited before every page arrived: %v%s", werr, logErrors(logFile))
	}
	logf("%s", reason)
	// the task first: while this process lives, the daemon keeps its userfaultfd, and a missing
	// page blocks the task instead of reading as zeros
	kerr := killLazyTask(ctx, dir, reason, o, logf)
	if kerr != nil {
		logf("%v", kerr)
	}
	held.Close()
	if !daemonGone {
		_ = cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(LazyGuardKillTimeout):
			logf("criu lazy-pages %d did not exit", cmd.Process.Pid)
		}
	}
	// the receiver may be gone: nothing of the stream stays (removing twice is harmless)
	rerr := errors.Join(os.RemoveAll(final), checkpoint.RemoveStamp(final), os.RemoveAll(dir))
	if rerr != nil {
		logf("remove the lazy checkpoint: %v", rerr)
	}
	if kerr != nil {
		return fmt.Errorf("%s; the task restored from it could not be killed: %w", reason, kerr)
	}
	return errors.New(reason)
}

// killLazyTask, under the lazy lock of dir, marks the stream failed and kills the task
// restored from the checkpoint (if any) until its cgroup holds no process, then notes the
// reason in its bundle and removes its container (o.Cleanup).
func killLazyTask(ctx context.Context, dir, reason string, o LazyGuardOptions, logf func(string, ...any)) error {
	unlock, err := checkpoint.LockLazy(dir)
	if err != nil {
		return fmt.Errorf("lock the lazy task record: %w", err)
	}
	defer unlock()
	if err := checkpoint.MarkLazyFailed(dir, reason); err != nil {
		return err
	}
	t, err := checkpoint.ReadLazyTask(dir)
	if err != nil {
		return err
	}
	if t == nil {
		logf("no task was restored from the checkpoint")
		return nil
	}
	_ = os.WriteFile(filepath.Join(t.Bundle, checkpoint.LazyFailedBundleFile),
		[]byte(reason+"; the task was killed before it could read a missing page\n"), 0o600)
	n, err := KillCgroup(t.Procs, LazyGuardKillTimeout)
	if err != nil {
		return fmt.Errorf("kill task %s (pid %d): %w", t.ID, t.Pid, err)
	}
	logf("task %s (pid %d): %d process(es) killed, none left in %s", t.ID, t.Pid, n, t.Procs)
	if o.Cleanup != nil {
		if err := o.Cleanup(context.WithoutCancel(ctx), t); err != nil {
			logf("remove container %s: %v", t.ID, err)
		} else {
			logf("container %s removed", t.ID)
		}
	}
	return nil
}

// KillCgroup sends SIGKILL to every process listed in procs (a cgroup's cgroup.procs), thaws
// the cgroup (a frozen process dies only once thawed), and repeats until procs lists none or
// is gone, for at most timeout. It returns how many processes it signalled; the error says
// what is left.
func KillCgroup(procs string, timeout time.Duration) (int, error) {
	dir := filepath.Dir(procs)
	killed := map[int]bool{}
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(procs)
		if errors.Is(err, os.ErrNotExist) {
			return len(killed), nil
		}
		if err != nil {
			return len(killed), err
		}
		var left []int
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				left = append(left, pid)
			}
		}
		if len(left) == 0 {
			return len(killed), nil
		}
		if time.Now().After(deadline) {
			return len(killed), fmt.Errorf("processes %v still in %s %v after SIGKILL", left, dir, timeout)
		}
		for _, pid := range left {
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				killed[pid] = true
			}
		}
		_ = os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0o644)
		_ = os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("0"), 0o644)
		time.Sleep(10 * time.Millisecond)
	}
}
