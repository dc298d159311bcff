package helper

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/registry/regdef"
)

// With BERTH_HELPER_TEST set, the test binary is the helper: it serves one request with
// testHandlers ("inventory": the GPU inventory of a fake node, serveInventoryForTest), so the
// tests below run the client against a real child process.
func TestMain(m *testing.M) {
	switch os.Getenv("BERTH_HELPER_TEST") {
	case "":
	case "inventory":
		os.Exit(serveInventoryForTest())
	default:
		os.Exit(serveForTest())
	}
	os.Exit(m.Run())
}

func serveForTest() int {
	ctx, stop := signalContext()
	defer stop()
	return Serve(ctx, os.Stdin, os.Stdout, testHandlers)
}

// testHandlers answer by reference: "ok/..." resolves to a digest and pulls by creating dir;
// "unauthorized/..." fails as the registry does for a 401; "slow/..." waits for cancellation
// (writing dir/started first) and leaves dir/stopped when its context ends; "crash/..." exits 3
// after writing to standard error.
var testHandlers = Handlers{
	Resolve: func(ctx context.Context, ref string, o RegistryOptions) (string, error) {
		if strings.HasPrefix(ref, "unauthorized/") {
			return "", fmt.Errorf("resolve %s: %w: %w", ref, regdef.ErrUnauthorized, errors.New("401"))
		}
		return "sha256:" + strings.Repeat("ab", 32), nil
	},
	Pull: func(ctx context.Context, ref, dir string, o RegistryOptions) error {
		switch {
		case strings.HasPrefix(ref, "slow/"):
			if err := os.WriteFile(filepath.Join(dir, "started"), nil, 0o600); err != nil {
				return err
			}
			<-ctx.Done()
			_ = os.WriteFile(filepath.Join(dir, "stopped"), nil, 0o600)
			return fmt.Errorf("pull %s: %w", ref, ctx.Err())
		case strings.HasPrefix(ref, "crash/"):
			fmt.Fprintln(os.Stderr, "helper crashed on purpose")
			os.Exit(3)
		case strings.HasPrefix(ref, "big/"):
			return fmt.Errorf("pull %s: file of %d bytes: %w (limit %d)", ref, 2*o.Limits.MaxFileBytes, archive.ErrFileTooLarge, o.Limits.MaxFileBytes)
		}
		return os.Mkdir(dir, 0o700)
	},
	ReadProcesses: func(ctx context.Context, dir string) ([]privilege.Process, error) {
		if _, err := os.Stat(dir); err != nil {
			return nil, fmt.Errorf("read processes: %w", err)
		}
		return []privilege.Process{{PID: 1, TID: 1, Comm: "app", UID: 1000, CapEff: 1 << 10, NoNewPrivs: true}, {PID: 1, TID: 2, Comm: "app"}}, nil
	},
}

// selfClient runs this test binary as the helper.
func selfClient(t *testing.T) Client {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return Client{Path: exe, Run: func(cmd *exec.Cmd) ([]byte, error) {
		cmd.Env = append(os.Environ(), "BERTH_HELPER_TEST=1")
		return cmd.Output()
	}}
}

func TestErrorKindsRoundTrip(t *testing.T) {
	tests := []struct {
		err  error
		want []error
	}{
		{fmt.Errorf("pull r: %w: %w", regdef.ErrUnauthorized, errors.New("401")), []error{regdef.ErrUnauthorized}},
		{fmt.Errorf("pull r: %w", regdef.ErrNotFound), []error{regdef.ErrNotFound}},
		{fmt.Errorf("pull r: %w: %w", checkpoint.ErrDigestMismatch, errors.New("blob")), []error{checkpoint.ErrDigestMismatch}},
		{fmt.Errorf("pull r: %w", archive.ErrTotalTooLarge), []error{archive.ErrTotalTooLarge}},
		{fmt.Errorf("pull r: %w", context.Canceled), []error{context.Canceled}},
		{fmt.Errorf("docker config: %w", os.ErrNotExist), []error{os.ErrNotExist}},
	}
	for _, tc := range tests {
		a := Answer{Error: EncodeError(tc.err)}
		var buf bytes.Buffer
		if rc := Serve(context.Background(), strings.NewReader(`{"op":"resolve","ref":"x"}`), &buf, Handlers{
			Resolve: func(context.Context, string, RegistryOptions) (string, error) { return "", tc.err },
		}); rc != 0 {
			t.Fatalf("serve: exit %d", rc)
		}
		got := Client{Path: "h", Run: func(*exec.Cmd) ([]byte, error) { return buf.Bytes(), nil }}
		_, err := got.Resolve(context.Background(), "x", RegistryOptions{})
		if err == nil || err.Error() != tc.err.Error() || err.Error() != a.Error.Message {
			t.Errorf("%v came back as %v", tc.err, err)
			continue
		}
		for _, w := range tc.want {
			if !errors.Is(err, w) {
				t.Errorf("%v came back as %v, not matching %v", tc.err, err, w)
			}
		}
		if errors.Is(err, errdefs.ErrInternal) || errors.Is(err, regdef.ErrNoTag) {
			t.Errorf("%v matches a sentinel it did not carry", err)
		}
	}
}

