package registry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The tests run the CNCF distribution registry (built into the stack by test/stack/install.sh)
// as a real process on 127.0.0.1, with its storage in a temporary directory.

// registryBinary returns the registry binary of the stack: $BERTH_STACK/bin/registry, else
// <repo>/_output/stack/bin/registry. Without it the test skips, or fails when CI is set.
func registryBinary(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("BERTH_STACK")
	if dir == "" {
		wd, err := os.Getwd()
		if err != nil {
			t.Fatal(err)
		}
		for d := wd; d != "/"; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				dir = filepath.Join(d, "_output", "stack")
				break
			}
		}
	}
	bin := filepath.Join(dir, "bin", "registry")
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI is set but the registry binary is missing (run `make deps`): %v", err)
		}
		t.Skipf("registry binary missing (run `make deps`): %v", err)
	}
	return bin
}

// testRegistry is one distribution registry process; it can be killed and started again on the
// same address and storage.
type testRegistry struct {
	t       *testing.T
	bin     string
	dir     string // config, log, storage
	addr    string // 127.0.0.1:port
	storage string
	cmd     *exec.Cmd
	exited  chan struct{}
}

// startRegistry starts a registry on a free loopback port. With htpasswd set, it requires
// basic auth against that file.
func startRegistry(t *testing.T, htpasswd string) *testRegistry {
	t.Helper()
	r := &testRegistry{t: t, bin: registryBinary(t), dir: t.TempDir()}
	r.storage = filepath.Join(r.dir, "storage")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r.addr = ln.Addr().String()
	ln.Close()
	auth := ""
	if htpasswd != "" {
		abs, err := filepath.Abs(htpasswd)
		if err != nil {
			t.Fatal(err)
		}
		auth = fmt.Sprintf("auth:\n  htpasswd:\n    realm: berth-test\n    path: %s\n", abs)
	}
	config := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
  secret: berth-test-secret
%s`, r.storage, r.addr, auth)
	if err := os.WriteFile(filepath.Join(r.dir, "config.yml"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	r.start()
	t.Cleanup(r.kill)
	return r
}

// start runs the registry process and waits until it answers on /v2/.
func (r *testRegistry) start() {
	r.t.Helper()
	logf, err := os.OpenFile(filepath.Join(r.dir, "registry.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		r.t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(r.bin, "serve", filepath.Join(r.dir, "config.yml"))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "OTEL_TRACES_EXPORTER=none", "OTEL_SDK_DISABLED=true")
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	r.cmd, r.exited = cmd, make(chan struct{})
	go func(exited chan struct{}) { cmd.Wait(); close(exited) }(r.exited)
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-r.exited:
			r.t.Fatalf("registry exited at start: %s", r.log())
		default:
		}
		resp, err := client.Get("http://" + r.addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return
			}
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("registry on %s not ready after 15 s (last: %v): %s", r.addr, err, r.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill stops the registry with SIGKILL (no graceful shutdown: it "goes away") and waits for it.
func (r *testRegistry) kill() {
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	<-r.exited
	r.cmd = nil
}

// log returns the registry's output so far, for failure messages.
func (r *testRegistry) log() string {
	b, _ := os.ReadFile(filepath.Join(r.dir, "registry.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(bytes.TrimSpace(b))
}

// ref returns a reference in this registry.
func (r *testRegistry) ref(repoTag string) string { return r.addr + "/" + repoTag }

// blobPath returns where the registry's filesystem storage keeps a blob's content.
func (r *testRegistry) blobPath(dgst string) string {
	algo, hex, _ := strings.Cut(dgst, ":")
	return filepath.Join(r.storage, "docker", "registry", "v2", "blobs", algo, hex[:2], hex, "data")
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// noDir fails the test unless path does not exist.
func noDir(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s exists after a failed pull (stat: %v)", path, err)
	}
}
