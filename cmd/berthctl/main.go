// Command berthctl is the operator's tool: this node's topology and fingerprint, placement plans,
// checkpoints (create, inspect, push, pull), and moves of running containers between containerd
// nodes.
//
// main only wires: the commands live in package commands; newRoot says which there are, how they
// nest and in which group of the help each is listed.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/commands"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	root := newRoot(os.Getenv)
	if filepath.Base(os.Args[0]) == kubectlPlugin {
		// kubectl's plugin convention: kubectl-berth on PATH is `kubectl berth`
		root.Use = "kubectl berth"
	}
	err := root.ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "berthctl:", err)
		os.Exit(1)
	}
}

// kubectlPlugin is berthctl's name as a kubectl plugin (a link or copy on PATH).
const kubectlPlugin = "kubectl-berth"

// The groups of the root's help, in the order they are listed.
const (
	groupNode        = "node"
	groupCheckpoints = "checkpoints"
	groupMoves       = "moves"
)

// newRoot returns berthctl's root command: the global flags (their defaults from getenv, as
// ctr's) and every command.
func newRoot(getenv func(string) string) *cobra.Command {
	root := &cobra.Command{
		Use:   "berthctl",
		Short: "Place, checkpoint and move GPU inference containers on containerd nodes",
		Long: `berthctl shows a node's topology and fingerprint, explains a placement, creates and inspects
checkpoints, and moves a running container from one containerd node to another.

-a/--address and -n/--namespace choose the containerd and its namespace, as ctr's do
($CONTAINERD_ADDRESS and $CONTAINERD_NAMESPACE when not given). Commands that print a result
take -o text|json; a file to write is --file.

--config is the node's berth configuration, the shim's ($BERTH_SHIM_CONFIG, default
/etc/berth/shim.toml): berthctl reads its signing_key (every checkpoint berthctl writes or pushes
is signed with it), trusted_keys and allow_unsigned (receive, pull, push and inspect --verify
keep only checkpoints a trusted key signed) and checkpoint_root (the default --root).`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	g := &commands.Globals{}
	g.AddFlags(root.PersistentFlags(), getenv)
	root.AddGroup(
		&cobra.Group{ID: groupNode, Title: "Node:"},
		&cobra.Group{ID: groupCheckpoints, Title: "Checkpoints:"},
		&cobra.Group{ID: groupMoves, Title: "Moves:"},
	)

	checkpoint := commands.Checkpoint()
	checkpoint.AddCommand(
		commands.CheckpointCreate(g),
		commands.CheckpointInspect(g),
		commands.CheckpointSign(g),
		commands.CheckpointSelector(),
		commands.CheckpointPush(g),
		commands.CheckpointPull(g),
		commands.CheckpointCheck(g),
		commands.CheckpointNeed(),
		commands.CheckpointLs(g),
		commands.CheckpointRm(g),
		commands.CheckpointGC(g),
	)
	for _, c := range []struct {
		group string
		cmd   *cobra.Command
	}{
		{groupNode, commands.Fingerprint()},
		{groupNode, commands.Labels()},
		{groupNode, commands.Topology()},
		{groupNode, commands.Plan()},
		{groupCheckpoints, checkpoint},
		{groupMoves, commands.Migrate(g)},
		{groupMoves, commands.Move(g)},
		{groupMoves, commands.Send()},
		{groupMoves, commands.SendPages()},
		{groupMoves, commands.Receive(g)},
		{groupMoves, commands.Restore(g)},
	} {
		c.cmd.GroupID = c.group
		root.AddCommand(c.cmd)
	}

	root.AddCommand(commands.LazyGuard(), commands.Probe())
	// the former places of push and pull: they still work, hidden, and say where they went
	for _, c := range []*cobra.Command{commands.CheckpointPush(g), commands.CheckpointPull(g)} {
		c.Deprecated = "use 'berthctl checkpoint " + c.Name() + "'"
		root.AddCommand(c)
	}
	return root
}
