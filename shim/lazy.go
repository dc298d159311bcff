package shim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// Lazy (post-copy) mode, on the source: runc's checkpoint with "lazy-pages" in the bundle's CRIU
// configuration (pageserver.go) dumps everything but the memory, then CRIU listens on the lazy
// page server's address and serves the pages from the frozen task until the destination's
// `criu lazy-pages` daemon has them all, or until the stream fails. runc's checkpoint returns
// only then; the shim's Checkpoint request returns as soon as CRIU listens (the images are
// complete then: CRIU opens the listening socket after it wrote its inventory), so that the
// checkpoint can be sent and restored while the pages are still here.
//
// While CRIU serves the pages, runc's shim holds the task: Kill, Resume, Pause and State wait
// for the dump's end. The shim's own Kill and Resume wait for the rest of it too (giving the GPUs
// back after a failed stream), so that a caller that thaws or stops the task acts on a task
// CRIU has let go of. A failed stream leaves the task frozen as before the dump, its GPUs given
// back; a served one leaves it frozen for the caller to stop.

// lazyDump is a lazy dump in progress: runc's checkpoint, running until the pages are served.
type lazyDump struct {
	id   string
	addr string
	g    *gpuSession
	// pid is the task's init; paused whether the task was paused when the dump began (a failed
	// transfer leaves it as it was: refreeze)
	pid    int
	paused bool
	// runc is the result of runc's checkpoint; closed once it is sent
	runc chan error
	// abandoned is set by the first abandonLazyDump
	abandoned atomic.Bool
	// done is closed once the dump ended and what it held is cleaned up; err says how it ended
	done chan struct{}
	err  error
}

// lazyReadyPoll is how often dumpLazy looks for CRIU's listening socket.
const lazyReadyPoll = 5 * time.Millisecond

// dumpLazy starts runc's lazy checkpoint of r (with ctx's values, not its cancellation: it
// outlives the request) and returns once CRIU's lazy page server listens on addr, with the
// digests of the images it wrote (phase criu-dump: the time until then). If runc's checkpoint
// ends first, the GPU session is undone and the error carries CRIU's last errors.
func (s *Service) dumpLazy(ctx context.Context, r *taskAPI.CheckpointTaskRequest, st *taskAPI.StateResponse, workDir, addr string, g *gpuSession, ph *checkpoint.Phases) (*lazyDump, map[string]checkpoint.File, error) {
	ld := &lazyDump{id: r.ID, addr: addr, g: g, pid: int(st.Pid), paused: st.Status == task.Status_PAUSED,
		runc: make(chan error, 1), done: make(chan struct{})}
	tail := startTailDigester(ctx, r.Path)
	bg := context.WithoutCancel(ctx)
	var known map[string]checkpoint.File
	err := ph.Time("criu-dump", func() error {
		go func() {
			_, err := s.TTRPCTaskService.Checkpoint(bg, r)
			ld.runc <- errgrpc.ToNative(err)
			close(ld.runc)
		}()
		tick := time.NewTicker(lazyReadyPoll)
		defer tick.Stop()
		for {
			select {
			case err := <-ld.runc:
				if err == nil {
					err = fmt.Errorf("CRIU's lazy dump ended before its page server listened on %s", addr)
				}
				return err
			case <-tick.C:
				if listening(addr) {
					return nil
				}
			}
		}
	})
	known = tail.finish()
	if err != nil {
		if g != nil {
			g.abort(ctx)
		}
		return nil, nil, s.explainDump(err, workDir)
	}
	log.G(ctx).WithField("lazy_page_server", addr).Info("lazy dump: images written, CRIU serves the pages from the frozen task")
	return ld, known, nil
}

// abort ends a lazy dump whose checkpoint could not be completed: it connects to CRIU's page
// server and hangs up (CRIU then fails the transfer and leaves the task as it was), waits for
// runc, and gives the GPUs back.
func (ld *lazyDump) abort(ctx context.Context) {
	ld.hangUp()
	err := <-ld.runc
	log.G(ctx).WithError(err).Warn("lazy dump abandoned: the checkpoint could not be completed")
	if ld.paused {
		if err := refreeze(ld.pid); err != nil {
			log.G(ctx).WithError(err).Error("lazy dump abandoned: freezing the task's cgroup again failed")
		}
	}
	if ld.g != nil {
		ld.g.abort(ctx)
	}
}

