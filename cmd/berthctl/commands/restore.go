package commands

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
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
		mountFlags        []string
		output            *format
	)
	cmd := &cobra.Command{
		Use:   "restore [-a SOCKET] [-n NS] --id ID [--root DIR] [--mount type=bind,src=P,dst=P]... [-o text|json] CHECKPOINT",
		Short: "Restore a received checkpoint (a name in the checkpoint root) as a new container with the berth runtime",
		Long: `restore creates a container of the berth runtime that berth's shim restores from CHECKPOINT.
Its spec is this node's, never the checkpoint's: containerd's default spec for the checkpoint's
image (namespaces, mounts, devices, capabilities, user), with only the process's arguments,
environment, working directory and terminal and the hostname taken from the checkpoint's
spec.dump. Hooks, mounts, devices and privileges recorded in a checkpoint are never used: give
a bind mount the checkpoint's container had with --mount (the restore refuses, naming it, when
one is missing); the shim gives the GPUs of its device map itself.`,
		Args: cobra.ExactArgs(1),
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
			mounts, err := parseMounts(mountFlags)
			if err != nil {
				return err
			}
			start := time.Now()
			if _, err := move.Restore(cmd.Context(), c, move.RestoreOptions{
				Namespace: ns, ID: id, Ref: args[0], Dir: dir, LogPath: logPath, Mounts: mounts,
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
	f.StringArrayVar(&mountFlags, "mount", nil, "a mount of the new container, as ctr's: type=bind,src=/host/path,dst=/path[,options=rbind:ro] (repeat it)")
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// parseMounts parses --mount values as ctr run's --mount does: comma-separated key=value pairs,
// type, src (or source), dst (or destination, target) and options (colon-separated). src and
// dst are required, dst absolute; type defaults to bind and a bind gets "rbind" when its options
// name neither bind nor rbind.
func parseMounts(flags []string) ([]specs.Mount, error) {
	var out []specs.Mount
	for _, f := range flags {
		m := specs.Mount{Type: "bind"}
		for kv := range strings.SplitSeq(f, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("--mount %q: %q is not key=value", f, kv)
			}
			switch k {
			case "type":
				m.Type = v
			case "src", "source":
				m.Source = v
			case "dst", "destination", "target":
				m.Destination = v
			case "options":
				m.Options = strings.Split(v, ":")
			default:
				return nil, fmt.Errorf("--mount %q: unknown key %q (want type, src, dst, options)", f, k)
			}
		}
		if m.Source == "" || !filepath.IsAbs(m.Destination) {
			return nil, fmt.Errorf("--mount %q: want src=PATH and an absolute dst=PATH", f)
		}
		if m.Type == "bind" && !slices.Contains(m.Options, "bind") && !slices.Contains(m.Options, "rbind") {
			m.Options = append(m.Options, "rbind")
		}
		out = append(out, m)
	}
	return out, nil
}
