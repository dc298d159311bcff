package keys

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"github.com/pelletier/go-toml/v2"
)

// BerthctlConfig returns the configuration file berthctl runs of the tests and the demo read
// (as $BERTH_SHIM_CONFIG): shimConfig itself, a node's shim.toml, when it names a signing_key
// (the nodes sign and trust each other's checkpoints); otherwise dir/berthctl.toml, written with
// shimConfig's checkpoint_root and a new signing key (dir/berthctl.key), whose own public key
// berthctl then trusts. Either way every checkpoint berthctl writes is signed and every one it
// receives or pulls is verified.
func BerthctlConfig(dir, shimConfig string) (string, error) {
	b, err := os.ReadFile(shimConfig)
	if err != nil {
		return "", err
	}
	var c struct {
		CheckpointRoot string `toml:"checkpoint_root"`
		SigningKey     string `toml:"signing_key"`
		Trust          struct {
			SigningKey string `toml:"signing_key"`
		} `toml:"trust"`
	}
	if err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c); err != nil {
		return "", fmt.Errorf("%s: %w", shimConfig, err)
	}
	if c.SigningKey != "" || c.Trust.SigningKey != "" {
		return shimConfig, nil
	}
	priv, _, err := SigningKey(dir, "berthctl")
	if err != nil {
		return "", err
	}
	p := filepath.Join(dir, "berthctl.toml")
	body := fmt.Sprintf("# berthctl's trust for the tests: the nodes' shim configuration names no signing key\nsigning_key = %q\n", priv)
	if c.CheckpointRoot != "" {
		body += fmt.Sprintf("checkpoint_root = %q\n", c.CheckpointRoot)
	}
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		return "", err
	}
	return p, nil
}
