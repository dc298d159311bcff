package transfer

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// lazyCRIU returns the real criu binary (BERTH_CRIU, criu on PATH, or the stack `make deps`
// built at <repo>/_output/stack), or skips (fails with CI set) when there is none.
func lazyCRIU(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("BERTH_CRIU"); p != "" {
		return p
	}
	if p, err := exec.LookPath("criu"); err == nil {
		return p
	}
	if _, file, _, ok := runtime.Caller(0); ok { // <repo>/oci/transfer/lazy_test.go
		p := filepath.Join(filepath.Dir(file), "../../_output/stack/bin/criu")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("CI is set but criu is not found (set BERTH_CRIU, put criu in PATH, or run `make deps`)")
	}
	t.Skip("criu not found (set BERTH_CRIU, put criu in PATH, or run `make deps`)")
	return ""
}

// TestLazyStreamLeavesOthersCheckpoints: a lazy page stream names its checkpoint, and the
// receiver removes that checkpoint when the stream ends. A peer that names a checkpoint that was
// not taken in lazy mode, one whose lazy-pages daemon another stream already runs, or one whose
// signed manifest binds another stream ID (or none) is refused and the checkpoint stays, with no
// daemon started: a stream serves and removes only the post-copy checkpoint bound to it.
func TestLazyStreamLeavesOthersCheckpoints(t *testing.T) {
	criuPath := lazyCRIU(t)
	root := t.TempDir()
	makeCheckpoint(t, filepath.Join(root, "stored"), 64<<10)
	lazy := filepath.Join(root, "served")
	makeCheckpoint(t, lazy, 64<<10)
	m, err := checkpoint.ReadManifest(lazy)
	if err != nil {
		t.Fatal(err)
	}
	m.PostCopy = true
	m.LazyStream = strings.Repeat("a", 32)
	if err := checkpoint.WriteManifest(lazy, m); err != nil {
		t.Fatal(err)
	}
	// another stream's daemon runs for "served"
	if err := os.Mkdir(checkpoint.LazyPagesDir(lazy), 0o700); err != nil {
		t.Fatal(err)
	}
	// a lazy checkpoint whose signed manifest binds the source's stream, and one (of an older
	// berth) that binds none: a stream of any other ID is refused before any daemon runs
	bound := filepath.Join(root, "bound")
	makeCheckpoint(t, bound, 64<<10)
	unbound := filepath.Join(root, "unbound")
	makeCheckpoint(t, unbound, 64<<10)
	for dir, id := range map[string]string{bound: strings.Repeat("b", 32), unbound: ""} {
		m, err := checkpoint.ReadManifest(dir)
		if err != nil {
			t.Fatal(err)
		}
		m.PostCopy, m.LazyStream = true, id
		if err := checkpoint.WriteManifest(dir, m); err != nil {
			t.Fatal(err)
		}
	}
	addr, out := startReceiver(t, &Receiver{Root: root, CRIU: criuPath, LazyGuard: []string{"/bin/false"}})

	for _, tc := range []struct{ name, id, want string }{
		{"stored", m.LazyStream, "not taken in lazy mode"},
		{"served", m.LazyStream, "another lazy stream serves"},
		{"bound", strings.Repeat("c", 32), "binds another lazy page stream than this one"},
		{"bound", "", "binds another lazy page stream than this one"},
		{"unbound", strings.Repeat("c", 32), "binds no lazy page stream"},
	} {
		t.Run(tc.name+"/"+tc.id, func(t *testing.T) {
			conn := dial(t, addr)
			if _, err := Handshake(conn); err != nil {
				t.Fatal(err)
			}
			line, _ := json.Marshal(header{Magic: Magic, Name: tc.name, Pages: true, Lazy: true, StreamID: tc.id})
			if _, err := conn.Write(append(line, '\n')); err != nil {
				t.Fatal(err)
			}
			v, err := readVerdict(conn)
			if err != nil {
				t.Fatal(err)
			}
			if !v.OK {
				// this node cannot restore lazily: the stream ends before it looks at the root
				t.Logf("lazy mode refused here: %s", v.Error)
			} else if v, err = readVerdict(conn); err != nil || v.OK || !strings.Contains(v.Error, tc.want) {
				t.Errorf("second verdict %+v, %v; want a refusal saying %q", v, err, tc.want)
			}
			if o := wait(t, out); o.err == nil {
				t.Errorf("receiver: no error for a lazy stream of %s", tc.name)
			}
			if _, err := os.Stat(filepath.Join(root, tc.name, checkpoint.ManifestFile)); err != nil {
				t.Errorf("checkpoint %s removed by a stream that did not serve it: %v", tc.name, err)
			}
			if tc.name != "served" {
				if _, err := os.Stat(checkpoint.LazyPagesDir(filepath.Join(root, tc.name))); err == nil {
					t.Errorf("a daemon directory for %s, made for a stream it does not bind", tc.name)
				}
			}
		})
	}
	if _, err := os.Stat(checkpoint.LazyPagesDir(lazy)); err != nil {
		t.Errorf("the other stream's daemon directory removed: %v", err)
	}
}
