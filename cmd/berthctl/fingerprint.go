package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/shim"
)

func init() { subcommands = append(subcommands, fingerprintCmd) }

func fingerprintCmd() *cobra.Command {
	var criuPath, gpuKind, fakeRoot string
	cmd := &cobra.Command{
		Use:   "fingerprint",
		Short: "Print this node's fingerprint as JSON (kernel, CRIU, CPU, runc, containerd, GPUs)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := shim.DefaultConfig()
			cfg.CRIUPath, cfg.GPU, cfg.FakeGPURoot = criuPath, gpuKind, fakeRoot
			if err := gpuFlags(gpuKind, fakeRoot); err != nil {
				return err
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			deps, err := shim.RealDeps(cfg, false)
			if err != nil {
				return err
			}
			fp, err := deps.Fingerprint(cmd.Context())
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

// gpuFlags checks the --gpu and --fake-gpu-root flags, naming them (not the config keys).
func gpuFlags(kind, fakeRoot string) error {
	switch kind {
	case "none", "cuda":
		return nil
	case "fake":
		if !filepath.IsAbs(fakeRoot) {
			return fmt.Errorf("--gpu fake needs --fake-gpu-root with an absolute path, got %q", fakeRoot)
		}
		return nil
	}
	return fmt.Errorf("--gpu %q: want none, cuda or fake", kind)
}
