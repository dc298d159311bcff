package commands

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// CheckpointCheck is `berthctl checkpoint check`: the destination preflight of a move by hand.
func CheckpointCheck(g *Globals) *cobra.Command {
	var (
		on, root string
		nf       nodeFlags
		output   *format
	)
	cmd := &cobra.Command{
		Use:   "check --on SOCKET [-n NS] [--root DIR] [-o text|json] DIR|ARCHIVE",
		Short: "Check that the node of containerd SOCKET (this host) can restore a checkpoint, before it is moved there",
		Long: `check reads the checkpoint's berth.json and spec.dump (a directory, or a tar archive of one) and
checks the node that containerd --on runs on (this host): the image with the checkpoint's digest
in namespace -n, every bind source of the spec, the memory limit against the checkpoint's memory
pages, free memory, namespaces joined by path, free disk under --root (default checkpoint_root of
--config), the fingerprint (CRIU, kernel, CPU, runc, containerd) and, with --gpu, the device
memory free on this node's GPUs of the checkpoint's models (mapped as the shim will map them:
each checkpointed GPU onto one with at least the memory the container held). Each refusal names the
field, its value there and what the checkpoint needs; the exit status is non-zero when any.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if on == "" {
				return fmt.Errorf("--on is required (the destination containerd socket)")
			}
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			if root, err = g.checkpointRoot(cmd.Flags(), root); err != nil {
				return err
			}
			need, err := move.NeedOfCheckpoint(args[0])
			if err != nil {
				return err
			}
			n, err := nf.open()
			if err != nil {
				return err
			}
			c, err := connect(ctx, "--on", "destination", on)
			if err != nil {
				return err
			}
			defer c.Close()
			dst := move.Destination{
				Client: c, Namespace: ns, Local: true, Root: root,
				Fingerprint: func(ctx context.Context) (fingerprint.Fingerprint, error) { return n.fingerprint(ctx) },
			}
			if n.gpu != nil {
				dst.GPUs = n.gpu.Inventory()
			}
			perr := move.Preflight(ctx, dst, need)
			var pe *move.PreflightError
			if perr != nil && !errors.As(perr, &pe) {
				return perr
			}
			res := checkResult{Checkpoint: args[0], On: on, OK: perr == nil, Refusals: []move.Refusal{}}
			if pe != nil {
				res.Refusals = pe.Refusals
			}
			if output.json() {
				if err := writeJSON(cmd.OutOrStdout(), res); err != nil {
					return err
				}
			} else if res.OK {
				checked := "image, bind sources, memory, namespaces, disk, fingerprint"
				if dst.GPUs != nil {
					checked += ", GPU memory"
				}
				fmt.Fprintf(cmd.OutOrStdout(), "ok: %s can be restored on %s (%s)\n", args[0], on, checked)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "refused: %s cannot be restored on %s:\n", args[0], on)
				for _, r := range res.Refusals {
					fmt.Fprintf(cmd.OutOrStdout(), "  %s\n", r)
				}
			}
			if perr != nil {
				return fmt.Errorf("checkpoint check %s: %w", args[0], perr)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&on, "on", "", "destination containerd socket (required; its node is this host)")
	f.StringVar(&root, "root", "", "destination checkpoint root, for the free disk (default: checkpoint_root of --config, else "+checkpoint.DefaultRoot+")")
	nf.add(f)
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// checkResult is what `berthctl checkpoint check` prints with -o json.
type checkResult struct {
	Checkpoint string         `json:"checkpoint"`
	On         string         `json:"on"`
	OK         bool           `json:"ok"`
	Refusals   []move.Refusal `json:"refusals"`
}
