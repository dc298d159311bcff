package main

import (
	"context"
	"encoding/json"
	"os"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/spf13/cobra"
)

func init() { subcommands = append(subcommands, fingerprintCmd) }

func fingerprintCmd() *cobra.Command {
	var criuPath, gpuKind, fakeRoot string
	cmd := &cobra.Command{
		Use:   "fingerprint",
		Short: "Print this node's fingerprint as JSON (kernel, CRIU, CPU, runc, containerd, GPUs)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			n, err := openNode(criuPath, gpuKind, fakeRoot)
			if err != nil {
				return err
			}
			fp, err := n.fingerprint(cmd.Context())
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(fp)
		},
	}
	cmd.Flags().StringVar(&criuPath, "criu", "", "CRIU binary (default: criu from PATH)")
	cmd.Flags().StringVar(&gpuKind, "gpu", "none", "GPU backend: none, cuda (NVML and libcuda.so.1) or fake")
	cmd.Flags().StringVar(&fakeRoot, "fake-gpu-root", "", "the fake GPU node directory (with --gpu fake)")
	return cmd
}

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
	b, err := backend.Open(kind, fakeRoot)
	if err != nil {
		return nil, err
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
