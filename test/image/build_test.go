package image

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// repoRoot returns the root of the berth module (two levels above this package).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatal(err)
	}
	return root
}

// checkCached checks that a second build with the same inputs leaves out untouched.
func checkCached(t *testing.T, out string, build func() (string, error)) {
	t.Helper()
	before, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := build(); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) || !before.ModTime().Equal(after.ModTime()) {
		t.Errorf("%s was rewritten although its inputs did not change", out)
	}
}

func TestBuildGoImage(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command in PATH")
	}
	needFile(t, DefaultBusybox)
	mod := t.TempDir()
	files := map[string]string{
		"go.mod":            "module example.com/hello\n\ngo 1.22\n",
		"cmd/hello/main.go": "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hello from the image\") }\n",
	}
	for name, data := range files {
		p := filepath.Join(mod, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	out := filepath.Join(t.TempDir(), "hello.tar")
	const ref = "localhost/berth/hello:test"
	build := func() (string, error) { return BuildGoImage(ctx, mod, "./cmd/hello", ref, out, Config{}) }
	got, err := build()
	if err != nil {
		t.Fatal(err)
	}
	if got != ref {
		t.Errorf("ref %q", got)
	}
	p := readArchiveFile(t, out)
	if !slices.Equal(p.config.Config.Entrypoint, []string{"/usr/local/bin/hello"}) {
		t.Errorf("entrypoint %q", p.config.Config.Entrypoint)
	}
	for _, f := range []string{"usr/local/bin/hello", "bin/busybox", "bin/sh", "etc/passwd"} {
		if _, ok := p.files[f]; !ok {
			t.Errorf("image lacks %s", f)
		}
	}
	if e := p.files["usr/local/bin/hello"]; e.hdr == nil || e.hdr.Mode != 0o755 {
		t.Errorf("binary entry %+v", e.hdr)
	}
	checkCached(t, out, build)

	// A different reference rewrites the archive.
	const ref2 = "localhost/berth/hello:other"
	if _, err := BuildGoImage(ctx, mod, "example.com/hello/cmd/hello", ref2, out, Config{Cmd: []string{"/bin/sh"}}); err != nil {
		t.Fatal(err)
	}
	p = readArchiveFile(t, out)
	if p.index.Manifests[0].Annotations[AnnotationImageName] != ref2 || p.config.Config.Entrypoint != nil {
		t.Errorf("rebuilt archive: %v %+v", p.index.Manifests[0].Annotations, p.config.Config)
	}

	// BuildGoImageWith: a dynamically linked program of this machine beside the Go binary (as
	// the agent image holds criu), with its loader and libraries
	extra, err := exec.LookPath("true")
	if err != nil {
		t.Fatal(err)
	}
	withOut := filepath.Join(t.TempDir(), "with.tar")
	if _, err := BuildGoImageWith(ctx, mod, "./cmd/hello", ref, withOut, Config{}, Binary{Src: extra, Dst: "/usr/local/bin/extra"}); err != nil {
		t.Fatal(err)
	}
	pw := readArchiveFile(t, withOut)
	for _, f := range []string{"usr/local/bin/hello", "usr/local/bin/extra"} {
		if _, ok := pw.files[f]; !ok {
			t.Errorf("image with an extra binary lacks %s", f)
		}
	}
	if _, err := BuildGoImageWith(ctx, mod, "./cmd/hello", ref, withOut, Config{}, Binary{Src: filepath.Join(t.TempDir(), "missing"), Dst: "/usr/local/bin/x"}); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("an extra binary that does not exist: %v; want an error naming it", err)
	}

	needRoot(t)
	dir := t.TempDir()
	extractLayer(t, p, dir)
	if b, err := chrootCommand(dir, "/usr/local/bin/hello").CombinedOutput(); err != nil || string(b) != "hello from the image\n" {
		t.Errorf("binary in image: %q, %v", b, err)
	}
	wdir := t.TempDir()
	extractLayer(t, pw, wdir)
	if b, err := chrootCommand(wdir, "/usr/local/bin/extra").CombinedOutput(); err != nil {
		t.Errorf("extra binary in image: %q, %v", b, err)
	}
}

func TestBuildGoImageErrors(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command in PATH")
	}
	out := filepath.Join(t.TempDir(), "x.tar")
	_, err := BuildGoImage(context.Background(), t.TempDir(), "./nothing", "localhost/berth/x:1", out, Config{})
	if err == nil || !strings.Contains(err.Error(), "./nothing") {
		t.Errorf("error %v, want one naming the package", err)
	}
	if _, err := BuildGoImage(context.Background(), t.TempDir(), "./x", "x:1", out, Config{}); err == nil {
		t.Error("no error for an unqualified reference")
	}
	if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("failed builds left %s: %v", out, err)
	}
}

func TestBinaryName(t *testing.T) {
	tests := []struct{ root, pkg, want string }{
		{"/r", WorkloadPackage, "infer"},
		{"/r", "./cmd/x", "x"},
		{"/r/cmd/y", ".", "y"},
		{"/r/cmd/y", "../z", "z"},
		{"/r", "./...", ""},
	}
	for _, tt := range tests {
		got, err := binaryName(tt.root, tt.pkg)
		if got != tt.want || (err != nil) != (tt.want == "") {
			t.Errorf("binaryName(%q, %q) = %q, %v; want %q", tt.root, tt.pkg, got, err, tt.want)
		}
	}
}

