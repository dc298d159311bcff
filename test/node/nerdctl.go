package node

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// NerdctlPath is the stack's nerdctl (test/stack/install.sh builds it from its module), or ""
// when this stack has none.
func (n *Node) NerdctlPath() string {
	p := n.stack.Tool("nerdctl")
	if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
		return ""
	}
	return p
}

// Nerdctl runs the stack's nerdctl against this node in namespace ns, with its data root (its
// checkpoints, hosts files and container state) under the node's directory, and returns its
// standard output (trimmed); the error carries its standard error.
func (n *Node) Nerdctl(ctx context.Context, ns string, args ...string) (string, error) {
	global := []string{"--address", n.Socket, "--namespace", ns, "--data-root", filepath.Join(n.Dir, "nerdctl")}
	cmd := exec.CommandContext(ctx, n.stack.Tool("nerdctl"), append(global, args...)...)
	cmd.Env = n.Env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("nerdctl %s on %s: %w: %s", strings.Join(args, " "), n.Name, err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}
