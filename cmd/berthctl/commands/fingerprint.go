package commands

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/gpu/nvml"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Fingerprint is `berthctl fingerprint`.
func Fingerprint() *cobra.Command {
	var (
		nf     nodeFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "fingerprint [--gpu none|cuda|fake] [-o json|text]",
		Short: "Print this node's fingerprint (kernel, CRIU, CPU, runc, containerd, GPUs), as JSON unless -o text",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			n, err := nf.open()
			if err != nil {
				return err
			}
			fp, err := n.fingerprint(cmd.Context())
			if err != nil {
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), fp)
			}
			printFingerprint(cmd.OutOrStdout(), fp)
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatJSON, formatText)
	nf.add(cmd.Flags())
	return cmd
}

// printFingerprint writes fp as a table, one field a line.
func printFingerprint(w io.Writer, fp fingerprint.Fingerprint) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "kernel\t%s (%s)\n", fp.Kernel, fp.Arch)
	fmt.Fprintf(tw, "CPU\t%s family %s model %s, %s\n", fp.CPU.Vendor, fp.CPU.Family, fp.CPU.Model, fp.CPU.ModelName)
	fmt.Fprintf(tw, "CPU flags\t%s\n", strings.Join(fp.CPU.Flags, " "))
	fmt.Fprintf(tw, "CRIU\t%s\n", fp.CRIU)
	fmt.Fprintf(tw, "runc\t%s\n", fp.Runc)
	fmt.Fprintf(tw, "containerd\t%s\n", fp.Containerd)
	for _, g := range fp.GPUs {
		fmt.Fprintf(tw, "GPU %d\t%s %s, %s, driver %s, CUDA %s\n", g.Index, g.UUID, g.Name, humanBytes(int64(g.MemoryBytes)), g.Driver, g.CUDA)
	}
}

// nodeFlags are the flags of the commands that probe this node (fingerprint, labels): the CRIU
// binary and the GPU backend.
type nodeFlags struct {
	criuPath, gpuKind, fakeRoot string
}

// Environment defaults of --gpu and --fake-gpu-root: a container that runs berthctl for its node
// (the berth-probe DaemonSet of contrib/kubernetes) names its GPU backend once for every
// command run in it.
const (
	EnvGPU         = "BERTH_GPU"
	EnvFakeGPURoot = "BERTH_FAKE_GPU_ROOT"
)

func (f *nodeFlags) add(fs *pflag.FlagSet) {
	kind := os.Getenv(EnvGPU)
	if kind == "" {
		kind = "none"
	}
	fs.StringVar(&f.criuPath, "criu", "", "CRIU binary (default: criu from PATH)")
	fs.StringVar(&f.gpuKind, "gpu", kind, "GPU backend: none, cuda (NVML and libcuda.so.1) or fake ($"+EnvGPU+")")
	fs.StringVar(&f.fakeRoot, "fake-gpu-root", os.Getenv(EnvFakeGPURoot), "the fake GPU node directory (with --gpu fake) ($"+EnvFakeGPURoot+")")
}

// open checks the --gpu and --fake-gpu-root flags and opens the GPU backend they name.
func (f *nodeFlags) open() (*host, error) { return openNode(f.criuPath, f.gpuKind, f.fakeRoot) }

// host is what berthctl probes on the machine it runs on: /proc, the CRIU, runc and containerd
// binaries on PATH, and the GPU backend named by --gpu.
type host struct {
	src fingerprint.Sources
	gpu gpu.Backend // nil with --gpu none
}

// openNode checks the --gpu and --fake-gpu-root flags (naming the flags, not the shim's config
// keys) and opens the GPU backend they name.
func openNode(criuPath, kind, fakeRoot string) (*host, error) {
	if err := backend.Check(kind, fakeRoot, "--gpu", "--fake-gpu-root"); err != nil {
		return nil, err
	}
	b, err := backend.Open(kind, fakeRoot, nvml.OpenInventory)
	if err != nil {
		return nil, fmt.Errorf("--gpu %s: %w", kind, err)
	}
	return &host{src: fingerprint.NodeSources("/proc", criuPath, nil), gpu: b}, nil
}

// fingerprint returns this node's fingerprint, GPUs included when a backend is open. The error
// of the GPU inventory is returned only when the rest was collected.
func (n *host) fingerprint(ctx context.Context) (fingerprint.Fingerprint, error) {
	fp, err := fingerprint.Collect(ctx, n.src)
	if err != nil || n.gpu == nil {
		return fp, err
	}
	fp.GPUs, err = backend.FingerprintGPUs(n.gpu.Inventory())
	return fp, err
}
