package shim

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"

	"github.com/berth-dev/berth/oci"
)

// pausedStub is a runc task service with one task, paused until resumed.
type pausedStub struct {
	taskAPI.TTRPCTaskService
	mu      sync.Mutex
	paused  bool
	resumed chan struct{}
}

func (p *pausedStub) State(context.Context, *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := task.Status_RUNNING
	if p.paused {
		st = task.Status_PAUSED
	}
	return &taskAPI.StateResponse{Status: st}, nil
}

func (p *pausedStub) Resume(context.Context, *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	p.mu.Lock()
	p.paused = false
	p.mu.Unlock()
	close(p.resumed)
	return &ptypes.Empty{}, nil
}

func leaseUpdate(v string) *taskAPI.UpdateTaskRequest {
	return &taskAPI.UpdateTaskRequest{ID: "t", Annotations: map[string]string{oci.AnnotationPauseLease: v}}
}

func TestPauseLease(t *testing.T) {
	ctx := t.Context()
	resumedWithin := func(s *pausedStub, d time.Duration) bool {
		select {
		case <-s.resumed:
			return true
		case <-time.After(d):
			return false
		}
	}
	t.Run("expires", func(t *testing.T) {
		stub := &pausedStub{paused: true, resumed: make(chan struct{})}
		s := NewService(stub, Config{}, Deps{})
		if _, err := s.Update(ctx, leaseUpdate("100ms")); err != nil {
			t.Fatal(err)
		}
		if !resumedWithin(stub, 2*time.Second) {
			t.Fatal("a paused task was not resumed when its lease ended")
		}
	})
	t.Run("renewed, then released", func(t *testing.T) {
		stub := &pausedStub{paused: true, resumed: make(chan struct{})}
		s := NewService(stub, Config{}, Deps{})
		for range 3 {
			if _, err := s.Update(ctx, leaseUpdate("150ms")); err != nil {
				t.Fatal(err)
			}
			time.Sleep(80 * time.Millisecond)
		}
		if _, err := s.Update(ctx, leaseUpdate("0")); err != nil {
			t.Fatal(err)
		}
		if resumedWithin(stub, 300*time.Millisecond) {
			t.Fatal("a renewed, then released lease resumed the task")
		}
	})
	t.Run("not while checkpointing", func(t *testing.T) {
		stub := &pausedStub{paused: true, resumed: make(chan struct{})}
		s := NewService(stub, Config{}, Deps{})
		done := s.checkpointing("t")
		if _, err := s.Update(ctx, leaseUpdate("50ms")); err != nil {
			t.Fatal(err)
		}
		if resumedWithin(stub, 300*time.Millisecond) {
			t.Fatal("the lease resumed a task being checkpointed")
		}
		done()
		if !resumedWithin(stub, 3*time.Second) {
			t.Fatal("the lease did not resume the task once its checkpoint ended")
		}
	})
	t.Run("expires with its checkpoint", func(t *testing.T) {
		// the checkpoint the shim wrote for the lease's holder goes when the lease ends, kept
		// over renewals; one of a released lease stays (its holder removes or keeps it)
		for _, release := range []bool{false, true} {
			stub := &pausedStub{paused: true, resumed: make(chan struct{})}
			s := NewService(stub, Config{}, Deps{})
			dir := filepath.Join(t.TempDir(), "ck")
			if err := os.MkdirAll(filepath.Join(dir, "checkpoint"), 0o700); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Update(ctx, leaseUpdate("5s")); err != nil {
				t.Fatal(err)
			}
			s.leaseWorkDir("t", leasedCheckpointDir(filepath.Join(dir, "checkpoint"), dir, "/bundle"))
			v := "150ms"
			if release {
				v = "0"
			}
			if _, err := s.Update(ctx, leaseUpdate(v)); err != nil {
				t.Fatal(err)
			}
			resumed := resumedWithin(stub, 2*time.Second)
			// removal follows the resume: wait for it (at most 2 s on a loaded machine) when
			// it is due, a moment when it is not
			wait := 100 * time.Millisecond
			if !release {
				wait = 2 * time.Second
			}
			var err error
			for end := time.Now().Add(wait); ; time.Sleep(10 * time.Millisecond) {
				if _, err = os.Stat(dir); os.IsNotExist(err) || time.Now().After(end) {
					break
				}
			}
			switch {
			case !release && (!resumed || !os.IsNotExist(err)):
				t.Errorf("expired lease: resumed %v, checkpoint stat %v; want resumed and removed", resumed, err)
			case release && (resumed || err != nil):
				t.Errorf("released lease: resumed %v, checkpoint stat %v; want neither resumed nor removed", resumed, err)
			}
		}
	})
	t.Run("deleted", func(t *testing.T) {
		stub := &pausedStub{paused: true, resumed: make(chan struct{})}
		s := NewService(stub, Config{}, Deps{})
		if _, err := s.Update(ctx, leaseUpdate("50ms")); err != nil {
			t.Fatal(err)
		}
		s.dropLease("t")
		if resumedWithin(stub, 200*time.Millisecond) {
			t.Fatal("a dropped lease resumed the task")
		}
	})
	for _, bad := range []string{"soon", "-1s", "2h"} {
		_, err := NewService(&pausedStub{}, Config{}, Deps{}).Update(ctx, leaseUpdate(bad))
		if !errdefs.IsInvalidArgument(errgrpc.ToNative(err)) {
			t.Errorf("lease %q: %v, want InvalidArgument", bad, err)
		}
	}
}

