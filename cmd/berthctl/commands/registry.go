package commands

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/registry"
)

// registryFlags are the flags push and pull share: how to reach and authenticate to a registry.
type registryFlags struct {
	plainHTTP, insecure, passwordStdin bool
	username, config                   string
	concurrency                        int
}

func (f *registryFlags) add(fs *pflag.FlagSet) {
	fs.BoolVar(&f.plainHTTP, "plain-http", false, "talk HTTP instead of HTTPS (a registry on loopback)")
	fs.BoolVar(&f.insecure, "insecure", false, "accept any TLS certificate from the registry")
	fs.StringVarP(&f.username, "username", "u", "", "registry user name (the password is read from stdin: --password-stdin)")
	fs.BoolVar(&f.passwordStdin, "password-stdin", false, "read the registry password from stdin")
	fs.StringVar(&f.config, "registry-config", "", "Docker config.json with registry credentials (default $DOCKER_CONFIG/config.json or ~/.docker/config.json, if present)")
	fs.IntVar(&f.concurrency, "concurrency", registry.DefaultConcurrency, "files transferred at once")
}

// options turns the flags into registry.Options, reading the password from stdin if asked.
func (f *registryFlags) options(stdin io.Reader) (registry.Options, error) {
	o := registry.Options{PlainHTTP: f.plainHTTP, InsecureSkipVerify: f.insecure, Concurrency: f.concurrency}
	switch {
	case f.passwordStdin && f.username == "":
		return o, errors.New("--password-stdin needs --username")
	case f.username != "" && !f.passwordStdin:
		return o, errors.New("--username needs --password-stdin (a password is never taken from the command line)")
	case f.username != "":
		data, err := io.ReadAll(io.LimitReader(stdin, 64<<10))
		if err != nil {
			return o, fmt.Errorf("read password from stdin: %w", err)
		}
		o.Username, o.Password = f.username, string(bytes.TrimRight(data, "\r\n"))
		if o.Password == "" {
			return o, errors.New("--password-stdin: empty password on stdin")
		}
	default:
		o.DockerConfig = f.config
		if o.DockerConfig == "" {
			o.DockerConfig = defaultDockerConfig()
		}
	}
	return o, nil
}

// defaultDockerConfig returns Docker's config.json if there is one, else "".
func defaultDockerConfig() string {
	dir := os.Getenv("DOCKER_CONFIG")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return ""
		}
		dir = filepath.Join(home, ".docker")
	}
	p := filepath.Join(dir, "config.json")
	if _, err := os.Stat(p); err != nil {
		return ""
	}
	return p
}

// bytesBar returns a registry.Progress drawing a progress bar in bytes on stderr, and a function
// that ends it: filled when the transfer succeeded, left where it stopped when it failed.
func bytesBar(description string) (registry.Progress, func(ok bool)) {
	var bar *progressbar.ProgressBar
	progress := func(done, total int64) {
		if bar == nil {
			bar = progressbar.NewOptions64(total, progressbar.OptionSetDescription(description),
				progressbar.OptionShowBytes(true), progressbar.OptionSetWriter(os.Stderr),
				progressbar.OptionThrottle(200*time.Millisecond), progressbar.OptionShowCount(),
				progressbar.OptionOnCompletion(func() { fmt.Fprintln(os.Stderr) }))
		}
		_ = bar.Set64(done)
	}
	finish := func(ok bool) {
		switch {
		case bar == nil:
		case ok:
			_ = bar.Finish()
		default:
			_ = bar.Exit()
			fmt.Fprintln(os.Stderr)
		}
	}
	return progress, finish
}

// pushResult is what `checkpoint push -o json` prints.
type pushResult struct {
	// Source is the pushed directory or archive; Reference the reference pushed to, Digest the
	// manifest's digest (pull REPOSITORY@DIGEST to get exactly these bytes).
	Source    string `json:"source"`
	Reference string `json:"reference"`
	Digest    string `json:"digest"`
	// Ms is the push's wall time in milliseconds.
	Ms float64 `json:"ms"`
}