func TestServeRefusesBadRequests(t *testing.T) {
	for in, want := range map[string]string{
		`{"op":"push","ref":"x"}`: "unknown op",
		`{"op":"pull","ref":"x"}`: "no directory",
		`{"op":"read-processes"}`: "no images directory",
	} {
		var buf bytes.Buffer
		if rc := Serve(context.Background(), strings.NewReader(in), &buf, testHandlers); rc != 0 {
			t.Fatalf("%s: exit %d", in, rc)
		}
		_, err := Client{Path: "h", Run: func(*exec.Cmd) ([]byte, error) { return buf.Bytes(), nil }}.call(context.Background(), Request{})
		if err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v; want an invalid-argument error containing %q", in, err, want)
		}
	}
	if rc := Serve(context.Background(), strings.NewReader("not json"), &bytes.Buffer{}, testHandlers); rc != 2 {
		t.Errorf("unreadable request: exit %d, want 2", rc)
	}
}

// TestClientRunsHelper runs the helper as a child process: answers, classified errors, limits
// passed through, a crash reported with its standard error, and a canceled pull stopped with
// SIGTERM so that it cleans up.
func TestClientRunsHelper(t *testing.T) {
	c := selfClient(t)
	ctx := context.Background()
	if d, err := c.Resolve(ctx, "ok/ck:v1", RegistryOptions{}); err != nil || d != "sha256:"+strings.Repeat("ab", 32) {
		t.Fatalf("resolve: %q %v", d, err)
	}
	if _, err := c.Resolve(ctx, "unauthorized/ck:v1", RegistryOptions{}); !errors.Is(err, regdef.ErrUnauthorized) || !strings.Contains(err.Error(), "401") {
		t.Fatalf("unauthorized: %v", err)
	}
	dir := filepath.Join(t.TempDir(), "ck")
	if err := c.Pull(ctx, "ok/ck:v1", dir, RegistryOptions{}); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		t.Fatalf("pull made no directory: %v", err)
	}
	err := c.Pull(ctx, "big/ck:v1", dir+"2", RegistryOptions{Limits: archive.Limits{MaxFileBytes: 1234}})
	if !errors.Is(err, archive.ErrFileTooLarge) || !strings.Contains(err.Error(), "limit 1234") {
		t.Fatalf("limits: %v; want the helper's ErrFileTooLarge naming the limit the client sent", err)
	}
	procs, err := c.ReadProcesses(ctx, dir)
	if err != nil || len(procs) != 2 || procs[0].UID != 1000 || procs[0].CapEff != 1<<10 || !procs[0].NoNewPrivs || procs[1].TID != 2 {
		t.Fatalf("read processes: %+v %v", procs, err)
	}
	if _, err := c.ReadProcesses(ctx, filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("read processes of a missing directory: %v; want fs.ErrNotExist naming it", err)
	}
	err = c.Pull(ctx, "crash/ck:v1", dir+"3", RegistryOptions{})
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "helper crashed on purpose") {
		t.Fatalf("crash: %v; want the exit status and the helper's standard error", err)
	}

	slow := t.TempDir()
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Pull(cctx, "slow/ck:v1", slow, RegistryOptions{}) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(slow, "started")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the slow pull never started")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled pull: %v", err)
	}
	if _, err := os.Stat(filepath.Join(slow, "stopped")); err != nil {
		t.Errorf("the helper was not stopped with a signal it could clean up on: %v", err)
	}
}

func TestFindNamesWhereItLooked(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	_, err := Find()
	if err == nil || !strings.Contains(err.Error(), Name) || !strings.Contains(err.Error(), "PATH") || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Find: %v", err)
	}
	bin := t.TempDir()
	p := filepath.Join(bin, Name)
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin)
	if got, err := Find(); err != nil || got != p {
		t.Fatalf("Find: %q %v; want %s", got, err, p)
	}
}

// signalContext ends on SIGTERM, as cmd/berth-shim-helper's does.
func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGTERM)
}