// hangUp connects to CRIU's lazy page server and hangs up: CRIU, which serves the first
// connection it accepts, then fails the transfer and lets the task go (runc's checkpoint
// returns an error). Once a client is being served CRIU no longer listens, and this changes
// nothing.
func (ld *lazyDump) hangUp() {
	if c, err := net.DialTimeout("tcp", ld.addr, time.Second); err == nil {
		c.Close()
	}
}

// lazyAbandonGrace is how long abandonLazyDump lets CRIU end a lazy dump by itself (its client
// finishing or hanging up) before it kills CRIU (a variable for the tests).
var lazyAbandonGrace = 5 * time.Second

// abandonLazyDump ends task id's lazy dump, if one runs, because its move was given up (why:
// the pause lease ended, so the mover is gone, or a Resume, which a mover sends only when its
// move failed). CRIU's lazy page server still waiting for its first client is hung up on
// (hangUp). A CRIU still serving a client lazyAbandonGrace later is killed (checkpointCRIU):
// the mover's relay is gone by then, so the client is another local process that connected
// first and holds the connection without finishing its TLS handshake, and nothing outside the
// move may keep the task frozen. Either way the dump ends as a failed transfer (handOff: the
// task as before the dump, its GPUs given back; a CRIU killed while it served pages lets the
// task go as well, TestLazyModeFaults). It returns at once; only the first call for a dump acts.
func (s *Service) abandonLazyDump(ctx context.Context, id, why string) {
	s.mu.Lock()
	ld := s.lazy[id]
	s.mu.Unlock()
	if ld == nil || !ld.abandoned.CompareAndSwap(false, true) {
		return
	}
	l := log.G(ctx).WithFields(log.Fields{"id": id, "lazy_page_server": ld.addr, "why": why})
	if listening(ld.addr) {
		l.Warn("abandoning the lazy dump: CRIU's lazy page server still waits for its first client (the move that paused the task is gone or failed); hanging up on it")
		ld.hangUp()
	}
	grace := lazyAbandonGrace
	go func() {
		select {
		case <-ld.done:
			return
		case <-time.After(grace):
		}
		pids := checkpointCRIU("/proc", os.Getpid(), id)
		l.WithField("criu_pids", pids).Warn("abandoning the lazy dump: CRIU still serves a client that neither finishes nor hangs up (not the move's relay: another local process that connected first); killing CRIU")
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}()
}

// handOff registers the dump on s and lets it finish in the background: once runc's checkpoint
// ended, a failed transfer gives the GPUs back, then cleanups run (last first) and the dump is
// forgotten.
func (ld *lazyDump) handOff(ctx context.Context, s *Service, cleanups []func()) {
	ctx = context.WithoutCancel(ctx)
	s.mu.Lock()
	if s.lazy == nil {
		s.lazy = map[string]*lazyDump{}
	}
	s.lazy[ld.id] = ld
	s.mu.Unlock()
	go func() {
		ld.err = <-ld.runc
		if ld.err != nil {
			log.G(ctx).WithError(ld.err).Warn("lazy dump: the page transfer failed; the task stays as it was before the dump")
			if ld.paused {
				if err := refreeze(ld.pid); err != nil {
					log.G(ctx).WithError(err).Error("lazy dump failed: freezing the task's cgroup again failed")
				}
			}
			if ld.g != nil {
				ld.g.abort(ctx)
			}
		} else {
			log.G(ctx).Info("lazy dump: every page served")
		}
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
		s.mu.Lock()
		if s.lazy[ld.id] == ld {
			delete(s.lazy, ld.id)
		}
		s.mu.Unlock()
		close(ld.done)
	}()
}

