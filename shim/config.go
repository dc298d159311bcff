package shim

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
)

// EnvConfig names the environment variable that points the shim at its configuration file. The
// shim inherits containerd's environment, so setting it for containerd sets it for the shim.
const EnvConfig = "BERTH_SHIM_CONFIG"

// DefaultConfigPath is read when EnvConfig is unset. A missing file means DefaultConfig.
const DefaultConfigPath = "/etc/berth/shim.toml"

// Config is the shim's configuration (TOML).
type Config struct {
	// Path is the file this configuration was read from (set by LoadConfig, named in errors that
	// point at a key); not a key itself.
	Path string `toml:"-"`
	// CheckpointRoot is the only directory restore-from references may point into (absolute).
	// Default /var/lib/berth/checkpoints.
	CheckpointRoot string `toml:"checkpoint_root"`
	// PageStreamDir is where the node's agent arms copy-mode page streams for checkpoints the
	// kubelet asks for (checkpoint.PageStreamRequest, pagearm.go); absolute. Default
	// /run/berth/page-streams ("" means the default).
	PageStreamDir string `toml:"page_stream_dir"`
	// CRIUPath is the CRIU binary used for version probes; "" means "criu" from PATH. runc finds
	// its own CRIU in PATH.
	CRIUPath string `toml:"criu_path"`
	// CRIUOptions are written, one per line, into the per-container CRIU configuration file that
	// runc hands to CRIU on dump and restore. Default ["tcp-close"]: established TCP connections are
	// not dumped and come back closed; listening sockets are kept.
	CRIUOptions []string `toml:"criu_options"`
	// MaxArchiveBytes bounds a restore-from archive's extracted size, in bytes. Default 64 GiB.
	MaxArchiveBytes int64 `toml:"max_archive_bytes"`
	// MaxRootfsDiffBytes bounds what a checkpoint's rootfs diff may write into the restored
	// container's root filesystem: the sum of its regular files' sizes once decompressed, in
	// bytes. Default 512 MiB: a container that writes more into its root filesystem than that
	// keeps it on a volume, not in the checkpoint. Its entries are bounded like an archive's
	// (MaxArchiveEntries).
	MaxRootfsDiffBytes int64 `toml:"max_rootfs_diff_bytes"`
	// GPU selects the GPU backend: "none" (default), "cuda" (libcuda.so.1's checkpoint API, and
	// NVML read by berth-shim-helper), or "fake" (gpu/fake, for machines without a GPU; FakeGPURoot is its node directory).
	GPU         string `toml:"gpu"`
	FakeGPURoot string `toml:"fake_gpu_root"`
	// NamespaceMappings allow restoring a checkpoint taken in one Kubernetes namespace into
	// another, as "source:destination" entries; ":destination" allows checkpoints of containers
	// outside Kubernetes into pods of destination. Default none: same namespace only, and no
	// checkpoint from outside Kubernetes into any pod.
	NamespaceMappings []string `toml:"namespace_mappings"`
	// GPULockTimeoutMs bounds the CUDA lock of each process at checkpoint, in ms. Default 10000.
	GPULockTimeoutMs int `toml:"gpu_lock_timeout_ms"`
	// GPURestoreTimeoutMs bounds the CUDA restore of each process at restore (its device memory
	// copied back onto the GPU), in ms, for a checkpoint with no device memory recorded; each GiB
	// the checkpoint records on its GPUs adds a second (GPURestoreBound: an H200's 141 GB adds
	// about 2.2 minutes, at a copy rate far below PCIe's). The driver can hang a restore onto a
	// GPU without enough free memory; past the bound the shim kills the task and answers with an
	// error naming the process and GPUs (the checkpoint is left intact). Default 120000.
	GPURestoreTimeoutMs int `toml:"gpu_restore_timeout_ms"`
	// AllowedRegistries are the registries ("host[:port]", exactly as in the reference) that
	// berth.dev/restore-from may name with oci://. Default none: registry references are refused.
	AllowedRegistries []string `toml:"allowed_registries"`
	// RegistryPlainHTTP lists registries of AllowedRegistries talked to over plain HTTP (a
	// registry on loopback); the others over HTTPS.
	RegistryPlainHTTP []string `toml:"registry_plain_http"`
	// RegistryConfig is a Docker config.json (absolute path) with credentials for the registries;
	// "" pulls anonymously.
	RegistryConfig string `toml:"registry_config"`
	// TrustConfig is the trust policy (keys signing_key, trusted_keys, allow_unsigned): the key
	// this node signs its checkpoints with, the public keys whose checkpoints it restores
	// (optionally per Kubernetes namespace), and the opt-out for single-node labs. Default:
	// signature.DefaultSigningKey, generated on first use (the node trusts its own key, so its
	// own checkpoints restore on it with no configuration), no other trusted key, unsigned
	// checkpoints refused.
	signature.TrustConfig
}

// MaxArchiveEntries bounds the number of entries of a restore-from archive and of a rootfs diff.
const MaxArchiveEntries = 1 << 16

// RegistryAllowed reports whether host ("host[:port]") is in AllowedRegistries (host names
// compare case-insensitively).
func (c Config) RegistryAllowed(host string) bool { return hostIn(c.AllowedRegistries, host) }

// RegistryPlain reports whether host is in RegistryPlainHTTP.
func (c Config) RegistryPlain(host string) bool { return hostIn(c.RegistryPlainHTTP, host) }

