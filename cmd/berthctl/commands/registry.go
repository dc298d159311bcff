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

// CheckpointPush is `berthctl checkpoint push`, signing with the key of g's --config.
func CheckpointPush(g *Globals) *cobra.Command {
	var (
		rf     registryFlags
		trust  *trustFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "push [-o text|json] FILE|DIR REF",
		Short: "Push a checkpoint (directory or archive) to an OCI registry as an artifact",
		Long: `push verifies the checkpoint against its berth.json and its signature (berth.sig) against the
keys this node trusts, then uploads it to REF (HOST[:PORT]/REPOSITORY:TAG) as an OCI artifact:
berth.json as the config, one layer per file, berth.sig as the last layer. Files the registry
already has are skipped, so pushing again after a failure sends only what is missing. Once the
tag is written, the artifact's manifest is signed with this node's key (signing_key of --config,
or --signing-key) the way cosign signs images (tag sha256-<digest>.sig), so that
'cosign verify --key node.pub REF' verifies it. It prints the pushed reference with its digest
(-o json: as JSON); pull that to get exactly these bytes.

A CRI checkpoint archive (kubelet checkpoint API, crictl checkpoint --export) is signed on the way:
its CRIU images are verified against the shim's checkpoint/berth.json, and a top-level berth.json
covering every file (spec.dump, config.dump and rootfs-diff.tar included) is written and signed
with this node's key, so a pull verifies the whole checkpoint. A restore pod names the pushed
checkpoint as berth.dev/restore-from: oci://REF (the node's shim config must list the registry
in allowed_registries).

Credentials: --username with the password on stdin (--password-stdin), or a Docker config.json.`,
		Example: `  berthctl checkpoint push /var/lib/berth/checkpoints/infer-1 127.0.0.1:5000/ckpt/infer:1 --plain-http
  echo "$PASSWORD" | berthctl checkpoint push ckpt.tar registry.example:5000/ckpt/infer:1 -u berth --password-stdin`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, ref := args[0], args[1]
			opts, err := rf.options(cmd.InOrStdin())
			if err != nil {
				return fmt.Errorf("push %s to %s: %w", src, registry.QuoteRef(ref), err)
			}
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			if err := checkSigner(policy, g, "the pushed checkpoint", cmd.ErrOrStderr()); err != nil {
				return err
			}
			opts.Verify = func(ctx context.Context, dir string) error {
				_, err := verifyCheckpoint(ctx, policy, dir, cmd.ErrOrStderr())
				return err
			}
			opts.SignCRI = func(ctx context.Context, dir string) error {
				_, err := policy.Sign(ctx, dir)
				return err
			}
			if policy.Signer != nil {
				opts.Signer = policy.Signer.Signer()
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
	trust = addTrustFlags(cmd.Flags(), true, true)
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
	// SignedBy is the id of the key whose signature of berth.json was verified ("" when the
	// checkpoint was accepted unsigned, under allow_unsigned).
	SignedBy string `json:"signedBy,omitempty"`
	// Ms is the pull's wall time in milliseconds, verification included.
	Ms float64 `json:"ms"`
}

// CheckpointPull is `berthctl checkpoint pull`, admitting what the trust policy of g's --config
// admits.
func CheckpointPull(g *Globals) *cobra.Command {
	var (
		trust *trustFlags
		rf    registryFlags
		lim   = struct {
			total, file int64
			files       int
		}{}
		output *format
	)
	cmd := &cobra.Command{
		Use:   "pull [-o text|json] REF DIR",
		Short: "Pull a checkpoint from an OCI registry into a new directory, verifying its signature and every digest",
		Long: `pull downloads the checkpoint artifact REF (HOST[:PORT]/REPOSITORY:TAG or ...@sha256:...)
into DIR, which must not exist. The artifact is checked before anything is written (media types,
file names, limits, layers against berth.json); berth.sig must be the signature of berth.json by
a key this node trusts (signing_key and trusted_keys of --config, --trusted-key) before any file
is fetched; every file's digest is checked while it streams, and the result against berth.json
at the end. It is pulled into a staging directory beside DIR and renamed to DIR only then: on any
failure nothing is left, and nothing unverified is ever at DIR.`,
		Example: `  berthctl checkpoint pull 127.0.0.1:5000/ckpt/infer:1 /var/lib/berth/checkpoints/infer-1 --plain-http`,
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, dir := args[0], args[1]
			opts, err := rf.options(cmd.InOrStdin())
			if err != nil {
				return fmt.Errorf("pull %s into %s: %w", registry.QuoteRef(ref), dir, err)
			}
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			var signedBy string
			opts.Verify = func(ctx context.Context, dir string) (err error) {
				signedBy, err = verifyCheckpoint(ctx, policy, dir, cmd.ErrOrStderr())
				return err
			}
			opts.Limits.MaxTotalBytes, opts.Limits.MaxFileBytes, opts.Limits.MaxEntries = lim.total, lim.file, lim.files
			progress, finish := bytesBar("pulling " + registry.RedactRef(ref))
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
				return writeJSON(cmd.OutOrStdout(), pullResult{Reference: ref, Dir: dir, Files: len(m.Files), Bytes: m.ImageSize, SignedBy: signedBy, Ms: millis(wall)})
			}
			signed := "unsigned, allowed by allow_unsigned"
			if signedBy != "" {
				signed = "signed by " + signedBy
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pulled %s into %s (%d files, %s, verified, %s; %.1f s)\n",
				ref, dir, len(m.Files), humanBytes(m.ImageSize), signed, wall.Seconds())
			return nil
		},
	}
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	rf.add(cmd.Flags())
	f := cmd.Flags()
	f.Int64Var(&lim.total, "max-bytes", 0, "refuse a checkpoint whose files add up to more bytes (0: 1 TiB)")
	f.Int64Var(&lim.file, "max-file-bytes", 0, "refuse a checkpoint with a larger file, in bytes (0: 256 GiB)")
	f.IntVar(&lim.files, "max-files", 0, "refuse a checkpoint with more files (0: 131072)")
	trust = addTrustFlags(f, false, true)
	return cmd
}
