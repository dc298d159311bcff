package commands

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// CheckpointSelector is `berthctl checkpoint selector`.
func CheckpointSelector() *cobra.Command {
	var output *format
	cmd := &cobra.Command{
		Use:   "selector [-o yaml|json] DIR|FILE.tar",
		Short: "Print the nodeSelector a pod restoring this checkpoint needs (berth.dev/* node labels)",
		Long: `selector reads the checkpoint's berth.json (from a checkpoint directory, or from a tar archive
without extracting it: berth's, or the kubelet's checkpoint API archive, whose berth manifest is the
shim's checkpoint/berth.json) and prints the node selector that matches nodes labelled by 'berthctl labels'
whose fingerprint can take the checkpoint: the exact-match labels (arch, kernel, CPU vendor, runc
major.minor, containerd major, GPU count, model, driver and CUDA version) and berth.dev/fingerprint,
the hash of the fields that must be equal. Paste it into the restore pod's spec. The shim still
checks the whole fingerprint (CPU flags, CRIU version, GPU memory) when the pod starts.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			m, err := readCheckpointManifest(args[0])
			if err != nil {
				return err
			}
			v := struct {
				NodeSelector map[string]string `json:"nodeSelector"`
			}{fingerprint.Selector(m.Fingerprint)}
			var out []byte
			if output.json() {
				out, err = json.MarshalIndent(v, "", "  ")
				out = append(out, '\n')
			} else {
				out, err = yaml.Marshal(v)
			}
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(out)
			return err
		},
	}
	output = addFormat(cmd.Flags(), formatYAML, formatJSON)
	return cmd
}

// readCheckpointManifest reads the berth manifest of a checkpoint directory or archive file.
func readCheckpointManifest(p string) (*checkpoint.Manifest, error) {
	info, err := os.Stat(p)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w (a registry reference must be pulled first: berthctl checkpoint pull REF DIR)", p, err)
	}
	if info.IsDir() {
		return checkpoint.ReadManifest(p)
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("checkpoint %s: not a directory or a regular file", p)
	}
	return readArchiveManifest(p)
}

// readArchiveManifest reads the berth manifest of a checkpoint tar archive in place: the
// top-level berth.json, or the shim's checkpoint/berth.json in a kubelet archive (readArchive).
func readArchiveManifest(p string) (*checkpoint.Manifest, error) {
	a, err := readArchive(p)
	if err != nil {
		return nil, err
	}
	return a.Manifest, nil
}
