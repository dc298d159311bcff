package move

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// MigrateOptions describe one move of a running container between two containerd nodes.
type MigrateOptions struct {
	// Src and Dst are clients of the source and destination containerd.
	Src, Dst *containerd.Client
	// Namespace is the containerd namespace on both nodes; ID the source container; TargetID the
	// id on the destination (default ID).
	Namespace, ID, TargetID string
	// WorkDir is the checkpoint directory to create on the source side; it is removed after a
	// successful move unless KeepLocal is set.
	WorkDir   string
	KeepLocal bool
	// Name is the checkpoint's name in the destination's checkpoint root (the restore-from ref).
	Name string
	// Send transfers the checkpoint directory to the destination's receiver under Name, returning
	// the number of bytes sent (oci/transfer.Send over a connection to `berthctl receive`).
	Send func(ctx context.Context, dir, name string) (int64, error)
	// LeaveRunning keeps the source running after the move; otherwise it is stopped and removed
	// (task, container and writable layer) once the destination restore succeeded.
	LeaveRunning bool
	// LogPath receives the restored task's output on the destination ("" discards it).
	LogPath string
	// Sign signs the checkpoint (CheckpointOptions.Sign).
	Sign func(ctx context.Context, dir string) (string, error)
	// Pages, when set, makes the move copy mode (stream.go): it starts the page stream of
	// checkpoint Name to the destination.
	Pages func(ctx context.Context, name string) (PageRelay, error)
	// Lazy, when set, makes the move lazy, post-copy (stream.go): it starts the lazy page stream
	// of checkpoint Name (before anything is paused: the destination may refuse). The
	// destination resumes once the checkpoint less its memory arrived; the pages follow. Not
	// with Pages.
	Lazy func(ctx context.Context, name string) (LazyRelay, error)
	// PauseLease is the pause lease held on the source while it is paused (CheckpointOptions):
	// if this process dies mid-move, berth's shim resumes the source at most this long after the
	// last renewal. 0 means DefaultPauseLease; negative, none.
	PauseLease time.Duration
}

// MigrateResult reports a move.
type MigrateResult struct {
	// Manifest is the checkpoint's manifest (fingerprint, CRIU statistics, files).
	Manifest *checkpoint.Manifest
	// SignedBy is the id of the key that signed the checkpoint ("" when unsigned).
	SignedBy string
	// Bytes is the checkpoint directory's stream sent to the destination's receiver
	// (oci/transfer), in bytes. In copy and lazy mode it holds no memory pages (or, lazy, only
	// the few CRIU cannot send lazily): PageBytes counts those.
	Bytes int64
	// PageBytes is what the page stream carried, in bytes: in copy mode the stream CRIU sent
	// straight to the destination's page server while it dumped (the signed manifest's
	// pageStream size), in lazy mode what CRIU's lazy page server sent after the destination
	// resumed (LazyRelay.Bytes, its page-server headers included); 0 in stored mode.
	PageBytes int64
	// Phases are the wall times of checkpoint, transfer, restore, (lazy mode) pages, and
	// stop-source or resume-source, in order. In lazy mode the destination serves from the end
	// of restore; pages is the time from then until every page had arrived, while the source
	// stays frozen.
	Phases []checkpoint.Phase
}