// waitLazy waits until id's lazy dump, if any, has ended, or ctx ends.
func (s *Service) waitLazy(ctx context.Context, id string) error {
	s.mu.Lock()
	ld := s.lazy[id]
	s.mu.Unlock()
	if ld == nil {
		return nil
	}
	log.G(ctx).Info("waiting for the lazy dump to end before acting on the task")
	select {
	case <-ld.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Kill signals the task, after its lazy dump, if any, ended (lazy.go).
func (s *Service) Kill(ctx context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	if r.ExecID == "" {
		if err := s.waitLazy(ctx, r.ID); err != nil {
			return nil, wireError(err)
		}
	}
	return s.TTRPCTaskService.Kill(ctx, r)
}

// Resume thaws the task, after a checkpoint of it in progress (waitCheckpoint) and its lazy
// dump, if any, ended (lazy.go). A lazy dump still running is abandoned first
// (abandonLazyDump): a task is resumed only when its move failed, and then no client may keep
// CRIU, and the task with it, past lazyAbandonGrace.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	s.abandonLazyDump(ctx, r.ID, "resume") // before the wait: the lazy dump is the checkpoint in progress
	if err := s.waitCheckpoint(ctx, r.ID, "resuming"); err != nil {
		return nil, wireError(err)
	}
	if err := s.waitLazy(ctx, r.ID); err != nil {
		return nil, wireError(err)
	}
	return s.TTRPCTaskService.Resume(ctx, r)
}

// Pause freezes the task, after a checkpoint of it in progress ended (waitCheckpoint): runc's
// shim lets a Pause through once runc's dump returned, but berth's checkpoint still has steps
// on the task after that: the GPU session thaws a frozen task, gives it its GPUs back and
// freezes it again (gpuSession.back), and a failed dump freezes a paused task again
// (refreeze). A Pause in between would be undone by those steps, or freeze the task under a GPU
// restore. A caller whose context ends first gets an error naming the checkpoint in progress.
// The look for a checkpoint and the freeze happen under the task's gate (Service.gate), so a
// checkpoint that starts meanwhile reads the task's state after the freeze, or the Pause waits
// for it. Other errors are runc's.
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	for {
		if err := s.waitCheckpoint(ctx, r.ID, "pausing"); err != nil {
			return nil, wireError(err)
		}
		ungate := s.gate(r.ID)
		if s.checkpointInProgress(r.ID) { // one started between the wait and the gate
			ungate()
			continue
		}
		resp, err := s.TTRPCTaskService.Pause(ctx, r)
		ungate()
		return resp, err
	}
}

// listening reports whether a TCP socket listens on addr (an IPv4 ADDR:PORT), from
// /proc/net/tcp (state 0A): how the shim sees that CRIU's lazy page server is up without
// taking the one connection it accepts.
func listening(addr string) bool {
	ta, err := net.ResolveTCPAddr("tcp4", addr)
	if err != nil || ta.IP.To4() == nil {
		return false
	}
	v4 := ta.IP.To4()
	want := fmt.Sprintf("%02X%02X%02X%02X:%04X", v4[3], v4[2], v4[1], v4[0], ta.Port)
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 3 && fields[1] == want && fields[3] == "0A" {
			return true
		}
	}
	return false
}

// useLazyRestore adds "lazy-pages" and the work directory of the checkpoint's `criu lazy-pages`
// daemon (checkpoint.LazyPagesDir of dir, where its socket is) to the bundle's CRIU
// configuration for a restore of a checkpoint taken in lazy mode; undo puts the file back. The
// error names the missing daemon: nothing serves the checkpoint's memory.
func useLazyRestore(ctx context.Context, bundle, dir string) (undo func(), _ error) {
	undo = func() {}
	lazyDir := checkpoint.LazyPagesDir(dir)
	if _, err := os.Stat(filepath.Join(lazyDir, "lazy-pages.socket")); err != nil {
		return undo, fmt.Errorf("checkpoint %s was taken in lazy mode, but no criu lazy-pages daemon serves its memory (%w): it restores only during its move, while the source serves the pages", filepath.Base(dir), err)
	}
	path := filepath.Join(bundle, criuConfigName)
	old, err := os.ReadFile(path)
	if err != nil {
		return undo, err
	}
	body := append(append([]byte(nil), old...), fmt.Sprintf("lazy-pages\nwork-dir %s\n", lazyDir)...)
	if err := os.WriteFile(path, body, 0o600); err != nil {
		return undo, err
	}
	log.G(ctx).WithField("lazy_pages_dir", lazyDir).Info("lazy restore: memory pages arrive on demand from the source")
	return func() {
		if err := os.WriteFile(path, old, 0o600); err != nil {
			log.G(ctx).WithError(err).Error("restore CRIU configuration after a lazy restore")
		}
	}, nil
}

