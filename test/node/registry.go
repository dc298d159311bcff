package node

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

// Registry is a CNCF distribution registry (the stack's bin/registry) serving plain HTTP on a
// free loopback port, with its storage under its directory.
type Registry struct {
	// Addr is "127.0.0.1:PORT", the registry part of its references.
	Addr string
	// Dir holds its config, log and storage.
	Dir    string
	cmd    *exec.Cmd
	exited chan struct{}
}

// StartRegistry starts the registry binary bin (Stack.Tool("registry")) with its files in dir
// and waits until it answers on /v2/. Stop it with Stop.
func StartRegistry(bin, dir string) (*Registry, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("registry binary: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Registry{Addr: ln.Addr().String(), Dir: dir}
	ln.Close()
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
http:
  addr: %s
  secret: berth-test-secret
`, filepath.Join(dir, "storage"), r.Addr)
	if err := os.WriteFile(filepath.Join(dir, "config.yml"), []byte(config), 0o600); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(filepath.Join(dir, "registry.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	r.cmd = exec.Command(bin, "serve", filepath.Join(dir, "config.yml"))
	r.cmd.Stdout, r.cmd.Stderr = logf, logf
	r.cmd.Env = append(os.Environ(), "OTEL_TRACES_EXPORTER=none", "OTEL_SDK_DISABLED=true")
	if err := r.cmd.Start(); err != nil {
		return nil, err
	}
	r.exited = make(chan struct{})
	go func() { r.cmd.Wait(); close(r.exited) }()
	client := &http.Client{Timeout: time.Second}
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		select {
		case <-r.exited:
			return nil, fmt.Errorf("registry exited at start: %s", r.Log())
		default:
		}
		resp, err := client.Get("http://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return r, nil
			}
		}
		if time.Now().After(deadline) {
			r.Stop()
			return nil, fmt.Errorf("registry on %s not ready after 15 s (last: %v): %s", r.Addr, err, r.Log())
		}
	}
}

// Ref returns a reference in this registry ("127.0.0.1:PORT/" + repoTag).
func (r *Registry) Ref(repoTag string) string { return r.Addr + "/" + repoTag }

// Stop kills the registry and waits for it.
func (r *Registry) Stop() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	_ = r.cmd.Process.Kill()
	<-r.exited
	r.cmd = nil
}

// Log returns the end of the registry's output, for failure messages.
func (r *Registry) Log() string {
	b, _ := os.ReadFile(filepath.Join(r.Dir, "registry.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(bytes.TrimSpace(b))
}