func TestBuildWorkload(t *testing.T) {
	root := repoRoot(t)
	if m, _ := filepath.Glob(filepath.Join(root, "test/workload/cmd/infer/*.go")); len(m) == 0 {
		t.Fatal("test/workload/cmd/infer is missing")
	}
	needFile(t, DefaultBusybox)
	out := filepath.Join(t.TempDir(), "infer.tar")
	ref, err := BuildWorkload(context.Background(), root, out)
	if err != nil {
		t.Fatal(err)
	}
	if ref != WorkloadRef {
		t.Errorf("ref %q", ref)
	}
	p := readArchiveFile(t, out)
	if _, ok := p.files[strings.TrimPrefix(WorkloadBinary, "/")]; !ok {
		t.Errorf("image lacks %s", WorkloadBinary)
	}
	if !slices.Equal(p.config.Config.Entrypoint, []string{WorkloadBinary}) {
		t.Errorf("entrypoint %q", p.config.Config.Entrypoint)
	}
}

func TestBuildRedis(t *testing.T) {
	needFile(t, RedisServer)
	needFile(t, DefaultBusybox)
	out := filepath.Join(t.TempDir(), "redis.tar")
	build := func() (string, error) { return BuildRedis(context.Background(), out) }
	ref, err := build()
	if err != nil {
		t.Fatal(err)
	}
	if ref != RedisRef {
		t.Errorf("ref %q", ref)
	}
	p := readArchiveFile(t, out)
	if !slices.Equal(p.config.Config.Entrypoint, RedisEntrypoint) {
		t.Errorf("entrypoint %q", p.config.Config.Entrypoint)
	}
	for _, f := range []string{"usr/bin/redis-server", "bin/sh", "data"} {
		if _, ok := p.files[f]; !ok {
			t.Errorf("image lacks %s", f)
		}
	}
	checkCached(t, out, build)

	// Run the entrypoint in the extracted image on a free port and PING it.
	needRoot(t)
	dir := t.TempDir()
	extractLayer(t, p, dir)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	argv := append(slices.Clone(RedisEntrypoint), "--port", strconv.Itoa(port))
	cmd := chrootCommand(dir, argv...)
	cmd.Dir = "/data"
	var log strings.Builder
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		if t.Failed() {
			t.Logf("redis output:\n%s", log.String())
		}
	}()
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	var c net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err = net.Dial("tcp", addr); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("redis did not listen on %s: %v", addr, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	rd := bufio.NewReader(c)
	for _, q := range []struct{ cmd, want string }{
		{"PING", "+PONG"},
		{"CONFIG GET save", "*2"},
		{"CONFIG GET appendonly", "*2"},
	} {
		if _, err := fmt.Fprintf(c, "%s\r\n", q.cmd); err != nil {
			t.Fatal(err)
		}
		line, err := rd.ReadString('\n')
		if err != nil || strings.TrimSpace(line) != q.want {
			t.Fatalf("%s: %q, %v", q.cmd, line, err)
		}
		if q.want != "*2" {
			continue
		}
		var vals []string
		for range 2 {
			rd.ReadString('\n') // $len
			v, _ := rd.ReadString('\n')
			vals = append(vals, strings.TrimSpace(v))
		}
		if want := map[string]string{"save": "", "appendonly": "no"}[vals[0]]; vals[1] != want {
			t.Errorf("%s: %q, want %q", q.cmd, vals, want)
		}
	}
}

func TestBuildPause(t *testing.T) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler %s", cc)
	}
	out := filepath.Join(t.TempDir(), "pause.tar")
	build := func() (string, error) { return BuildPause(context.Background(), out) }
	ref, err := build()
	if err != nil {
		t.Fatal(err)
	}
	if ref != PauseRef {
		t.Errorf("ref %q", ref)
	}
	p := readArchiveFile(t, out)
	if len(p.entries) != 1 || p.entries[0].hdr.Name != "pause" || p.entries[0].hdr.Mode != 0o755 {
		t.Fatalf("layer entries %+v", p.entries)
	}
	if !slices.Equal(p.config.Config.Entrypoint, []string{PauseBinary}) {
		t.Errorf("entrypoint %q", p.config.Config.Entrypoint)
	}
	if p.index.Manifests[0].Annotations[AnnotationImageName] != PauseRef {
		t.Errorf("annotations %v", p.index.Manifests[0].Annotations)
	}
	checkCached(t, out, build)

	// The binary is static, waits, and exits 0 on SIGTERM and SIGINT.
	bin := filepath.Join(t.TempDir(), "pause")
	if err := os.WriteFile(bin, p.entries[0].data, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, interp := elfNeeded(t, bin); interp != "" {
		t.Errorf("pause is dynamically linked (%s)", interp)
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		cmd := exec.Command(bin)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		time.Sleep(100 * time.Millisecond)
		select {
		case err := <-done:
			t.Fatalf("pause exited before a signal: %v", err)
		default:
		}
		cmd.Process.Signal(sig)
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("pause after %v: %v", sig, err)
			}
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			t.Errorf("pause ignored %v", sig)
		}
	}
}