// refreeze freezes the cgroup of the task whose init is pid again (cgroup v1's freezer or v2's
// cgroup.freeze, through containerd's cgroups library). CRIU thaws a frozen task's cgroup while
// it holds the task under ptrace and freezes it again when it lets go; a CRIU killed while it
// serves the pages of a lazy dump leaves the cgroup thawed, so that the task runs while
// containerd still reports it paused (and runc refuses to resume it: "container not paused").
// Freezing an already frozen cgroup changes nothing.
func refreeze(pid int) error {
	if cgroups.Mode() == cgroups.Unified {
		path, err := cgroup2.PidGroupPath(pid)
		if err != nil {
			return err
		}
		m, err := cgroup2.Load(path)
		if err != nil {
			return err
		}
		return m.Freeze()
	}
	cg, err := cgroup1.Load(cgroup1.PidPath(pid))
	if err != nil {
		return err
	}
	return cg.Freeze()
}

// lockLazyRestore takes the lazy lock of checkpoint dir's daemon directory
// (checkpoint.LockLazy) for a lazy restore and refuses when the lazy page stream already failed
// (checkpoint.LazyFailed: the guard of its `criu lazy-pages` daemon gave up on it). release
// unlocks, once; the caller releases it once runc's restore ended and the task record is written.
func lockLazyRestore(dir string) (release func(), _ error) {
	lazyDir := checkpoint.LazyPagesDir(dir)
	unlock, err := checkpoint.LockLazy(lazyDir)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s was taken in lazy mode, but no criu lazy-pages daemon serves its memory (%w): it restores only during its move, while the source serves the pages", filepath.Base(dir), err)
	}
	if reason, failed := checkpoint.LazyFailed(lazyDir); failed {
		unlock()
		return nil, fmt.Errorf("checkpoint %s was taken in lazy mode and its page stream failed (%s): its memory cannot arrive", filepath.Base(dir), reason)
	}
	var once sync.Once
	return func() { once.Do(unlock) }, nil
}

// recordLazyTask writes the task record of a task restored lazily from checkpoint dir (its init
// pid, cgroup, bundle, namespace, id and containerd's address) for the daemon's guard, which
// kills it if its pages stop coming, and watches for that in the background: the guard's reason
// (checkpoint.LazyFailedBundleFile in the bundle) is logged and put into the restore report,
// once (lazyVerdict), by the watch or, at the latest, by the task's Delete.
func (s *Service) recordLazyTask(ctx context.Context, id, bundle, dir string, pid int) {
	lazyDir := checkpoint.LazyPagesDir(dir)
	procs, err := cgroupProcs(pid)
	if err == nil {
		ns, _ := namespaces.Namespace(ctx)
		err = checkpoint.WriteLazyTask(lazyDir, checkpoint.LazyTask{Pid: pid, Procs: procs, Bundle: bundle,
			Namespace: ns, ID: id, Address: strings.TrimSuffix(os.Getenv("TTRPC_ADDRESS"), ".ttrpc")})
	}
	if err != nil {
		// without the record the guard cannot find the task: do not let it run on unguarded
		log.G(ctx).WithError(err).Error("lazy restore: the task record for the lazy-pages guard could not be written; killing the task")
		_ = syscall.Kill(pid, syscall.SIGKILL)
		return
	}
	v := &lazyVerdict{bundle: bundle}
	s.mu.Lock()
	if t := s.tasks[id]; t != nil {
		t.lazy = v
	}
	s.mu.Unlock()
	go s.watchLazyTask(context.WithoutCancel(ctx), v, lazyDir)
}

