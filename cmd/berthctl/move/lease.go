package move

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/log"

	"github.com/berth-dev/berth/oci"
)

// DefaultPauseLease is the pause lease a move holds on its source by default: how long the
// source may stay paused after berthctl died before berth's shim resumes it by itself.
const DefaultPauseLease = 30 * time.Second

// pauseLease is a pause lease (oci.AnnotationPauseLease) held on a task by this process: berth's
// shim resumes the task if it is still paused when the lease ends, so a move that is killed
// never strands its source. It is renewed every third of its length until released.
type pauseLease struct {
	task    containerd.Task
	d       time.Duration
	mu      sync.Mutex
	expiry  string // oci.PauseLeaseResume until commit, then oci.PauseLeaseKill
	stop    chan struct{}
	stopped sync.Once
	done    chan struct{}
}

// holdLease grants task a pause lease of d and renews it until release. The task's runtime must
// be berth's: another runtime refuses the update (the error says so).
func holdLease(ctx context.Context, task containerd.Task, d time.Duration) (*pauseLease, error) {
	if err := setLease(ctx, task, d, oci.PauseLeaseResume); err != nil {
		return nil, fmt.Errorf("grant the source a pause lease of %s (a task of berth's runtime resumes by itself when the move dies): %w", d, err)
	}
	l := &pauseLease{task: task, d: d, expiry: oci.PauseLeaseResume, stop: make(chan struct{}), done: make(chan struct{})}
	go l.renew(context.WithoutCancel(ctx))
	return l, nil
}

func (l *pauseLease) renew(ctx context.Context) {
	defer close(l.done)
	tick := time.NewTicker(l.d / 3)
	defer tick.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-tick.C:
			l.mu.Lock()
			expiry := l.expiry
			l.mu.Unlock()
			if err := setLease(ctx, l.task, l.d, expiry); err != nil {
				log.G(ctx).WithError(err).Warn("renew the source's pause lease")
			}
		}
	}
}

// commit switches the lease to kill the task at its end instead of resuming it: the move's
// destination runs the container now, so a source left paused by a move that dies from here on
// must not run beside it. nil-safe.
func (l *pauseLease) commit(ctx context.Context) error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	l.expiry = oci.PauseLeaseKill
	l.mu.Unlock()
	return setLease(ctx, l.task, l.d, oci.PauseLeaseKill)
}

// stopRenewing stops renewing the lease, which then ends by itself. nil-safe.
func (l *pauseLease) stopRenewing() {
	if l == nil {
		return
	}
	l.stopped.Do(func() { close(l.stop) })
	<-l.done
}

// release stops renewing the lease and releases it. nil-safe.
func (l *pauseLease) release(ctx context.Context) {
	if l == nil {
		return
	}
	l.stopRenewing()
	if err := setLease(context.WithoutCancel(ctx), l.task, 0, ""); err != nil {
		log.G(ctx).WithError(err).Debug("release the source's pause lease")
	}
}

// setLease grants, renews or (d 0) releases task's pause lease; expiry ("" when releasing) is
// what the shim does to the task if it is still paused when the lease ends.
func setLease(ctx context.Context, task containerd.Task, d time.Duration, expiry string) error {
	a := map[string]string{oci.AnnotationPauseLease: "0"}
	if d > 0 {
		a[oci.AnnotationPauseLease] = d.String()
		a[oci.AnnotationPauseLeaseExpiry] = expiry
	}
	return task.Update(ctx, containerd.WithAnnotations(a))
}

// pausedHint is what to do about a source task found paused: a move that was interrupted left
// it so, and how to see and resume it.
func pausedHint(ns, id string) string {
	return fmt.Sprintf("a move that was interrupted leaves its source paused until the move's pause lease ends (%s by default; berth's shim then resumes it by itself); see it with `ctr -n %s tasks ls`, resume it now with `ctr -n %s tasks resume %s`",
		DefaultPauseLease, ns, ns, id)
}

// isPaused reports whether status is paused (containerd's name for it).
func isPaused(s containerd.ProcessStatus) bool {
	return strings.EqualFold(string(s), string(containerd.Paused))
}
