package shim

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// lockedRuncStub is runc's task service as containerd's runc shim serializes it: Checkpoint and
// Resume take the init process's lock, so a Resume sent during a dump runs as soon as runc's
// dump returns. Its dump blocks until release is closed, then fails (CRIU lost its page server).
type lockedRuncStub struct {
	taskAPI.TTRPCTaskService
	bundle  string
	procMu  sync.Mutex // the runc shim's Init.mu
	mu      sync.Mutex
	status  task.Status
	entered chan struct{}
	release chan struct{}
	// inCheckpoint reports, when Resume runs, whether berth's checkpoint of the task was still
	// in progress (the shim's post-dump steps, a refreeze among them, not done)
	inCheckpoint func() bool
	resumedMid   bool
	resumed      chan struct{}
	// pausedMid and paused are Resume's for Pause
	pausedMid bool
	paused    chan struct{}
}

func (r *lockedRuncStub) State(context.Context, *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return &taskAPI.StateResponse{Bundle: r.bundle, Status: r.status}, nil
}

func (r *lockedRuncStub) Checkpoint(context.Context, *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	r.procMu.Lock()
	defer r.procMu.Unlock()
	close(r.entered)
	<-r.release
	return nil, errors.New("criu failed: the page server doesn't answer")
}

func (r *lockedRuncStub) Resume(context.Context, *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	r.procMu.Lock()
	defer r.procMu.Unlock()
	r.mu.Lock()
	r.status = task.Status_RUNNING
	r.resumedMid = r.inCheckpoint()
	r.mu.Unlock()
	close(r.resumed)
	return &ptypes.Empty{}, nil
}

func (r *lockedRuncStub) Pause(context.Context, *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	r.procMu.Lock()
	defer r.procMu.Unlock()
	r.mu.Lock()
	r.status = task.Status_PAUSED
	r.pausedMid = r.inCheckpoint()
	r.mu.Unlock()
	close(r.paused)
	return &ptypes.Empty{}, nil
}

// specBundle returns a bundle directory whose config.json is a minimal OCI spec.
func specBundle(t *testing.T) string {
	t.Helper()
	bundle := t.TempDir()
	b, _ := json.Marshal(specs.Spec{Process: &specs.Process{}})
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return bundle
}

// checkpointInProgress returns a shim over a lockedRuncStub whose task "c" is in status, with a
// checkpoint of it started and inside runc's dump (which fails once inner.release is closed);
// the checkpoint's error comes on the channel.
func checkpointInProgress(t *testing.T, status task.Status) (*Service, *lockedRuncStub, chan error) {
	t.Helper()
	bundle := specBundle(t)
	inner := &lockedRuncStub{bundle: bundle, status: status, entered: make(chan struct{}), release: make(chan struct{})}
	deps := testDeps(policy(t, true))
	deps.DumpStats = func(string) (checkpoint.CRIUStats, error) { return checkpoint.CRIUStats{}, nil }
	s := NewService(inner, DefaultConfig(), deps)
	inner.inCheckpoint = func() bool {
		s.leases.mu.Lock()
		defer s.leases.mu.Unlock()
		return s.leases.busy["c"] > 0
	}
	ckErr := make(chan error, 1)
	go func() {
		_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
		ckErr <- err
	}()
	<-inner.entered
	return s, inner, ckErr
}

// TestResumeWaitsForCheckpoint: a caller that gave up on a checkpoint of its paused task (its
// checkpoint call was cancelled; ttrpc does not cancel the shim's) and resumes it is let
// through only once berth's checkpoint ended, after its failed dump froze the task's cgroup
// again: a Resume that ran between runc's dump and that refreeze left a task containerd
// reports running frozen (TestFltMigrateFaults/receiver-stalls-interrupted/copy).
func TestResumeWaitsForCheckpoint(t *testing.T) {
	s, inner, ckErr := checkpointInProgress(t, task.Status_PAUSED)
	inner.resumed = make(chan struct{})
	resErr := make(chan error, 1)
	go func() {
		_, err := s.Resume(context.Background(), &taskAPI.ResumeRequest{ID: "c"})
		resErr <- err
	}()
	select {
	case <-inner.resumed:
		t.Fatal("the task was resumed while CRIU dumped it")
	case <-time.After(200 * time.Millisecond):
	}
	close(inner.release)
	if err := <-ckErr; err == nil {
		t.Fatal("the checkpoint succeeded; its dump failed")
	}
	if err := <-resErr; err != nil {
		t.Fatalf("resume: %v", err)
	}
	if inner.resumedMid {
		t.Error("the task was resumed between the failed dump and the end of the checkpoint (its refreeze): it stays frozen while reported running")
	}
	if inner.status != task.Status_RUNNING {
		t.Errorf("task %s after the resume", inner.status)
	}

	// a resume that gives up while a checkpoint is in progress says so
	inner.entered, inner.release, inner.resumed = make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
		ckErr <- err
	}()
	<-inner.entered
	rel := time.AfterFunc(time.Second, func() { close(inner.release) })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err := s.Resume(ctx, &taskAPI.ResumeRequest{ID: "c"})
	cancel()
	stopped := rel.Stop() // the resume returned before the dump ended
	if !stopped || err == nil {
		t.Errorf("a resume whose context ended during a checkpoint did not give up then: %v", err)
	}
	if stopped {
		close(inner.release)
	}
	<-ckErr
}

