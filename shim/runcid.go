package shim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
)

// defaultRuncRoot is runc's state directory when the runtime options name none (the runc shim's
// process.RuncRoot); each containerd namespace has its own directory below it.
const defaultRuncRoot = "/run/containerd/runc"

// checkRuncID refuses a restore whose task id runc already holds in its state directory: another
// container of that id runs on this host under another containerd (as the source of a move
// between two containerd instances on one host, which share runc's state directory). runc's
// restore would fail with "container with given ID already exists" after CRIU was set up, and
// the failed task could then not be deleted (runc's delete finds the other container), leaving
// a CREATED task behind. Refused here, in Create, nothing exists yet; the bundle is marked
// (runcIDTakenFile) so that the cleanup containerd then runs leaves the other container alone.
func checkRuncID(ctx context.Context, r *taskAPI.CreateTaskRequest) error {
	ns, ok := namespaces.Namespace(ctx)
	if !ok {
		return nil
	}
	root := defaultRuncRoot
	if r.Options.GetValue() != nil {
		if v, err := typeurl.UnmarshalAny(r.Options); err == nil {
			if o, ok := v.(*options.Options); ok && o.Root != "" {
				root = o.Root
			}
		}
	}
	state := filepath.Join(root, ns, r.ID, "state.json")
	if _, err := os.Lstat(state); err != nil {
		return nil
	}
	// containerd cleans up after the refused Create with the manager's Stop: it must leave
	// the other container alone (GuardManager)
	if err := os.WriteFile(filepath.Join(r.Bundle, runcIDTakenFile), nil, 0o600); err != nil {
		return fmt.Errorf("restore %s: runc already holds a container of this id (%s), and the bundle cannot say so: %w", r.ID, state, err)
	}
	return fmt.Errorf("runc already holds a container %s (%s), so the restore would fail: another containerd on this host runs a container of that id (a move between two containerd instances on one host needs another id): %w",
		r.ID, state, errdefs.ErrAlreadyExists)
}
