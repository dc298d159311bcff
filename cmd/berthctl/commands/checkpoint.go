package commands

import (
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// Checkpoint is `berthctl checkpoint`, the parent of the verbs on checkpoints (create, inspect,
// selector, push, pull), which main adds.
func Checkpoint() *cobra.Command {
	return &cobra.Command{
		Use:   "checkpoint",
		Short: "Create, inspect, push and pull berth checkpoints",
		Long: `A berth checkpoint is a directory (or a tar archive of one): the CRIU images, the writable
layer's changes, the spec and berth.json, the manifest with every file's digest and the source
node's fingerprint.`,
		// runnable, so that an unknown verb is an error (cobra only prints the help of a parent)
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
}

// CheckpointInspect is `berthctl checkpoint inspect`.
func CheckpointInspect() *cobra.Command {
	var (
		verify bool
		output *format
	)
	cmd := &cobra.Command{
		Use:   "inspect [--verify] [-o text|json] DIR",
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
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), m)
			}
			printManifest(cmd.OutOrStdout(), m, verify)
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	cmd.Flags().BoolVar(&verify, "verify", false, "check every file's size and digest")
	return cmd
}

// CheckpointCreate is `berthctl checkpoint create`, on the containerd of g.
func CheckpointCreate(g *Globals) *cobra.Command {
	var (
		exit   bool
		output *format
	)
	cmd := &cobra.Command{
		Use:   "create [-a SOCKET] [-n NS] [--exit] [-o text|json] CONTAINER DIR",
		Short: "Checkpoint a running container (berth runtime) into a new checkpoint directory",
		Long: `create pauses the task, has berth's shim dump it with CRIU into DIR/checkpoint, saves the
writable layer's changes, the spec and the manifest, and then resumes the task (leave-running) or,
with --exit, lets CRIU end it. It prints the manifest (-o json: as JSON). Send DIR with
'berthctl send' and restore it with 'berthctl restore'.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			c, err := connect(cmd.Context(), g.addressFlag(), "source", g.Address)
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
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), src.Manifest)
			}
			printManifest(cmd.OutOrStdout(), src.Manifest, false)
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
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