// Migrate checkpoints the source container (paused while it is dumped and moved, so it cannot
// diverge), sends the checkpoint to the destination, restores it there with berth's runtime, and
// only then stops the source (or resumes it with LeaveRunning). On any error before the restore
// succeeded, the source is resumed and keeps running, and the destination holds no container;
// a checkpoint already received stays in the destination's root, intact.
//
// In lazy mode (Lazy) the destination task runs from the end of the restore while its memory
// pages still come from the source, which stays frozen (never killed) until every page arrived;
// only then is it stopped. If the stream fails before that (the link, the destination's
// lazy-pages daemon, the destination or the source's CRIU), the destination task is killed and
// removed, the source resumes, and the error says so: what the destination task did in that
// window (answers it gave, writes outside its memory) is lost with it. Errors wrapping
// ErrLazyRolledBack are those. If this process dies in that window, the guard of the
// destination's lazy-pages daemon (oci/transfer's lazy guard) kills and removes the destination
// task, and the source's pause lease resumes it.
func Migrate(ctx context.Context, o MigrateOptions) (_ *MigrateResult, retErr error) {
	if o.TargetID == "" {
		o.TargetID = o.ID
	}
	ctx = namespaces.WithNamespace(ctx, o.Namespace)
	res := &MigrateResult{}
	t := time.Now()
	phase := func(name string) {
		res.Phases = append(res.Phases, checkpoint.Phase{Name: name, Ms: float64(time.Since(t).Microseconds()) / 1000})
		t = time.Now()
	}
	if o.PauseLease == 0 {
		o.PauseLease = DefaultPauseLease
	}
	copts := CheckpointOptions{Namespace: o.Namespace, ID: o.ID, Dir: o.WorkDir, Sign: o.Sign, PauseLease: o.PauseLease}
	if o.Pages != nil && o.Lazy != nil {
		return nil, fmt.Errorf("migrate %s: copy and lazy modes at once", o.ID)
	}
	if o.Pages != nil {
		relay, err := o.Pages(ctx, o.Name)
		if err != nil {
			return nil, fmt.Errorf("migrate %s: nothing was paused: the page stream to the destination: %w", o.ID, err)
		}
		defer relay.Close()
		copts.PageServer, copts.PageStream = relay.Addr(), relay.Wait
	}
	var lazy LazyRelay
	if o.Lazy != nil {
		var err error
		if lazy, err = o.Lazy(ctx, o.Name); err != nil {
			return nil, fmt.Errorf("migrate %s: nothing was paused: %w", o.ID, err)
		}
		defer lazy.Close()
		copts.LazyPages, copts.LazyStream, copts.LazyTLS = lazy.Addr(), lazy.ID(), lazy.ServerTLS()
	}
	src, err := Checkpoint(ctx, o.Src, copts)
	if err != nil {
		return nil, err
	}
	res.Manifest, res.SignedBy = src.Manifest, src.SignedBy
	if m := src.Manifest; m != nil && m.PageStream != nil {
		res.PageBytes = m.PageStream.Size
	}
	phase("checkpoint")
	defer func() {
		if retErr != nil {
			if lazy != nil {
				lazy.Close() // CRIU lets the frozen task go; the resume waits for that
			}
			if err := src.Resume(context.WithoutCancel(ctx)); err != nil {
				log.G(ctx).WithError(err).Error("resume source after failed move")
			}
			if !o.KeepLocal { // it holds the process's memory: do not leave it behind
				os.RemoveAll(o.WorkDir)
			}
		}
	}()
	if res.Bytes, err = o.Send(ctx, o.WorkDir, o.Name); err != nil {
		return nil, fmt.Errorf("send checkpoint to the destination: %w", err)
	}
	if lazy != nil {
		err := lazy.Start(ctx)
		// CRIU read its TLS files when the relay connected (the shim removes them when the dump
		// ends, also after every failure before this point)
		os.RemoveAll(checkpoint.LazyTLSDir(o.WorkDir))
		if err != nil {
			return nil, fmt.Errorf("%w; nothing was restored, and the source resumes where it was frozen", err)
		}
	}
	phase("transfer")
	dtask, err := Restore(ctx, o.Dst, RestoreOptions{
		Namespace: o.Namespace, ID: o.TargetID, Ref: o.Name, Dir: o.WorkDir, LogPath: o.LogPath,
		Source: src.Spec, // the operator's running container, as the source's containerd has it
	})
	if err != nil {
		return nil, err
	}
	phase("restore")
	if lazy != nil {
		// the destination serves; the source stays frozen until it has every page
		err := lazy.Wait(ctx)
		if err == nil {
			// the daemon also ends, successfully, when the restored task exits: only a task
			// still running has its memory
			if st, serr := dtask.Status(ctx); serr != nil {
				err = fmt.Errorf("the destination task's status: %w", serr)
			} else if st.Status != containerd.Running {
				err = fmt.Errorf("the destination task is %s (exit status %d) before every page arrived", st.Status, st.ExitStatus)
			}
		}
		if err != nil {
			derr := removeTask(context.WithoutCancel(ctx), o.Dst, o.Namespace, o.TargetID, dtask)
			if derr != nil {
				return nil, fmt.Errorf("%w: %w; killing the destination task %s failed too: %w; the source resumes", ErrLazyRolledBack, err, o.TargetID, derr)
			}
			return nil, fmt.Errorf("%w: %w; the destination task %s, which ran meanwhile, was killed and removed, and the source resumes where it was frozen", ErrLazyRolledBack, err, o.TargetID)
		}
		res.PageBytes = lazy.Bytes()
		phase("pages")
	}
	if o.LeaveRunning {
		if err := src.Resume(ctx); err != nil {
			return res, fmt.Errorf("restored on the destination, but resuming the source failed: %w", err)
		}
		phase("resume-source")
	} else {
		// from here the destination serves: a source left paused by a migrate that dies now is
		// killed by its lease, never resumed beside its destination
		if err := src.CommitLease(ctx); err != nil {
			log.G(ctx).WithError(err).Warn("commit the source's pause lease")
		}
		err := stopTask(ctx, o.Namespace, src.Task)
		src.StopLease()
		if err != nil {
			return res, fmt.Errorf("restored on the destination, but stopping the source failed: %w", err)
		}
		// the container now lives on the destination: remove it (and its writable layer) here,
		// so that it can move back under the same id
		if ctr, err := o.Src.LoadContainer(ctx, o.ID); err == nil {
			if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil {
				return res, fmt.Errorf("restored on the destination, but removing the source container failed: %w", err)
			}
		}
		phase("stop-source")
	}
	if !o.KeepLocal {
		os.RemoveAll(o.WorkDir)
	}
	return res, nil
}