func hostIn(list []string, host string) bool {
	for _, h := range list {
		if host != "" && strings.EqualFold(h, host) {
			return true
		}
	}
	return false
}

// validRegistryHost reports whether h looks like "host[:port]": no scheme, path, space or
// control character.
func validRegistryHost(h string) bool {
	if h == "" || strings.ContainsAny(h, "/@") {
		return false
	}
	for _, c := range h {
		if c <= ' ' || c == 0x7f {
			return false
		}
	}
	return true
}

// GPULockTimeout returns GPULockTimeoutMs as a duration.
func (c Config) GPULockTimeout() time.Duration {
	return time.Duration(c.GPULockTimeoutMs) * time.Millisecond
}

// GPURestoreTimeout returns GPURestoreTimeoutMs as a duration.
func (c Config) GPURestoreTimeout() time.Duration {
	return time.Duration(c.GPURestoreTimeoutMs) * time.Millisecond
}

// GPURestoreBound returns the bound of one process's CUDA restore for a checkpoint that records
// deviceBytes of device memory on its GPUs: GPURestoreTimeout plus a second per GiB.
func (c Config) GPURestoreBound(deviceBytes uint64) time.Duration {
	return c.GPURestoreTimeout() + time.Duration(deviceBytes>>30)*time.Second
}

// DefaultConfig returns the configuration used when no file exists.
func DefaultConfig() Config {
	return Config{
		CheckpointRoot:      checkpoint.DefaultRoot,
		PageStreamDir:       checkpoint.DefaultPageStreamDir,
		CRIUOptions:         []string{"tcp-close"},
		MaxArchiveBytes:     64 << 30,
		MaxRootfsDiffBytes:  512 << 20,
		GPU:                 "none",
		GPULockTimeoutMs:    10000,
		GPURestoreTimeoutMs: 120000,
		TrustConfig:         signature.TrustConfig{SigningKey: signature.DefaultSigningKey},
	}
}

// LoadConfig reads the TOML file at path over DefaultConfig. A missing file is not an error.
// It returns an error naming the file for unreadable or malformed files and for invalid values.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
	cfg.Path = path
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return cfg, cfg.Validate()
	}
	if err != nil {
		return cfg, fmt.Errorf("read shim config: %w", err)
	}
	dec := toml.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		var strict *toml.StrictMissingError
		if errors.As(err, &strict) {
			return cfg, fmt.Errorf("parse shim config %s: unknown keys:\n%s: %w", path, strict.String(), err)
		}
		return cfg, fmt.Errorf("parse shim config %s: %w", path, err)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("shim config %s: %w", path, err)
	}
	return cfg, nil
}

// ConfigPath returns the configuration file named by the environment: $BERTH_SHIM_CONFIG, or
// DefaultConfigPath when it is unset. Only main calls it; everything else gets the path passed in.
func ConfigPath() string {
	if p := os.Getenv(EnvConfig); p != "" {
		return p
	}
	return DefaultConfigPath
}

// Validate checks the configuration's values and returns an error naming the field and value.
func (c Config) Validate() error {
	if c.PageStreamDir != "" && !filepath.IsAbs(c.PageStreamDir) {
		return fmt.Errorf("page_stream_dir %q: must be an absolute path", c.PageStreamDir)
	}
	if !filepath.IsAbs(c.CheckpointRoot) {
		return fmt.Errorf("checkpoint_root %q: must be an absolute path", c.CheckpointRoot)
	}
	if err := backend.Check(c.GPU, c.FakeGPURoot, "gpu", "fake_gpu_root"); err != nil {
		return err
	}
	if c.GPULockTimeoutMs <= 0 {
		return fmt.Errorf("gpu_lock_timeout_ms %d: must be positive", c.GPULockTimeoutMs)
	}
	if c.GPURestoreTimeoutMs <= 0 {
		return fmt.Errorf("gpu_restore_timeout_ms %d: must be positive", c.GPURestoreTimeoutMs)
	}
	for _, h := range c.AllowedRegistries {
		if !validRegistryHost(h) {
			return fmt.Errorf("allowed_registries: %q: want host[:port], without scheme or path", h)
		}
	}
	for _, h := range c.RegistryPlainHTTP {
		if !validRegistryHost(h) {
			return fmt.Errorf("registry_plain_http: %q: want host[:port], without scheme or path", h)
		}
		if !c.RegistryAllowed(h) {
			return fmt.Errorf("registry_plain_http: %q is not in allowed_registries", h)
		}
	}
	if c.RegistryConfig != "" && !filepath.IsAbs(c.RegistryConfig) {
		return fmt.Errorf("registry_config %q: must be an absolute path", c.RegistryConfig)
	}
	if c.MaxArchiveBytes <= 0 {
		return fmt.Errorf("max_archive_bytes %d: must be positive", c.MaxArchiveBytes)
	}
	if c.MaxRootfsDiffBytes <= 0 {
		return fmt.Errorf("max_rootfs_diff_bytes %d: must be positive", c.MaxRootfsDiffBytes)
	}
	if err := c.TrustConfig.Validate(); err != nil {
		return err
	}
	for i, k := range c.TrustedKeys {
		for _, ns := range k.Namespaces {
			if ns == "" {
				return fmt.Errorf("trusted_keys[%d].namespaces: an empty name (leave the list out to trust the key for every namespace)", i)
			}
		}
	}
	return nil
}
