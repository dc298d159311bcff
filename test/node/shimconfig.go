package node

import (
	"fmt"
	"os"
	"path/filepath"
)

// ShimConfig returns the path of the node's berth shim configuration (shim.toml). Every shim
// containerd starts reads it once at start, so a change applies to pods and containers created
// after it.
func (n *Node) ShimConfig() string { return filepath.Join(n.Dir, "shim.toml") }

// AppendShimConfig appends TOML keys to the node's shim.toml (for example allowed_registries for
// a test registry whose port is known only once it runs) and returns a function that puts the
// previous file back.
func (n *Node) AppendShimConfig(extra string) (restore func() error, err error) {
	p := n.ShimConfig()
	old, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("shim config of %s: %w", n.Name, err)
	}
	body := append(append([]byte{}, old...), '\n')
	body = append(body, extra...)
	if err := os.WriteFile(p, body, 0o644); err != nil {
		return nil, fmt.Errorf("shim config of %s: %w", n.Name, err)
	}
	return func() error { return os.WriteFile(p, old, 0o644) }, nil
}