// ErrLazyRolledBack: a lazy move failed after the destination had resumed: its task was killed
// and removed and the source resumed (Migrate).
var ErrLazyRolledBack = errors.New("lazy move failed before every page arrived")

// removeTask kills the destination's task (restored in a lazy move whose pages stopped
// coming), deletes it and removes its container with its writable layer.
func removeTask(ctx context.Context, c *containerd.Client, ns, id string, task containerd.Task) error {
	ctx = namespaces.WithNamespace(ctx, ns)
	var errs []error
	if task != nil {
		if _, err := task.Delete(ctx, containerd.WithProcessKill); err != nil && !errdefs.IsNotFound(err) && !taskGone(ctx, c, id) {
			errs = append(errs, err)
		}
	}
	// the destination's lazy guard may be removing it too
	if ctr, err := c.LoadContainer(ctx, id); err == nil {
		if err := ctr.Delete(ctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// taskGone says whether container id on c has no task any more, asking again for up to 5 s: a
// task whose deletion failed because its shim went away under the call (the destination's lazy
// guard removing it at the same time: "ttrpc: closed") is gone once containerd has cleaned up
// after that shim, and a task still there is deleted once more meanwhile.
func taskGone(ctx context.Context, c *containerd.Client, id string) bool {
	for range 10 {
		ctr, err := c.LoadContainer(ctx, id)
		if errdefs.IsNotFound(err) {
			return true
		}
		if err == nil {
			task, err := ctr.Task(ctx, nil)
			if errdefs.IsNotFound(err) {
				return true
			}
			if err == nil {
				if _, err := task.Delete(ctx, containerd.WithProcessKill); err == nil || errdefs.IsNotFound(err) {
					return true
				}
			}
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(500 * time.Millisecond):
		}
	}
	return false
}

// RemoveContainer kills and deletes container id's task, if any, and removes the container
// with its writable layer, on c in namespace ns; what is already gone is not an error.
func RemoveContainer(ctx context.Context, c *containerd.Client, ns, id string) error {
	ctx = namespaces.WithNamespace(ctx, ns)
	ctr, err := c.LoadContainer(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	return removeTask(ctx, c, ns, id, task)
}

// stopTask kills a (paused) task and deletes it; the container record stays.
func stopTask(ctx context.Context, ns string, task containerd.Task) error {
	ctx = namespaces.WithNamespace(ctx, ns)
	ch, err := task.Wait(ctx)
	if err != nil {
		return err
	}
	if err := task.Kill(ctx, syscall.SIGKILL); err != nil {
		return err
	}
	_ = task.Resume(ctx) // a frozen task dies only once thawed
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		return fmt.Errorf("source task %s did not exit 10s after SIGKILL", task.ID())
	}
	_, err = task.Delete(ctx)
	return err
}
