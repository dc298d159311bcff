package move

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
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
	// Bytes is what was sent to the destination, in bytes.
	Bytes int64
	// Phases are the wall times of checkpoint, transfer, restore and stop-source, in order.
	Phases []checkpoint.Phase
}

// Migrate checkpoints the source container (paused while it is dumped and moved, so it cannot
// diverge), sends the checkpoint to the destination, restores it there with berth's runtime, and
// only then stops the source (or resumes it with LeaveRunning). On any error before the restore
// succeeded, the source is resumed and keeps running, and the destination holds no container;
// a checkpoint already received stays in the destination's root, intact.
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
	if o.Pages != nil {
		relay, err := o.Pages(ctx, o.Name)
		if err != nil {
			return nil, err
		}
		defer relay.Close()
		copts.PageServer, copts.PageStream = relay.Addr(), relay.Wait
	}
	src, err := Checkpoint(ctx, o.Src, copts)
	if err != nil {
		return nil, err
	}
	res.Manifest, res.SignedBy = src.Manifest, src.SignedBy
	phase("checkpoint")
	defer func() {
		if retErr != nil {
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
	phase("transfer")
	if _, err := Restore(ctx, o.Dst, RestoreOptions{
		Namespace: o.Namespace, ID: o.TargetID, Ref: o.Name, Dir: o.WorkDir, LogPath: o.LogPath,
	}); err != nil {
		return nil, err
	}
	phase("restore")
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
