package node

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// EnvStack overrides where the stack is found (a directory with bin/ and cni/bin/).
const EnvStack = "BERTH_STACK"

// Stack is an installed set of the real tools: containerd, ctr, runc, CRIU, crictl, CNI plugins.
type Stack struct {
	// Dir is the stack prefix; Bin = Dir/bin and CNIBin = Dir/cni/bin.
	Dir, Bin, CNIBin string
}

// ErrNoStack is returned by FindStack when the stack is not installed.
var ErrNoStack = errors.New("stack not installed (run `make deps`)")

// FindStack returns the stack at $BERTH_STACK, else at <repo>/_output/stack (linked by
// test/stack/install.sh). It returns ErrNoStack naming the missing tool when one is absent.
func FindStack() (Stack, error) {
	dir := os.Getenv(EnvStack)
	if dir == "" {
		dir = filepath.Join(RepoRoot(), "_output", "stack")
	}
	s := Stack{Dir: dir, Bin: filepath.Join(dir, "bin"), CNIBin: filepath.Join(dir, "cni", "bin")}
	for _, tool := range []string{"containerd", "ctr", "runc", "criu", "crictl", "containerd-shim-runc-v2"} {
		if _, err := os.Stat(filepath.Join(s.Bin, tool)); err != nil {
			return s, fmt.Errorf("%s missing in %s: %w", tool, s.Bin, ErrNoStack)
		}
	}
	return s, nil
}

// Tool returns the path of a stack binary (bin/NAME).
func (s Stack) Tool(name string) string { return filepath.Join(s.Bin, name) }

// RepoRoot returns the berth repository root (the directory holding go.mod), found from this
// source file's location or, for a built binary, the working directory upwards.
func RepoRoot() string {
	if _, file, _, ok := runtime.Caller(0); ok {
		root := filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
		if _, err := os.Stat(filepath.Join(root, "go.mod")); err == nil {
			return root
		}
	}
	dir, _ := os.Getwd()
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			return d
		}
	}
	return dir
}

// BuildBerth builds containerd-shim-berth-v2, berth-shim-helper (which the shim runs beside
// itself to pull from registries) and berthctl into dir with `go build`, returning dir.
// Callers put dir first in a node's PATH so containerd finds the shim.
func BuildBerth(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for _, pkg := range []string{"./cmd/containerd-shim-berth-v2", "./cmd/berth-shim-helper", "./cmd/berthctl"} {
		cmd := exec.Command("go", "build", "-o", dir+"/", pkg)
		cmd.Dir = RepoRoot()
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build %s: %w: %s", pkg, err, out)
		}
	}
	return dir, nil
}
