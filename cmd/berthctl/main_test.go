package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func env(vars map[string]string) func(string) string {
	return func(k string) string { return vars[k] }
}

// execute runs berthctl with args and the environment vars, returning stdout, stderr and the error.
func execute(t *testing.T, vars map[string]string, args ...string) (string, string, error) {
	t.Helper()
	root := newRoot(env(vars))
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

// TestTree checks where every command is, that the root's help lists each in a group, and which
// ones take -o json.
func TestTree(t *testing.T) {
	root := newRoot(env(nil))
	for _, tc := range []struct {
		path  string
		group string // of a root command
		json  bool   // takes -o json
	}{
		{path: "fingerprint", group: groupNode, json: true},
		{path: "labels", group: groupNode},
		{path: "topology", group: groupNode, json: true},
		{path: "plan", group: groupNode, json: true},
		{path: "checkpoint", group: groupCheckpoints},
		{path: "checkpoint create", json: true},
		{path: "checkpoint inspect", json: true},
		{path: "checkpoint selector", json: true},
		{path: "checkpoint push", json: true},
		{path: "checkpoint pull", json: true},
		{path: "migrate", group: groupMoves, json: true},
		{path: "send", group: groupMoves, json: true},
		{path: "receive", group: groupMoves, json: true},
		{path: "restore", group: groupMoves, json: true},
	} {
		t.Run(tc.path, func(t *testing.T) {
			c, rest, err := root.Find(strings.Fields(tc.path))
			if err != nil || len(rest) != 0 || c.CommandPath() != "berthctl "+tc.path {
				t.Fatalf("find %q: %v, %v, %v", tc.path, c.CommandPath(), rest, err)
			}
			if c.Parent() == root && c.GroupID != tc.group {
				t.Errorf("group %q, want %q", c.GroupID, tc.group)
			}
			o := c.Flags().Lookup("output")
			if tc.json {
				if o == nil || o.Shorthand != "o" || c.Flags().Set("output", "json") != nil {
					t.Errorf("-o json is not accepted")
				}
				if c.Flags().Set("output", "xml") == nil {
					t.Errorf("-o xml is accepted")
				}
			} else if o != nil && !o.Hidden {
				t.Errorf("has -o/--output, want none (a file is --file)")
			}
			for _, g := range []string{"address", "namespace"} {
				if c.InheritedFlags().Lookup(g) == nil && c != root {
					t.Errorf("no global --%s", g)
				}
			}
		})
	}
	// every visible root command is in a group; the former push and pull are hidden
	for _, c := range root.Commands() {
		switch {
		case c.Name() == "push" || c.Name() == "pull":
			if c.Deprecated == "" || c.IsAvailableCommand() {
				t.Errorf("root %s: listed, want hidden and deprecated", c.Name())
			}
		case c.IsAvailableCommand() && c.GroupID == "" && c.Name() != "completion":
			t.Errorf("root %s: in no group", c.Name())
		}
	}
}

// TestSameThingSameName: the new container's id is --id and the checkpoint root is --root
// wherever a command takes them.
func TestSameThingSameName(t *testing.T) {
	root := newRoot(env(nil))
	for path, flags := range map[string][]string{
		"migrate": {"id", "root", "from", "to"},
		"restore": {"id", "root"},
		"receive": {"root"},
	} {
		c, _, err := root.Find(strings.Fields(path))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range flags {
			if c.Flags().Lookup(f) == nil {
				t.Errorf("%s has no --%s", path, f)
			}
		}
	}
}

// TestDeprecatedNames: the former flag names and command places still work and say what to use.
func TestDeprecatedNames(t *testing.T) {
	root := newRoot(env(nil))
	mig, _, _ := root.Find([]string{"migrate"})
	if err := mig.ParseFlags([]string{"--to-root", "/r", "--target-id", "new"}); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"root": "/r", "id": "new"} {
		if got := mig.Flags().Lookup(name).Value.String(); got != want {
			t.Errorf("migrate --%s = %q, want %q", name, got, want)
		}
	}
	for _, name := range []string{"to-root", "target-id"} {
		if f := mig.Flags().Lookup(name); f.Deprecated == "" || !f.Hidden {
			t.Errorf("migrate --%s: not hidden and deprecated", name)
		}
	}
	file := filepath.Join(t.TempDir(), "berth")
	if _, _, err := execute(t, nil, "labels", "--output", file, "--gpu", "none"); err != nil && !strings.Contains(err.Error(), file) {
		t.Fatalf("labels --output %s: %v", file, err)
	}
	if _, err := os.Stat(file); err != nil {
		t.Errorf("labels --output did not write the file: %v", err)
	}
	// cobra prints the notice with OutOrStderr: stderr, unless SetOut was called (as here)
	stdout, stderr, err := execute(t, nil, "pull", "127.0.0.1:1/x", filepath.Join(t.TempDir(), "x"), "--password-stdin")
	if err == nil || !strings.Contains(err.Error(), "--password-stdin needs --username") || !strings.Contains(stdout+stderr, "use 'berthctl checkpoint pull'") {
		t.Errorf("berthctl pull: %v, output %q: want pull's own error and a pointer to 'berthctl checkpoint pull'", err, stdout+stderr)
	}
}