// lazyWatchPoll is how often a lazily restored task's shim looks for its guard's verdict.
const lazyWatchPoll = 50 * time.Millisecond

// lazyVerdict is the lazy guard's verdict on one task restored lazily: the reason the guard
// writes into the task's bundle before it kills the task. The guard removes the task's container
// right after the kill, which can come between two polls of the watch; so Delete looks for the
// reason too, and whichever finds it first reports it.
type lazyVerdict struct {
	bundle  string
	claimed atomic.Bool
}

// report logs the guard's reason in v.bundle, if there is one and no one reported it yet, and
// adds it to the restore report (RestoreReport.LazyFailure), trying tries times, lazyWatchPoll
// apart, to find a report that parses (Start writes it once the GPUs are restored, with the
// reason if the guard had written it by then). It returns whether the bundle holds a reason; a
// caller that finds the reason already claimed returns at once.
func (v *lazyVerdict) report(ctx context.Context, s *Service, tries int) bool {
	reason := lazyFailure(v.bundle)
	if reason == "" {
		return false
	}
	if !v.claimed.CompareAndSwap(false, true) {
		return true
	}
	log.G(ctx).WithField("lazy_failure", reason).Error("lazy restore: the memory pages stopped coming before all arrived; the task was killed before it could read a missing page")
	for i := 0; i < tries; i++ {
		if i > 0 {
			time.Sleep(lazyWatchPoll)
		}
		rep, err := os.ReadFile(filepath.Join(v.bundle, RestoreReportFile))
		var r RestoreReport
		if err != nil || json.Unmarshal(rep, &r) != nil {
			continue
		}
		if r.LazyFailure == "" {
			r.LazyFailure = reason
			s.writeRestoreReport(ctx, v.bundle, r)
		}
		return true
	}
	return true
}

// watchLazyTask waits while lazyDir exists (the daemon serves the task's pages) for the guard's
// reason in the bundle, and reports it (lazyVerdict.report).
func (s *Service) watchLazyTask(ctx context.Context, v *lazyVerdict, lazyDir string) {
	for {
		_, derr := os.Stat(lazyDir)
		if v.report(ctx, s, 100) || derr != nil {
			return
		}
		time.Sleep(lazyWatchPoll)
	}
}

// lazyFailure is the guard's reason in bundle (checkpoint.LazyFailedBundleFile: a regular file,
// not followed if a symbolic link, its first maxLazyFailure bytes), "" if none.
func lazyFailure(bundle string) string {
	f, err := os.OpenFile(filepath.Join(bundle, checkpoint.LazyFailedBundleFile), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return ""
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return ""
	}
	b, _ := io.ReadAll(io.LimitReader(f, maxLazyFailure))
	return strings.TrimSpace(string(b))
}

// maxLazyFailure bounds the guard's reason read from a bundle, in bytes.
const maxLazyFailure = 4 << 10

// cgroupProcs returns the cgroup.procs file of the cgroup of pid: v1's freezer hierarchy, else
// the unified (v2) one, from /proc/PID/cgroup.
func cgroupProcs(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	procs := procsFromCgroupFile(string(b))
	if procs == "" {
		return "", fmt.Errorf("no freezer or unified cgroup for pid %d in /proc/%d/cgroup", pid, pid)
	}
	return procs, nil
}

// procsFromCgroupFile is cgroupProcs on the text of a /proc/PID/cgroup file; "" when it names
// neither a freezer nor a unified cgroup.
func procsFromCgroupFile(b string) string {
	var unified string
	for _, l := range strings.Split(strings.TrimSpace(b), "\n") {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "freezer" {
				return filepath.Join("/sys/fs/cgroup/freezer", parts[2], "cgroup.procs")
			}
		}
		if parts[0] == "0" && parts[1] == "" {
			unified = filepath.Join("/sys/fs/cgroup", parts[2], "cgroup.procs")
		}
	}
	return unified
}
