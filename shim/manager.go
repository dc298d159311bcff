package shim

import (
	"context"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
)

// runcIDTakenFile is written into a bundle whose restore Create refused because runc's state
// directory already holds a container of the task's id (checkRuncID): that state is another
// container's, and the manager's Stop must not delete it.
const runcIDTakenFile = "berth-runc-id-taken"

// GuardManager wraps the runc shim's manager (its Start, Stop and Info), which berth's binary
// runs: its Stop, run when containerd cleans up after a failed Create, force-deletes runc's
// container of the task's id, and kills it. For a bundle whose restore was refused because that
// id belongs to another container on this host (another containerd's, such as the source of a
// move), Stop only unmounts the bundle's rootfs and leaves runc's state alone.
func GuardManager(m shim.Shim) shim.Shim { return guardedManager{Shim: m} }

type guardedManager struct{ shim.Shim }

func (m guardedManager) Stop(ctx context.Context, id string) (shim.StopStatus, error) {
	cwd, err := os.Getwd()
	if err != nil {
		return m.Shim.Stop(ctx, id)
	}
	bundle := filepath.Join(filepath.Dir(cwd), id)
	if _, err := os.Lstat(filepath.Join(bundle, runcIDTakenFile)); err != nil {
		return m.Shim.Stop(ctx, id)
	}
	log.G(ctx).WithField("id", id).Info("runc's container of this id is another's: not deleted")
	if err := mount.UnmountRecursive(filepath.Join(bundle, "rootfs"), 0); err != nil {
		log.G(ctx).WithError(err).Warn("failed to cleanup rootfs mount")
	}
	return shim.StopStatus{ExitedAt: time.Now(), ExitStatus: 128 + 9}, nil
}