// TestPauseWaitsForCheckpoint: a Pause sent while the shim checkpoints a running task reaches
// runc only once berth's checkpoint ended, not as soon as runc's dump returned (the GPU
// session's steps after the dump would run on a task frozen under them); one whose context
// ends first says a checkpoint is in progress.
func TestPauseWaitsForCheckpoint(t *testing.T) {
	s, inner, ckErr := checkpointInProgress(t, task.Status_RUNNING)
	inner.paused = make(chan struct{})
	pauseErr := make(chan error, 2)
	pause := func(ctx context.Context) {
		_, err := s.Pause(ctx, &taskAPI.PauseRequest{ID: "c"})
		pauseErr <- err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	go pause(ctx)
	select {
	case err := <-pauseErr:
		if err == nil || !strings.Contains(err.Error(), "a checkpoint of the task is in progress") {
			t.Errorf("a pause whose context ended during a checkpoint: %v, want it to name the checkpoint in progress", err)
		}
	case <-time.After(time.Second):
		close(inner.release)
		t.Fatal("a pause whose context ended during a checkpoint did not return (it waits on runc's dump)")
	}
	go pause(context.Background())
	select {
	case <-inner.paused:
		close(inner.release)
		t.Fatal("the task was paused while CRIU dumped it")
	case <-time.After(200 * time.Millisecond):
	}
	close(inner.release)
	if err := <-ckErr; err == nil {
		t.Fatal("the checkpoint succeeded; its dump failed")
	}
	if err := <-pauseErr; err != nil {
		t.Fatalf("pause: %v", err)
	}
	if inner.pausedMid {
		t.Error("the task was paused between runc's dump and the end of berth's checkpoint")
	}
	if inner.status != task.Status_PAUSED {
		t.Errorf("task %s after the pause", inner.status)
	}
}

// pauseRaceStub is runc's task service for one task whose Pause blocks, once entered, until
// pauseRelease is closed; State records what it answered, and the dump fails at once.
type pauseRaceStub struct {
	taskAPI.TTRPCTaskService
	bundle                     string
	mu                         sync.Mutex
	status                     task.Status
	seen                       []task.Status
	pauseEntered, pauseRelease chan struct{}
}

func (r *pauseRaceStub) State(context.Context, *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, r.status)
	return &taskAPI.StateResponse{Bundle: r.bundle, Status: r.status}, nil
}

func (r *pauseRaceStub) Pause(context.Context, *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	close(r.pauseEntered)
	<-r.pauseRelease
	r.mu.Lock()
	r.status = task.Status_PAUSED
	r.mu.Unlock()
	return &ptypes.Empty{}, nil
}

func (r *pauseRaceStub) Checkpoint(context.Context, *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	return nil, errors.New("criu failed")
}

// TestPauseBeforeCheckpointStart: a checkpoint that starts while a Pause is freezing the task
// reads the task's state only after the freeze (the task's gate), so it takes the task for
// what it is, paused, and not for the running task it was a moment before.
func TestPauseBeforeCheckpointStart(t *testing.T) {
	bundle := specBundle(t)
	inner := &pauseRaceStub{bundle: bundle, status: task.Status_RUNNING, pauseEntered: make(chan struct{}), pauseRelease: make(chan struct{})}
	deps := testDeps(policy(t, true))
	deps.DumpStats = func(string) (checkpoint.CRIUStats, error) { return checkpoint.CRIUStats{}, nil }
	s := NewService(inner, DefaultConfig(), deps)
	paused := make(chan error, 1)
	go func() {
		_, err := s.Pause(context.Background(), &taskAPI.PauseRequest{ID: "c"})
		paused <- err
	}()
	<-inner.pauseEntered
	ckErr := make(chan error, 1)
	go func() {
		_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
		ckErr <- err
	}()
	time.Sleep(200 * time.Millisecond) // the checkpoint has started
	close(inner.pauseRelease)
	if err := <-paused; err != nil {
		t.Fatalf("pause: %v", err)
	}
	<-ckErr
	inner.mu.Lock()
	defer inner.mu.Unlock()
	if len(inner.seen) == 0 || inner.seen[0] != task.Status_PAUSED {
		t.Errorf("the checkpoint read the task's state as %v while a Pause was freezing it, want PAUSED first", inner.seen)
	}
}
