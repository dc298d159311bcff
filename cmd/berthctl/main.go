// Command berthctl is the operator's tool: this node's topology and fingerprint, placement plans,
// checkpoint inspection, and moves of running containers between containerd nodes.
//
// main only wires: each subcommand lives in its own file and calls into the berth packages.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

// subcommands is filled by each subcommand file's init, so files do not edit each other.
var subcommands []func() *cobra.Command

func main() {
	root := &cobra.Command{
		Use:           "berthctl",
		Short:         "Place, checkpoint and move GPU inference containers on containerd nodes",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	for _, mk := range subcommands {
		root.AddCommand(mk())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "berthctl:", err)
		os.Exit(1)
	}
}