// killStub is pausedStub that records kills and resumes in order: a committed lease must kill
// the task (and may thaw it afterwards so it dies), never resume a live one.
type killStub struct {
	pausedStub
	killed chan struct{}
	order  []string
}

func (k *killStub) Kill(_ context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if r.Signal == 9 && r.All {
		k.order = append(k.order, "kill")
		close(k.killed)
	}
	return &ptypes.Empty{}, nil
}

func (k *killStub) Resume(context.Context, *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.order = append(k.order, "resume")
	return &ptypes.Empty{}, nil
}

// TestPauseLeaseCommitted: once a move commits its lease (its destination runs the container), a
// source still paused when the lease ends is killed, not resumed beside its destination; a bad
// expiry value is refused.
func TestPauseLeaseCommitted(t *testing.T) {
	ctx := t.Context()
	stub := &killStub{pausedStub: pausedStub{paused: true, resumed: make(chan struct{})}, killed: make(chan struct{})}
	s := NewService(stub, Config{}, Deps{})
	u := leaseUpdate("100ms")
	u.Annotations[oci.AnnotationPauseLeaseExpiry] = oci.PauseLeaseKill
	if _, err := s.Update(ctx, u); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stub.killed:
	case <-time.After(2 * time.Second):
		t.Fatal("a committed lease did not kill the paused source when it ended")
	}
	stub.mu.Lock()
	order := slices.Clone(stub.order)
	stub.mu.Unlock()
	if order[0] != "kill" {
		t.Fatalf("lease end did %v: a committed lease must kill before anything else", order)
	}
	bad := leaseUpdate("1s")
	bad.Annotations[oci.AnnotationPauseLeaseExpiry] = "explode"
	if _, err := s.Update(ctx, bad); !errdefs.IsInvalidArgument(errgrpc.ToNative(err)) {
		t.Fatalf("expiry %q = %v, want InvalidArgument", "explode", err)
	}
}

func TestLeasedCheckpointDir(t *testing.T) {
	for _, tc := range []struct{ images, work, want string }{
		{"/w/ck/checkpoint", "/w/ck", "/w/ck"},                                 // berthctl's layout
		{"/w/ck/checkpoint", "/bundle/" + shimCRIUWorkDir, "/w/ck/checkpoint"}, // the shim's own work dir
		{"/w/images", "/elsewhere", "/w/images"},
		{"/w/ck/checkpoint", "/", "/w/ck/checkpoint"},
		{"/w/ck/checkpoint", "rel", "/w/ck/checkpoint"},
		{"", "/w", ""},
		{"rel/images", "/w", ""},
		{"/", "/", ""},
	} {
		if got := leasedCheckpointDir(tc.images, tc.work, "/bundle"); got != tc.want {
			t.Errorf("leasedCheckpointDir(%q, %q) = %q, want %q", tc.images, tc.work, got, tc.want)
		}
	}
}

// TestLeaseAbandonsUnclaimedLazyDump: a pause lease that ends while a lazy dump of its task is
// still waiting for its first client (the mover died before its relay connected) hangs up on
// CRIU's lazy page server, so that the dump fails and the task can be resumed; it leaves a dump
// that serves a client alone.
func TestLeaseAbandonsUnclaimedLazyDump(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0") // CRIU's lazy page server
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	stub := &pausedStub{paused: true, resumed: make(chan struct{})}
	s := NewService(stub, Config{}, Deps{})
	s.lazy = map[string]*lazyDump{"t": {id: "t", addr: ln.Addr().String()}}
	release := s.checkpointing("t") // the lazy dump holds the task until CRIU lets go
	defer release()
	if _, err := s.Update(t.Context(), leaseUpdate("100ms")); err != nil {
		t.Fatal(err)
	}
	accepted := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- err
			return
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
		accepted <- err
	}()
	select {
	case err := <-accepted:
		if err != io.EOF {
			t.Fatalf("the client that connected to CRIU's lazy page server: %v, want it to hang up (EOF)", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the ended lease did not hang up on the lazy dump nobody connected to")
	}
	select {
	case <-stub.resumed:
		t.Fatal("the task was resumed while its dump still held it")
	default:
	}
	release() // CRIU failed the transfer: the dump ends
	select {
	case <-stub.resumed:
	case <-time.After(5 * time.Second):
		t.Fatal("the task was not resumed once its abandoned dump ended")
	}
}
