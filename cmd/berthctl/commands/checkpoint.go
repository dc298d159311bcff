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

// CheckpointInspect is `berthctl checkpoint inspect`; --verify checks the signature with the
// trust policy of g's --config.
func CheckpointInspect(g *Globals) *cobra.Command {
	var (
		verify bool
		trust  *trustFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "inspect [--verify] [-o text|json] DIR|FILE.tar",
		Short: "Show a checkpoint's manifest: container, fingerprint, CRIU statistics, sizes, phases",
		Long: `inspect prints the checkpoint's berth.json. With --verify it first checks every file's size and
digest and that berth.sig is the signature of a key this node trusts (signing_key and
trusted_keys of --config, --trusted-key), and names the key.

FILE.tar is read in place, never extracted: berth's archives, and the kubelet's checkpoint API
archives (/var/lib/kubelet/checkpoints/*.tar), whose berth manifest is the one the shim wrote and
signed beside the CRIU images (checkpoint/berth.json): --verify then checks that signature and
the CRIU images' digests as the tar streams by; the rest of such an archive (rootfs-diff.tar,
spec.dump, config.dump) is written by containerd after the shim signed and is not covered.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			archive, err := isArchive(args[0])
			if err != nil {
				return err
			}
			var (
				m        *checkpoint.Manifest
				a        *archiveManifest
				signedBy string
			)
			if archive {
				if a, err = readArchive(args[0]); err != nil {
					return err
				}
				m = a.Manifest
			} else if m, err = checkpoint.ReadManifest(args[0]); err != nil {
				return err
			}
			if verify {
				policy, err := trust.policy(g)
				if err != nil {
					return err
				}
				if archive {
					signedBy, err = verifyArchive(cmd.Context(), policy, args[0], a, cmd.ErrOrStderr())
				} else if err = checkpoint.Verify(args[0], m); err == nil {
					signedBy, err = verifyCheckpoint(cmd.Context(), policy, args[0], cmd.ErrOrStderr())
				}
				if err != nil {
					return err
				}
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), m)
			}
			if verify && signedBy == "" {
				signedBy = "unsigned or untrusted (accepted only because allow_unsigned is set)"
			}
			printManifest(cmd.OutOrStdout(), m, verify, signedBy)
			if a != nil && a.Dir != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "manifest  %s/%s of a kubelet archive: its digests and signature cover %s\n", a.Dir, checkpoint.ManifestFile, a.covers())
			}
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	cmd.Flags().BoolVar(&verify, "verify", false, "check every file's size and digest, and the signature")
	trust = addTrustFlags(cmd.Flags(), false, true)
	return cmd
}

// CheckpointSign is `berthctl checkpoint sign`, with the key of g's --config.
func CheckpointSign(g *Globals) *cobra.Command {
	var trust *trustFlags
	cmd := &cobra.Command{
		Use:   "sign [--signing-key KEY] DIR",
		Short: "Sign a checkpoint directory with this node's key, after checking every file against its berth.json",
		Long: `sign checks every file of the checkpoint directory DIR against its berth.json, then signs berth.json
with this node's key (signing_key of --config, or --signing-key), replacing berth.sig. berthctl
signs what it writes itself (checkpoint create, migrate, push of a CRI archive): sign is for a
checkpoint this node vouches for that was written unsigned. Whoever signs vouches for every byte:
sign only what this node produced or checked.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir := args[0]
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			if policy.Signer == nil {
				return fmt.Errorf("%w: set signing_key in %s (--config) or give --signing-key", errNoSigningKey, g.Config)
			}
			if checkpoint.IsCRICheckpoint(dir) {
				return fmt.Errorf("%s is a CRI checkpoint without a top-level %s: push its archive with 'berthctl checkpoint push', which signs it whole", dir, checkpoint.ManifestFile)
			}
			m, err := checkpoint.ReadManifest(dir)
			if err != nil {
				return err
			}
			if err := checkpoint.Verify(dir, m); err != nil {
				return err
			}
			id, err := policy.Sign(cmd.Context(), dir)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "signed %s with %s\n", dir, id)
			return nil
		},
	}
	trust = addTrustFlags(cmd.Flags(), true, false)
	return cmd
}

// CheckpointCreate is `berthctl checkpoint create`, on the containerd of g, signed with the key
// of g's --config.
func CheckpointCreate(g *Globals) *cobra.Command {
	var (
		exit   bool
		trust  *trustFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "create [-a SOCKET] [-n NS] [--exit] [-o text|json] CONTAINER DIR",
		Short: "Checkpoint a running container (berth runtime) into a new checkpoint directory",
		Long: `create pauses the task, has berth's shim dump it with CRIU into DIR/checkpoint, saves the
writable layer's changes, the spec and the manifest, signs the manifest with this node's key
(signing_key of --config, or --signing-key: berth.sig), and then resumes the task
(leave-running) or, with --exit, lets CRIU end it. Every file is mode 0600, every directory 0700.
It prints the manifest (-o json: as JSON). Send DIR with 'berthctl send' and restore it with
'berthctl restore'.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			if err := checkSigner(policy, g, "the checkpoint", cmd.ErrOrStderr()); err != nil {
				return err
			}
			c, err := connect(cmd.Context(), g.addressFlag(), "source", g.Address)
			if err != nil {
				return err
			}
			defer c.Close()
			src, err := move.Checkpoint(cmd.Context(), c, move.CheckpointOptions{Namespace: ns, ID: args[0], Dir: args[1], Exit: exit, Sign: policy.Sign})
			if err != nil {
				return err
			}
			if err := src.Resume(namespaces.WithNamespace(cmd.Context(), ns)); err != nil {
				return fmt.Errorf("checkpoint written to %s, but resuming %s failed: %w", args[1], args[0], err)
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), src.Manifest)
			}
			signed := src.SignedBy
			if signed == "" {
				signed = "unsigned (allow_unsigned)"
			}
			printManifest(cmd.OutOrStdout(), src.Manifest, false, signed)
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	cmd.Flags().BoolVar(&exit, "exit", false, "end the task after the checkpoint instead of resuming it")
	trust = addTrustFlags(cmd.Flags(), true, false)
	return cmd
}

// printManifest writes m as a table; verified says the digests were checked, signedBy (when set)
// who signed it.
func printManifest(w io.Writer, m *checkpoint.Manifest, verified bool, signedBy string) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "container\t%s (namespace %s, runtime %s)\n", m.Container.ID, m.Container.Namespace, m.Container.Runtime)
	fmt.Fprintf(tw, "image\t%s %s\n", m.Container.Image, m.Container.ImageDigest)
	fmt.Fprintf(tw, "created\t%s\n", m.Created.Format("2006-01-02T15:04:05Z07:00"))
	fmt.Fprintf(tw, "size\t%s in %d files\n", humanBytes(m.ImageSize), len(m.Files))
	if verified {
		fmt.Fprintf(tw, "digests\tverified\n")
	}
	if signedBy != "" {
		fmt.Fprintf(tw, "signed by\t%s\n", signedBy)
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
		fmt.Fprintf(tw, "GPU device map\t%s\n", deviceMapRule(g))
	}
	for _, p := range m.Phases {
		fmt.Fprintf(tw, "phase %s\t%.1f ms\n", p.Name, p.Ms)
	}
}