// TestGlobals: -a and -n default to $CONTAINERD_ADDRESS and $CONTAINERD_NAMESPACE, the flags win,
// and an error names where the value at fault came from.
func TestGlobals(t *testing.T) {
	none := filepath.Join(t.TempDir(), "none.sock")
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"address from env", map[string]string{"CONTAINERD_ADDRESS": none}, nil, "$CONTAINERD_ADDRESS " + none + ": destination containerd socket: no such file"},
		{"flag over env", map[string]string{"CONTAINERD_ADDRESS": "/elsewhere"}, []string{"-a", none}, "--address " + none + ": "},
		{"long flag after the command", nil, []string{"--address=" + none}, "--address " + none + ": "},
		{"namespace from env", map[string]string{"CONTAINERD_NAMESPACE": "a/b"}, nil, `$CONTAINERD_NAMESPACE "a/b"`},
		{"namespace flag", map[string]string{"CONTAINERD_NAMESPACE": "ok"}, []string{"-n", "a b"}, `--namespace "a b"`},
		{"id missing", nil, []string{"--id="}, "--id is required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"restore", "--id", "x"}, tc.args...)
			_, _, err := execute(t, tc.env, append(args, "ckpt")...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
	root := newRoot(env(map[string]string{"CONTAINERD_ADDRESS": "/a.sock", "CONTAINERD_NAMESPACE": "k8s.io"}))
	for name, want := range map[string]string{"address": "/a.sock", "namespace": "k8s.io"} {
		if got := root.PersistentFlags().Lookup(name).DefValue; got != want {
			t.Errorf("--%s default %q, want %q", name, got, want)
		}
	}
	root = newRoot(env(nil))
	for name, want := range map[string]string{"address": "/run/containerd/containerd.sock", "namespace": "default"} {
		if got := root.PersistentFlags().Lookup(name).DefValue; got != want {
			t.Errorf("--%s default %q, want %q", name, got, want)
		}
	}
}

// TestHelpGroups: the root's help lists the commands under Node, Checkpoints and Moves.
func TestHelpGroups(t *testing.T) {
	out, _, err := execute(t, nil, "--help")
	if err != nil {
		t.Fatal(err)
	}
	var last int
	for _, s := range []string{"Node:", "fingerprint", "Checkpoints:", "checkpoint", "Moves:", "migrate", "Global Flags", "-a, --address"} {
		if s == "Global Flags" { // the root lists its own persistent flags under Flags
			s = "Flags:"
		}
		i := strings.Index(out[last:], s)
		if i < 0 {
			t.Fatalf("help lacks %q after offset %d:\n%s", s, last, out)
		}
		last += i
	}
	for _, hidden := range []string{"  push ", "  pull "} {
		if strings.Contains(out, hidden) {
			t.Errorf("help lists the deprecated %q:\n%s", hidden, out)
		}
	}
}

// TestUnknownCommand: an unknown command or verb is an error naming it, not a help page.
func TestUnknownCommand(t *testing.T) {
	for _, args := range [][]string{{"bogus"}, {"checkpoint", "bogus"}} {
		_, _, err := execute(t, nil, args...)
		if err == nil || !strings.Contains(err.Error(), `unknown command "bogus"`) {
			t.Errorf("berthctl %v: %v, want unknown command \"bogus\"", args, err)
		}
	}
	if out, _, err := execute(t, nil, "checkpoint"); err != nil || !strings.Contains(out, "create") {
		t.Errorf("berthctl checkpoint: %v, want its help:\n%s", err, out)
	}
}
