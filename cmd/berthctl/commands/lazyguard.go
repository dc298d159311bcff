package commands

import (
	"context"
	"fmt"
	"os"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer"
)

// lazyGuardCommand is the hidden command a receiver runs as its transfer.Receiver.LazyGuard.
const lazyGuardCommand = "lazy-guard"

// lazyGuardArgv is the LazyGuard command line of this berthctl binary; nil (lazy streams
// refused) when its path cannot be found.
func lazyGuardArgv() []string {
	exe, err := os.Executable()
	if err != nil {
		return nil
	}
	return []string{exe, lazyGuardCommand}
}

// LazyGuard is `berthctl lazy-guard CRIU CHECKPOINT` (hidden): the guard of a lazy page
// stream's `criu lazy-pages` daemon, which a receiver starts with the files
// transfer.RunLazyGuard describes. If the stream ends before every page arrived, it kills the
// task restored from CHECKPOINT before the daemon loses its input, then removes its container
// through containerd (the task record's address). Exit status 0 only when the daemon exited
// successfully.
func LazyGuard() *cobra.Command {
	return &cobra.Command{
		Use:    lazyGuardCommand + " CRIU CHECKPOINT",
		Short:  "Guard a lazy page stream's criu lazy-pages daemon (run by the receiver)",
		Hidden: true,
		Args:   cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return transfer.RunLazyGuard(context.Background(), transfer.LazyGuardOptions{
				CRIU: args[0], Checkpoint: args[1], Log: cmd.ErrOrStderr(), Cleanup: removeLazyTask,
			})
		},
	}
}

// removeLazyTask removes the (killed) task t and its container, with its writable layer,
// through t's containerd.
func removeLazyTask(ctx context.Context, t *checkpoint.LazyTask) error {
	if t.Address == "" {
		return fmt.Errorf("containerd's address is unknown")
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	c, err := containerd.New(t.Address)
	if err != nil {
		return err
	}
	defer c.Close()
	return move.RemoveContainer(ctx, c, t.Namespace, t.ID)
}
