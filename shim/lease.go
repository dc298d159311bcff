package shim

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/berth-dev/berth/oci"
)

// MaxPauseLease is the longest pause lease the shim grants.
const MaxPauseLease = time.Hour

// leaseRetry is how soon an expired lease is looked at again while the task is being
// checkpointed (CRIU dumps a paused task: it is never resumed under it).
const leaseRetry = time.Second

// leases are the pause leases of the shim's tasks (oci.AnnotationPauseLease): a task still
// paused when its lease ends is resumed, unless it is being checkpointed then. The zero value is
// ready.
type leases struct {
	mu     sync.Mutex
	byTask map[string]*lease
	busy   map[string]int // tasks being checkpointed now
	// ended[id] is closed when the last checkpoint of task id in progress ends (waitCheckpoint)
	ended map[string]chan struct{}
	// gates[id] orders Pause against a checkpoint's start (gate): held across Pause's look at
	// busy and its freeze, and across a checkpoint's registration and its read of the state
	gates map[string]*sync.Mutex
}

type lease struct {
	deadline time.Time
	timer    *time.Timer
	// kill: at expiry a still paused task is killed, not resumed (oci.PauseLeaseKill)
	kill bool
	// workDir is the directory of a checkpoint the shim wrote for the lease's holder
	// (leaseWorkDir): it holds the task's memory, and an expired lease (its holder is gone)
	// removes it; "" for none.
	workDir string
}

// Update updates the task. An update whose annotations carry oci.AnnotationPauseLease grants,
// renews or ("0") releases the task's pause lease; when it carries no resources that is all it
// does, otherwise runc updates the resources too. Errors are classified by errorClass.
func (s *Service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	v, ok := r.Annotations[oci.AnnotationPauseLease]
	if !ok {
		return s.TTRPCTaskService.Update(ctx, r)
	}
	if err := s.setLease(ctx, r.ID, v, r.Annotations[oci.AnnotationPauseLeaseExpiry]); err != nil {
		return nil, wireError(err)
	}
	if r.Resources == nil || len(r.Resources.GetValue()) == 0 {
		return &ptypes.Empty{}, nil
	}
	rest := &taskAPI.UpdateTaskRequest{ID: r.ID, Resources: r.Resources, Annotations: map[string]string{}}
	for k, a := range r.Annotations {
		if k != oci.AnnotationPauseLease && k != oci.AnnotationPauseLeaseExpiry {
			rest.Annotations[k] = a
		}
	}
	return s.TTRPCTaskService.Update(ctx, rest)
}

// setLease grants or renews id's pause lease for the duration v, or releases it ("0"); expiry
// (oci.AnnotationPauseLeaseExpiry: "", "resume" or "kill") says what its end does to a task
// still paused.
func (s *Service) setLease(ctx context.Context, id, v, expiry string) error {
	d, err := time.ParseDuration(v)
	if v == "0" {
		d, err = 0, nil
	}
	if err != nil || d < 0 || d > MaxPauseLease {
		return fmt.Errorf("annotation %s=%s: want a positive duration up to %s, or 0 to release: %w",
			oci.AnnotationPauseLease, quote(v), MaxPauseLease, errdefs.ErrInvalidArgument)
	}
	switch expiry {
	case "", oci.PauseLeaseResume, oci.PauseLeaseKill:
	default:
		return fmt.Errorf("annotation %s=%s: want %q or %q: %w",
			oci.AnnotationPauseLeaseExpiry, quote(expiry), oci.PauseLeaseResume, oci.PauseLeaseKill, errdefs.ErrInvalidArgument)
	}
	l := &s.leases
	l.mu.Lock()
	defer l.mu.Unlock()
	var workDir string
	if old := l.byTask[id]; old != nil {
		old.timer.Stop()
		delete(l.byTask, id)
		workDir = old.workDir
	}
	if d == 0 {
		log.G(ctx).WithField("id", id).Debug("pause lease released")
		return nil
	}
	if l.byTask == nil {
		l.byTask = map[string]*lease{}
	}
	nl := &lease{deadline: s.deps.Now().Add(d), kill: expiry == oci.PauseLeaseKill, workDir: workDir}
	nl.timer = time.AfterFunc(d, func() { s.expireLease(id, nl) })
	l.byTask[id] = nl
	log.G(ctx).WithFields(log.Fields{"id": id, "lease": d, "kill_at_expiry": nl.kill}).Debug("pause lease granted")
	return nil
}

