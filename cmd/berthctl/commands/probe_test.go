package commands

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/berth-dev/berth/cmd/berthctl/move"
)

// TestProbeCommands: what kubectl berth move runs in a node's berth-probe pod. `checkpoint need
// --host-root` finds the container's processes by its cgroup under the host's /proc and prints
// their PIDs as a move.Need; `checkpoint check --host-root --need` checks it against the host
// mounted there (no containerd socket): a hostPath missing there and, with the host's PID
// namespace, a PID in use are refused with field, value and limit, JSON on stdout and a non-zero
// exit; a need that fits passes.
func TestProbeCommands(t *testing.T) {
	const id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	host := t.TempDir()
	if err := os.MkdirAll(filepath.Join(host, "proc", "4242"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(host, "srv", "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(host, "proc", "4242", "cgroup"), []byte("0::/kubepods/pod1/"+id+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvGPU, "none")

	need := CheckpointNeed()
	var out bytes.Buffer
	need.SetOut(&out)
	need.SetErr(io.Discard)
	need.SetArgs([]string{"--host-root", host, "--container", id, "-o", "json"})
	if err := need.ExecuteContext(t.Context()); err != nil {
		t.Fatalf("checkpoint need: %v", err)
	}
	var n move.Need
	if err := json.Unmarshal(out.Bytes(), &n); err != nil || !reflect.DeepEqual(n.PIDs, []int{4242}) || n.GPU != nil {
		t.Fatalf("checkpoint need printed %q (%v): want pids [4242]", out.String(), err)
	}

	g := &Globals{}
	check := func(need string) (checkResult, error) {
		t.Helper()
		cmd := CheckpointCheck(g)
		cmd.SilenceUsage = true
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(io.Discard)
		cmd.SetArgs([]string{"--host-root", host, "--need", need, "-o", "json"})
		err := cmd.ExecuteContext(t.Context())
		var res checkResult
		if jerr := json.Unmarshal(out.Bytes(), &res); jerr != nil {
			t.Fatalf("check -o json printed %q: %v (exit %v)", out.String(), jerr, err)
		}
		return res, err
	}
	ok := `{"pids": [4242], "spec": {"linux": {"namespaces": [{"type": "pid"}]}, "mounts": [{"destination": "/d", "source": "/srv/data", "type": "bind"}]}}`
	if res, err := check(ok); err != nil || !res.OK || res.On != "host "+host {
		t.Errorf("a need that fits: %+v, %v", res, err)
	}
	bad := `{"pids": [4242], "spec": {"linux": {}, "mounts": [{"destination": "/d", "source": "/srv/gone", "type": "bind"}]}}`
	res, err := check(bad)
	if !errors.Is(err, move.ErrPreflight) || res.OK || len(res.Refusals) != 2 {
		t.Fatalf("a missing source and a PID in use: %+v, %v", res, err)
	}
	got := res.Refusals[0].String() + "; " + res.Refusals[1].String()
	for _, want := range []string{"mounts[0].source (destination /d) is /srv/gone (missing), needs an existing path", "PID 4242 is in use in the host's PID namespace, needs free"} {
		if !strings.Contains(got, want) {
			t.Errorf("refusals %q lack %q", got, want)
		}
	}
	// one place to check, no more
	cmd := CheckpointCheck(g)
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	cmd.SetArgs([]string{"--host-root", host, "--on", "/run/containerd.sock", "--need", ok})
	if err := cmd.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "not 2") {
		t.Errorf("--host-root with --on: %v", err)
	}
}
