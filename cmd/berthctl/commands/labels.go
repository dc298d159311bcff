package commands

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// Labels is `berthctl labels`.
func Labels() *cobra.Command {
	var (
		nf       nodeFlags
		file     string
		interval time.Duration
	)
	cmd := &cobra.Command{
		Use:   "labels [--file FILE] [--interval DURATION] [--gpu none|cuda|fake]",
		Short: "Write this node's fingerprint as a Node Feature Discovery feature file (berth.dev/* labels)",
		Long: `labels collects this node's fingerprint (as 'berthctl fingerprint' does) and writes it as a Node
Feature Discovery local feature file: one berth.dev/NAME=VALUE line per label, short label-safe
values plus berth.dev/fingerprint, a hash of the fields that must be equal (package oci/fingerprint
documents which labels are exact-match and which are informational). NFD's worker reads the file
from /etc/kubernetes/node-feature-discovery/features.d/ and labels the node with it.

Without --file the feature file goes to stdout. With --file it is replaced atomically (a hidden
temporary file in the same directory, which NFD skips, renamed over FILE) and only when its
content changed. With --interval it is rewritten every DURATION until the process is stopped; a
failed round is reported on stderr and the previous file is kept.

The kernel, architecture and CPU vendor must be readable, and with --gpu cuda|fake the GPU
inventory too; a CRIU, runc or containerd version that cannot be read is reported on stderr and
its label left out (selectors that need it then do not match this node).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if interval < 0 {
				return fmt.Errorf("--interval %s: must not be negative", interval)
			}
			if interval > 0 && file == "" {
				return errors.New("--interval needs --file")
			}
			n, err := nf.open()
			if err != nil {
				return err
			}
			round := func(ctx context.Context) error {
				fp, err := nodeFingerprint(ctx, n, cmd.ErrOrStderr())
				if err != nil {
					return err
				}
				data := fingerprint.NFDFeatureFile(fp)
				if file == "" {
					_, err := cmd.OutOrStdout().Write(data)
					return err
				}
				if err := writeFileAtomic(file, data, 0o644); err != nil {
					return fmt.Errorf("--file: %w", err)
				}
				return nil
			}
			if interval == 0 {
				return round(cmd.Context())
			}
			ctx := cmd.Context()
			tick := time.NewTicker(interval)
			defer tick.Stop()
			for {
				if err := round(ctx); err != nil {
					if ctx.Err() != nil {
						return nil
					}
					fmt.Fprintln(cmd.ErrOrStderr(), "berthctl labels:", err)
				}
				select {
				case <-ctx.Done():
					return nil
				case <-tick.C:
				}
			}
		},
	}
	f := cmd.Flags()
	f.StringVar(&file, "file", "", "feature file to write, e.g. /etc/kubernetes/node-feature-discovery/features.d/berth (default: stdout)")
	deprecatedAlias(f, &file, "output", "file")
	f.DurationVar(&interval, "interval", 0, "rewrite the file every DURATION until stopped (0: once)")
	nf.add(f)
	return cmd
}

// nodeFingerprint collects this node's fingerprint for labels. The fields that the hash label
// covers must be known (kernel, arch, CPU vendor and, with a GPU backend, the GPUs); version
// probes that fail are reported on warn and leave their field empty, which leaves its label out.
func nodeFingerprint(ctx context.Context, n *host, warn io.Writer) (fingerprint.Fingerprint, error) {
	fp, err := n.fingerprint(ctx)
	if ctx.Err() != nil {
		return fp, ctx.Err()
	}
	// n.fingerprint skips the GPU inventory when any other source failed; ask it directly then.
	if err != nil && n.gpu != nil && fp.GPUs == nil {
		gpus, gerr := backend.FingerprintGPUs(n.gpu.Inventory())
		if gerr != nil {
			return fp, fmt.Errorf("collect fingerprint: %w", errors.Join(err, gerr))
		}
		fp.GPUs = gpus
	}
	var missing string
	switch {
	case fp.Kernel == "", fp.Arch == "", fp.CPU.Vendor == "":
		missing = "kernel, arch or CPU vendor unknown"
	case n.gpu != nil && len(fp.GPUs) == 0:
		missing = "the GPU backend reports no GPUs"
	}
	if missing != "" {
		if err != nil {
			return fp, fmt.Errorf("collect fingerprint: %s: %w", missing, err)
		}
		return fp, fmt.Errorf("collect fingerprint: %s", missing)
	}
	if err != nil {
		fmt.Fprintf(warn, "berthctl labels: warning: labels of unreadable fields left out: %v\n", err)
	}
	return fp, nil
}

// writeFileAtomic replaces path with data: a hidden temporary file in the same directory (Node
// Feature Discovery skips names that begin with a dot) is written, synced and renamed over path,
// and the directory synced, so a reader sees the old file or the new one. A file whose content
// already equals data is left alone.
func writeFileAtomic(path string, data []byte, mode os.FileMode) (retErr error) {
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
		return nil
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if retErr != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(mode); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("write %s: sync directory: %w", path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("write %s: sync directory: %w", path, err)
	}
	return nil
}
