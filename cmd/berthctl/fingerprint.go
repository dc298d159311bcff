package main

import (
	"encoding/json"
	"os"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/shim"
)

func init() { subcommands = append(subcommands, fingerprintCmd) }

func fingerprintCmd() *cobra.Command {
	var criuPath string
	cmd := &cobra.Command{
		Use:   "fingerprint",
		Short: "Print this node's fingerprint as JSON (kernel, CRIU, CPU, runc, containerd, GPUs)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := shim.DefaultConfig()
			cfg.CRIUPath = criuPath
			fp, err := shim.RealDeps(cfg, false).Fingerprint(cmd.Context())
			if err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(fp)
		},
	}
	cmd.Flags().StringVar(&criuPath, "criu", "", "CRIU binary (default: criu from PATH)")
	return cmd
}