// expireLease ends lease l of task id: unless it was renewed or released since, or the task is
// being checkpointed (then it is looked at again in leaseRetry, and a lazy dump in progress is
// abandoned: abandonLazyDump), a task still paused is resumed, or
// killed when the lease was committed (oci.PauseLeaseKill).
func (s *Service) expireLease(id string, l *lease) {
	ls := &s.leases
	ls.mu.Lock()
	if ls.byTask[id] != l {
		ls.mu.Unlock()
		return
	}
	if ls.busy[id] > 0 {
		l.timer.Reset(leaseRetry)
		ls.mu.Unlock()
		// a lazy dump whose mover is gone: CRIU would wait for a client, or serve one that
		// never finishes, for good, and the task with it
		s.abandonLazyDump(log.WithLogger(context.Background(), log.L), id, "pause lease ended")
		return
	}
	delete(ls.byTask, id)
	ls.mu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", id))
	if l.workDir != "" {
		// the holder is gone and will not remove the checkpoint it had the shim write: it
		// holds the task's memory
		defer func() {
			if err := os.RemoveAll(l.workDir); err != nil {
				log.G(ctx).WithError(err).WithField("path", l.workDir).Error("pause lease ended: removing the checkpoint of its holder failed")
				return
			}
			log.G(ctx).WithField("path", l.workDir).Warn("pause lease ended: the checkpoint its holder left (the task's memory) removed")
		}()
	}
	st, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: id})
	if err != nil || st.Status != task.Status_PAUSED {
		return
	}
	if l.kill {
		// the move was committed (its destination runs the container) and then died before it
		// stopped this copy: the source must not run beside its destination
		if _, err := s.TTRPCTaskService.Kill(ctx, &taskAPI.KillRequest{ID: id, Signal: 9, All: true}); err != nil {
			log.G(ctx).WithError(err).Error("pause lease ended after the move was committed: killing the task failed")
			return
		}
		_, _ = s.TTRPCTaskService.Resume(ctx, &taskAPI.ResumeRequest{ID: id}) // a frozen task dies once thawed
		log.G(ctx).Warn("pause lease ended after the move was committed (its destination runs the container): task killed")
		return
	}
	if _, err := s.TTRPCTaskService.Resume(ctx, &taskAPI.ResumeRequest{ID: id}); err != nil {
		log.G(ctx).WithError(err).Error("pause lease ended: resuming the task failed")
		return
	}
	log.G(ctx).Warn("pause lease ended with the task still paused (the move that paused it is gone): task resumed")
}

// leaseWorkDir registers dir, the checkpoint directory the shim is writing for task id, with
// id's pause lease, if it holds one: should the lease end (its holder died), the directory goes
// with it (expireLease), since it holds the task's memory. A released lease leaves it to its
// holder. Without a lease (ctr, the kubelet) nothing is registered.
func (s *Service) leaseWorkDir(id, dir string) {
	l := &s.leases
	l.mu.Lock()
	defer l.mu.Unlock()
	if cur := l.byTask[id]; cur != nil && dir != "" {
		cur.workDir = dir
	}
}

// checkpointing marks id as being checkpointed until the returned function is called: its
// pause lease does not resume it meanwhile, and Resume waits for it (waitCheckpoint).
func (s *Service) checkpointing(id string) func() {
	l := &s.leases
	l.mu.Lock()
	if l.busy == nil {
		l.busy, l.ended = map[string]int{}, map[string]chan struct{}{}
	}
	if l.busy[id] == 0 {
		l.ended[id] = make(chan struct{})
	}
	l.busy[id]++
	l.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			if l.busy[id]--; l.busy[id] <= 0 {
				delete(l.busy, id)
				close(l.ended[id])
				delete(l.ended, id)
			}
			l.mu.Unlock()
		})
	}
}

// waitCheckpoint waits until no checkpoint of task id is in progress (checkpointing), or ctx
// ends (its error). A task paused for a dump is resumed only after the dump let go of it: runc
// lets a Resume through once CRIU exited, but a failed dump of a paused task then freezes its
// cgroup again (checkpoint: refreeze), which would leave a task containerd reports running
// frozen. The checkpoint call may outlive its caller (ttrpc does not carry a cancellation to the
// shim): a caller that gave up and resumes waits for the dump to end. Pause waits too (Pause).
// action ("resuming", "pausing") names the caller's step in the log and the error.
func (s *Service) waitCheckpoint(ctx context.Context, id, action string) error {
	l := &s.leases
	l.mu.Lock()
	ch := l.ended[id]
	l.mu.Unlock()
	if ch == nil {
		return nil
	}
	log.G(ctx).WithField("id", id).Infof("waiting for the checkpoint in progress to end before %s the task", action)
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%s %s: a checkpoint of the task is in progress: %w", action, id, ctx.Err())
	}
}

// dropLease forgets id's pause lease and gate (the task is deleted).
func (s *Service) dropLease(id string) {
	l := &s.leases
	l.mu.Lock()
	defer l.mu.Unlock()
	if old := l.byTask[id]; old != nil {
		old.timer.Stop()
		delete(l.byTask, id)
	}
	delete(l.gates, id)
}

// gate locks task id's gate and returns its unlock: a checkpoint holds it while it registers
// (checkpointing) and reads the task's state, Pause while it looks for a checkpoint in progress
// and freezes the task, so that a Pause never freezes a task between a checkpoint's start and
// its look at the state (the checkpoint would take a frozen task for a running one).
func (s *Service) gate(id string) func() {
	l := &s.leases
	l.mu.Lock()
	if l.gates == nil {
		l.gates = map[string]*sync.Mutex{}
	}
	g := l.gates[id]
	if g == nil {
		g = &sync.Mutex{}
		l.gates[id] = g
	}
	l.mu.Unlock()
	g.Lock()
	return g.Unlock
}

// checkpointInProgress reports whether a checkpoint of task id is in progress (checkpointing).
func (s *Service) checkpointInProgress(id string) bool {
	l := &s.leases
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.busy[id] > 0
}
