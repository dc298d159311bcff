package commands

import (
	"archive/tar"
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// maxSelectorArchiveEntries bounds how many tar headers checkpoint selector reads looking for
// berth.json (berth's own archives have it first; others may not).
const maxSelectorArchiveEntries = 1 << 17

// CheckpointSelector is `berthctl checkpoint selector`.
func CheckpointSelector() *cobra.Command {
	var output *format
	cmd := &cobra.Command{
		Use:   "selector [-o yaml|json] DIR|FILE.tar",
		Short: "Print the nodeSelector a pod restoring this checkpoint needs (berth.dev/* node labels)",
		Long: `selector reads the checkpoint's berth.json (from a checkpoint directory, or from a tar archive
without extracting it) and prints the node selector that matches nodes labelled by 'berthctl labels'
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

// readArchiveManifest reads the top-level berth.json of a checkpoint tar archive. It reads tar
// headers only until it finds berth.json (first in berth's archives); file contents before it
// are skipped by seeking, not read.
func readArchiveManifest(p string) (*checkpoint.Manifest, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("checkpoint archive: %w", err)
	}
	defer f.Close()
	magic := make([]byte, 2)
	if n, _ := io.ReadFull(f, magic); n == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		return nil, fmt.Errorf("checkpoint archive %s: gzip-compressed; decompress it first", p)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
	}
	tr := tar.NewReader(f)
	for i := 0; i < maxSelectorArchiveEntries; i++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("checkpoint archive %s: no top-level %s", p, checkpoint.ManifestFile)
		}
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
		}
		if path.Clean(hdr.Name) != checkpoint.ManifestFile {
			continue
		}
		if hdr.Typeflag != tar.TypeReg {
			return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, hdr.Name, checkpoint.ErrUnsupportedFile)
		}
		if hdr.Size > checkpoint.MaxManifestBytes {
			return nil, fmt.Errorf("checkpoint archive %s: %s: %w: %d bytes, more than %d",
				p, hdr.Name, checkpoint.ErrInvalidManifest, hdr.Size, checkpoint.MaxManifestBytes)
		}
		data, err := io.ReadAll(bufio.NewReader(io.LimitReader(tr, checkpoint.MaxManifestBytes+1)))
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, hdr.Name, err)
		}
		m, err := checkpoint.ParseManifest(data)
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, hdr.Name, err)
		}
		return m, nil
	}
	return nil, fmt.Errorf("checkpoint archive %s: no %s in the first %d entries", p, checkpoint.ManifestFile, maxSelectorArchiveEntries)
}