// CheckpointPush is `berthctl checkpoint push`.
func CheckpointPush() *cobra.Command {
	var (
		rf     registryFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "push [-o text|json] FILE|DIR REF",
		Short: "Push a checkpoint (directory or archive) to an OCI registry as an artifact",
		Long: `push verifies the checkpoint against its berth.json, then uploads it to REF
(HOST[:PORT]/REPOSITORY:TAG) as an OCI artifact: berth.json as the config, one layer per file.
Files the registry already has are skipped, so pushing again after a failure sends only what is
missing. It prints the pushed reference with its digest (-o json: as JSON); pull that to get
exactly these bytes.

A CRI checkpoint archive (kubelet checkpoint API, crictl checkpoint --export) is signed on the way:
its CRIU images are verified against the shim's checkpoint/berth.json, and a top-level berth.json
covering every file is written, so a pull verifies the whole checkpoint. A restore pod names the
pushed checkpoint as berth.dev/restore-from: oci://REF (the node's shim config must list the
registry in allowed_registries).

Credentials: --username with the password on stdin (--password-stdin), or a Docker config.json.`,
		Example: `  berthctl checkpoint push /var/lib/berth/checkpoints/infer-1 127.0.0.1:5000/ckpt/infer:1 --plain-http
  echo "$PASSWORD" | berthctl checkpoint push ckpt.tar registry.example:5000/ckpt/infer:1 -u berth --password-stdin`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, ref := args[0], args[1]
			opts, err := rf.options(cmd.InOrStdin())
			if err != nil {
				return fmt.Errorf("push %s to %s: %w", src, ref, err)
			}
			progress, finish := bytesBar("pushing " + filepath.Base(filepath.Clean(src)))
			opts.Progress = progress
			start := time.Now()
			desc, err := registry.Push(cmd.Context(), src, ref, opts)
			finish(err == nil)
			if err != nil {
				return err
			}
			wall := time.Since(start)
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), pushResult{Source: src, Reference: ref, Digest: desc.Digest.String(), Ms: millis(wall)})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pushed %s to %s@%s (%.1f s)\n", src, ref, desc.Digest, wall.Seconds())
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	rf.add(cmd.Flags())
	return cmd
}

// pullResult is what `checkpoint pull -o json` prints.
type pullResult struct {
	// Reference is what was pulled, Dir where to.
	Reference string `json:"reference"`
	Dir       string `json:"dir"`
	// Files and Bytes count the checkpoint's files and their bytes (berth.json aside), every one
	// verified against berth.json.
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
	// Ms is the pull's wall time in milliseconds, verification included.
	Ms float64 `json:"ms"`
}

// CheckpointPull is `berthctl checkpoint pull`.
func CheckpointPull() *cobra.Command {
	var (
		rf  registryFlags
		lim = struct {
			total, file int64
			files       int
		}{}
		output *format
	)
	cmd := &cobra.Command{
		Use:   "pull [-o text|json] REF DIR",
		Short: "Pull a checkpoint from an OCI registry into a new directory, verifying every digest",
		Long: `pull downloads the checkpoint artifact REF (HOST[:PORT]/REPOSITORY:TAG or ...@sha256:...)
into DIR, which must not exist. The artifact is checked before DIR is created (media types, file
names, limits, layers against berth.json), every file's digest while it streams, and the result
against berth.json at the end. On any failure DIR is removed: nothing half-pulled is left.`,
		Example: `  berthctl checkpoint pull 127.0.0.1:5000/ckpt/infer:1 /var/lib/berth/checkpoints/infer-1 --plain-http`,
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, dir := args[0], args[1]
			opts, err := rf.options(cmd.InOrStdin())
			if err != nil {
				return fmt.Errorf("pull %s into %s: %w", ref, dir, err)
			}
			opts.Limits.MaxTotalBytes, opts.Limits.MaxFileBytes, opts.Limits.MaxEntries = lim.total, lim.file, lim.files
			progress, finish := bytesBar("pulling " + ref)
			opts.Progress = progress
			start := time.Now()
			err = registry.Pull(cmd.Context(), ref, dir, opts)
			finish(err == nil)
			if err != nil {
				return err
			}
			m, err := checkpoint.ReadManifest(dir)
			if err != nil {
				return err
			}
			wall := time.Since(start)
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), pullResult{Reference: ref, Dir: dir, Files: len(m.Files), Bytes: m.ImageSize, Ms: millis(wall)})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pulled %s into %s (%d files, %s, verified; %.1f s)\n",
				ref, dir, len(m.Files), humanBytes(m.ImageSize), wall.Seconds())
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	rf.add(cmd.Flags())
	f := cmd.Flags()
	f.Int64Var(&lim.total, "max-bytes", 0, "refuse a checkpoint whose files add up to more bytes (0: 1 TiB)")
	f.Int64Var(&lim.file, "max-file-bytes", 0, "refuse a checkpoint with a larger file, in bytes (0: 256 GiB)")
	f.IntVar(&lim.files, "max-files", 0, "refuse a checkpoint with more files (0: 131072)")
	return cmd
}
