package main

import (
	"encoding/json"

	"github.com/containerd/containerd/v2/pkg/namespaces"

	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/berth-dev/berth/cmd/berthctl/move"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/oci/checkpoint"
)

func init() { subcommands = append(subcommands, checkpointCmd) }

func checkpointCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "checkpoint", Short: "Inspect berth checkpoints"}
	var output string
	var verify bool
	inspect := &cobra.Command{
		Use:   "inspect DIR",
		Short: "Show a checkpoint's manifest: container, fingerprint, CRIU statistics, sizes, phases",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := checkpoint.ReadManifest(args[0])
			if err != nil {
				return err
			}
			if verify {
				if err := checkpoint.Verify(args[0], m); err != nil {
					return err
				}
			}
			switch output {
			case "json":
				enc := json.NewEncoder(os.Stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(m)
			case "text", "":
				printManifest(os.Stdout, m, verify)
				return nil
			default:
				return fmt.Errorf("output format %q: want text or json", output)
			}
		},
	}
	inspect.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	inspect.Flags().BoolVar(&verify, "verify", false, "check every file's size and digest")
	cmd.AddCommand(inspect, checkpointCreateCmd(), checkpointSelectorCmd())
	return cmd
}

func checkpointCreateCmd() *cobra.Command {
	var address, ns string
	var exit bool
	cmd := &cobra.Command{
		Use:   "create --address SOCKET [-n NS] [--exit] CONTAINER DIR",
		Short: "Checkpoint a running container (berth runtime) into a new checkpoint directory",
		Long: `create pauses the task, has berth's shim dump it with CRIU into DIR/checkpoint, saves the
writable layer's changes, the spec and the manifest, and then resumes the task (leave-running) or,
with --exit, lets CRIU end it. Send DIR with 'berthctl send' and restore it with 'berthctl restore'.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := connect(cmd.Context(), "source", address)
			if err != nil {
				return err
			}
			defer c.Close()
			src, err := move.Checkpoint(cmd.Context(), c, move.CheckpointOptions{Namespace: ns, ID: args[0], Dir: args[1], Exit: exit})
			if err != nil {
				return err
			}
			if err := src.Resume(namespaces.WithNamespace(cmd.Context(), ns)); err != nil {
				return fmt.Errorf("checkpoint written to %s, but resuming %s failed: %w", args[1], args[0], err)
			}
			printManifest(os.Stdout, src.Manifest, false)
			return nil
		},
	}
	cmd.Flags().StringVarP(&address, "address", "a", "/run/containerd/containerd.sock", "containerd socket")
	cmd.Flags().StringVarP(&ns, "namespace", "n", "default", "containerd namespace")
	cmd.Flags().BoolVar(&exit, "exit", false, "end the task after the checkpoint instead of resuming it")
	return cmd
}

func printManifest(w io.Writer, m *checkpoint.Manifest, verified bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "container\t%s (namespace %s, runtime %s)\n", m.Container.ID, m.Container.Namespace, m.Container.Runtime)
	fmt.Fprintf(tw, "image\t%s %s\n", m.Container.Image, m.Container.ImageDigest)
	fmt.Fprintf(tw, "created\t%s\n", m.Created.Format("2006-01-02T15:04:05Z07:00"))
	fmt.Fprintf(tw, "size\t%s in %d files\n", humanBytes(m.ImageSize), len(m.Files))
	if verified {
		fmt.Fprintf(tw, "digests\tverified\n")
	}
	fp := m.Fingerprint
	fmt.Fprintf(tw, "fingerprint\tkernel %s, CRIU %s, runc %s, containerd %s, %s %s, %d CPU flags, %d GPUs\n",
		fp.Kernel, fp.CRIU, fp.Runc, fp.Containerd, fp.Arch, fp.CPU.Vendor, len(fp.CPU.Flags), len(fp.GPUs))
	s := m.CRIU
	fmt.Fprintf(tw, "CRIU dump\tfreezing %.1f ms, frozen %.1f ms, memdump %.1f ms, memwrite %.1f ms\n",
		us(s.FreezingTimeUs), us(s.FrozenTimeUs), us(s.MemdumpTimeUs), us(s.MemwriteTimeUs))
	fmt.Fprintf(tw, "CRIU pages\tscanned %d, written %d (%s), skipped (parent) %d\n",
		s.PagesScanned, s.PagesWritten, humanBytes(int64(s.PagesWritten)*int64(os.Getpagesize())), s.PagesSkippedParent)
	if g := m.GPU; g != nil {
		fmt.Fprintf(tw, "GPU driver\t%s, CUDA %s, CUDA processes %v (in the container: %v)\n", g.Driver, g.CUDA, g.PIDs, g.NSPIDs)
		for i, d := range g.Devices {
			fmt.Fprintf(tw, "GPU %d\t%s %s, %s used of %s, %v\n", i, d.UUID, d.Name, humanBytes(int64(d.MemoryUsed)), humanBytes(int64(d.MemoryTotal)), d.DevicePaths)
		}
	}
	for _, p := range m.Phases {
		fmt.Fprintf(tw, "phase %s\t%.1f ms\n", p.Name, p.Ms)
	}
}

func us(v uint32) float64 { return float64(v) / 1000 }

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
