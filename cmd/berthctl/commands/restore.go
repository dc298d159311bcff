package commands

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// restoreResult is what `berthctl restore -o json` prints.
type restoreResult struct {
	// ID is the new container's id, Namespace its namespace.
	ID        string `json:"id"`
	Namespace string `json:"namespace"`
	// Checkpoint is the restore-from reference (the name in the checkpoint root, or a path); Dir
	// the directory it names.
	Checkpoint string `json:"checkpoint"`
	Dir        string `json:"dir"`
	// Ms is the restore's wall time in milliseconds (create, the shim's checks and CRIU restore).
	Ms float64 `json:"ms"`
}

// Restore is `berthctl restore`, on the containerd of g.
func Restore(g *Globals) *cobra.Command {
	var (
		id, logPath, root string
		output            *format
	)
	cmd := &cobra.Command{
		Use:   "restore [-a SOCKET] [-n NS] --id ID [--root DIR] [-o text|json] CHECKPOINT",
		Short: "Restore a received checkpoint (a name in the checkpoint root) as a new container with the berth runtime",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if id == "" {
				return errors.New("--id is required (the id of the container to create)")
			}
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			c, err := connect(cmd.Context(), g.addressFlag(), "destination", g.Address)
			if err != nil {
				return err
			}
			defer c.Close()
			if err := targetFree(cmd.Context(), c, ns, id); err != nil {
				return err
			}
			dir := args[0]
			if root, err = g.checkpointRoot(cmd.Flags(), root); err != nil {
				return err
			}
			if !filepath.IsAbs(dir) {
				dir = filepath.Join(root, dir)
			}
			start := time.Now()
			if _, err := move.Restore(cmd.Context(), c, move.RestoreOptions{
				Namespace: ns, ID: id, Ref: args[0], Dir: dir, LogPath: logPath,
			}); err != nil {
				return err
			}
			r := restoreResult{ID: id, Namespace: ns, Checkpoint: args[0], Dir: dir, Ms: millis(time.Since(start))}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), r)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "restored %s from %s in %.1f ms\n", r.ID, r.Checkpoint, r.Ms)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&id, "id", "", "id of the new container (required)")
	f.StringVar(&root, "root", "", "checkpoint root (default: checkpoint_root of --config, else "+checkpoint.DefaultRoot+")")
	f.StringVar(&logPath, "log", "", "file for the restored task's stdout/stderr")
	output = addFormat(f, formatText, formatJSON)
	return cmd
}
