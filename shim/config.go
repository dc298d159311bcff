package shim

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/pelletier/go-toml/v2"
)

// EnvConfig names the environment variable that points the shim at its configuration file. The
// shim inherits containerd's environment, so setting it for containerd sets it for the shim.
const EnvConfig = "BERTH_SHIM_CONFIG"

// DefaultConfigPath is read when EnvConfig is unset. A missing file means DefaultConfig.
const DefaultConfigPath = "/etc/berth/shim.toml"

// Config is the shim's configuration (TOML).
type Config struct {
	// CheckpointRoot is the only directory restore-from references may point into (absolute).
	// Default /var/lib/berth/checkpoints.
	CheckpointRoot string `toml:"checkpoint_root"`
	// CRIUPath is the CRIU binary used for version probes; "" means "criu" from PATH. runc finds
	// its own CRIU in PATH.
	CRIUPath string `toml:"criu_path"`
	// CRIUOptions are written, one per line, into the per-container CRIU configuration file that
	// runc hands to CRIU on dump and restore. Default ["tcp-close"]: established TCP connections are
	// not dumped and come back closed; listening sockets are kept.
	CRIUOptions []string `toml:"criu_options"`
	// MaxArchiveBytes bounds a restore-from archive's extracted size, in bytes. Default 64 GiB.
	MaxArchiveBytes int64 `toml:"max_archive_bytes"`
}

// DefaultConfig returns the configuration used when no file exists.
func DefaultConfig() Config {
	return Config{
		CheckpointRoot:  "/var/lib/berth/checkpoints",
		CRIUOptions:     []string{"tcp-close"},
		MaxArchiveBytes: 64 << 30,
	}
}

// LoadConfig reads the TOML file at path over DefaultConfig. A missing file is not an error.
// It returns an error naming the file for unreadable or malformed files and for invalid values.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
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

// ConfigPath returns the configuration file this process should read: $BERTH_SHIM_CONFIG or
// DefaultConfigPath.
func ConfigPath() string {
	if p := os.Getenv(EnvConfig); p != "" {
		return p
	}
	return DefaultConfigPath
}

// Validate checks the configuration's values and returns an error naming the field and value.
func (c Config) Validate() error {
	if !filepath.IsAbs(c.CheckpointRoot) {
		return fmt.Errorf("checkpoint_root %q: must be an absolute path", c.CheckpointRoot)
	}
	if c.MaxArchiveBytes <= 0 {
		return fmt.Errorf("max_archive_bytes %d: must be positive", c.MaxArchiveBytes)
	}
	return nil
}
