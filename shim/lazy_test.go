package shim

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

func TestListening(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if !listening(addr) {
		t.Errorf("listening(%s) = false with a listener there", addr)
	}
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// the connected socket is not a listener: only state 0A counts
	if listening(c.LocalAddr().String()) {
		t.Errorf("listening(%s) = true for a connected socket", c.LocalAddr())
	}
	ln.Close()
	if listening(addr) {
		t.Errorf("listening(%s) = true after the listener closed", addr)
	}
	for _, bad := range []string{"", "nonsense", "[::1]:80"} {
		if listening(bad) {
			t.Errorf("listening(%q) = true", bad)
		}
	}
}

func TestUseLazyRestore(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "ck")
	bundle := t.TempDir()
	conf := filepath.Join(bundle, criuConfigName)
	if err := os.WriteFile(conf, []byte("tcp-established\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// no daemon: refused, the configuration untouched
	if _, err := useLazyRestore(context.Background(), bundle, dir); err == nil || !strings.Contains(err.Error(), "no criu lazy-pages daemon") {
		t.Fatalf("without a daemon: err = %v", err)
	}
	lazyDir := checkpoint.LazyPagesDir(dir)
	if lazyDir != filepath.Join(root, ".lazy-ck") {
		t.Fatalf("LazyPagesDir = %s", lazyDir)
	}
	if err := os.MkdirAll(lazyDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(lazyDir, "lazy-pages.socket"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	undo, err := useLazyRestore(context.Background(), bundle, dir)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(conf)
	if want := "tcp-established\nlazy-pages\nwork-dir " + lazyDir + "\n"; string(b) != want {
		t.Errorf("configuration %q, want %q", b, want)
	}
	undo()
	if b, _ := os.ReadFile(conf); string(b) != "tcp-established\n" {
		t.Errorf("after undo: %q", b)
	}
}

func TestLockLazyRestore(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "ck")
	if _, err := lockLazyRestore(dir); err == nil || !strings.Contains(err.Error(), "no criu lazy-pages daemon") {
		t.Fatalf("without the daemon's directory: err = %v", err)
	}
	lazyDir := checkpoint.LazyPagesDir(dir)
	if err := os.MkdirAll(lazyDir, 0o700); err != nil {
		t.Fatal(err)
	}
	release, err := lockLazyRestore(dir)
	if err != nil {
		t.Fatal(err)
	}
	release()
	release() // once
	if err := checkpoint.MarkLazyFailed(lazyDir, "the receiver died"); err != nil {
		t.Fatal(err)
	}
	if _, err := lockLazyRestore(dir); err == nil || !strings.Contains(err.Error(), "page stream failed (the receiver died)") {
		t.Fatalf("after the stream failed: err = %v", err)
	}
}

func TestProcsFromCgroupFile(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"v1", "12:pids:/default/x\n5:freezer:/default/x\n0::/system.slice/c.scope\n", "/sys/fs/cgroup/freezer/default/x/cgroup.procs"},
		{"v1 joined controllers", "4:cpu,freezer:/k8s/pod1/c\n", "/sys/fs/cgroup/freezer/k8s/pod1/c/cgroup.procs"},
		{"v2", "0::/default/x\n", "/sys/fs/cgroup/default/x/cgroup.procs"},
		{"neither", "3:pids:/x\n", ""},
	} {
		if got := procsFromCgroupFile(tc.in); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestLazyFailure(t *testing.T) {
	bundle := t.TempDir()
	if got := lazyFailure(bundle); got != "" {
		t.Fatalf("no file: %q", got)
	}
	if err := os.WriteFile(filepath.Join(bundle, checkpoint.LazyFailedBundleFile), []byte("cut\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := lazyFailure(bundle); got != "cut" {
		t.Fatalf("%q, want cut", got)
	}
}

// TestLazyVerdictReportedOnce: the guard's reason is reported once however many look for it
// (the watch and Delete), and goes into the restore report; with no reason nothing is logged.
func TestLazyVerdictReportedOnce(t *testing.T) {
	ctx, logs := logCapture()
	bundle := t.TempDir()
	s := &Service{}
	v := &lazyVerdict{bundle: bundle}
	if v.report(ctx, s, 1) || logs.Len() != 0 {
		t.Fatalf("no reason in the bundle: reported, log %q", logs.String())
	}
	if err := os.WriteFile(filepath.Join(bundle, RestoreReportFile), []byte(`{"totalMs":12}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, checkpoint.LazyFailedBundleFile), []byte("the stream was cut\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if !v.report(ctx, s, 1) {
			t.Fatalf("try %d: the reason in the bundle was not found", i)
		}
	}
	if n := strings.Count(logs.String(), "memory pages stopped coming before all arrived"); n != 1 {
		t.Errorf("reported %d times, want once:\n%s", n, logs.String())
	}
	b, err := os.ReadFile(filepath.Join(bundle, RestoreReportFile))
	if err != nil {
		t.Fatal(err)
	}
	var rep RestoreReport
	if err := json.Unmarshal(b, &rep); err != nil || rep.LazyFailure != "the stream was cut" || rep.TotalMs != 12 {
		t.Errorf("restore report %s (%v): want the reason added and the rest kept", b, err)
	}
}

// TestLazyWatchEndsWithoutVerdict: the watch ends once the lazy-pages directory is gone, with
// nothing reported, so that Delete's look is the one that finds a reason written later.
func TestLazyWatchEndsWithoutVerdict(t *testing.T) {
	ctx, logs := logCapture()
	bundle := t.TempDir()
	v := &lazyVerdict{bundle: bundle}
	done := make(chan struct{})
	go func() { (&Service{}).watchLazyTask(ctx, v, filepath.Join(t.TempDir(), "gone")); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not end 10s after the lazy-pages directory was gone")
	}
	if err := os.WriteFile(filepath.Join(bundle, checkpoint.LazyFailedBundleFile), []byte("cut\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if !v.report(ctx, &Service{}, 1) || !strings.Contains(logs.String(), "lazy_failure=cut") {
		t.Errorf("the later look did not report the reason: %q", logs.String())
	}
}

// TestLazyVerdictDoesNotWaitForTheWatch: Delete's look returns at once while the watch, which
// claimed the reason, waits for Start's report; a report that does not parse yet (read
// mid-write) is waited for, not taken as missing.
func TestLazyVerdictDoesNotWaitForTheWatch(t *testing.T) {
	ctx, _ := logCapture()
	bundle := t.TempDir()
	if err := os.WriteFile(filepath.Join(bundle, checkpoint.LazyFailedBundleFile), []byte("cut\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, RestoreReportFile), []byte(`{"totalMs":`), 0o600); err != nil {
		t.Fatal(err)
	}
	v, s := &lazyVerdict{bundle: bundle}, &Service{}
	watched := make(chan struct{})
	go func() { v.report(ctx, s, 100); close(watched) }()
	for !v.claimed.Load() {
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	if !v.report(ctx, s, 1) {
		t.Fatal("Delete's look did not find the reason")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Delete's look waited %v behind the watch", d)
	}
	s.writeRestoreReport(ctx, bundle, RestoreReport{TotalMs: 12})
	<-watched
	b, _ := os.ReadFile(filepath.Join(bundle, RestoreReportFile))
	var rep RestoreReport
	if err := json.Unmarshal(b, &rep); err != nil || rep.LazyFailure != "cut" {
		t.Errorf("restore report %s (%v): the reason was lost to a report read mid-write", b, err)
	}
}

// TestLazyFailureHardened: the guard's reason is read from a regular file only, not through a
// symbolic link or from a FIFO, and at most maxLazyFailure bytes of it.
func TestLazyFailureHardened(t *testing.T) {
	bundle := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.WriteFile(target, []byte("forged"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(bundle, checkpoint.LazyFailedBundleFile)
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
	if got := lazyFailure(bundle); got != "" {
		t.Errorf("read through a symbolic link: %q", got)
	}
	os.Remove(path)
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 1)
	go func() { done <- lazyFailure(bundle) }()
	select {
	case got := <-done:
		if got != "" {
			t.Errorf("read from a FIFO: %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("lazyFailure blocked on a FIFO")
	}
	os.Remove(path)
	if err := os.WriteFile(path, []byte(strings.Repeat("x", 1<<20)), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := lazyFailure(bundle); len(got) != maxLazyFailure {
		t.Errorf("read %d bytes of a 1 MiB reason, want %d", len(got), maxLazyFailure)
	}
}

// TestCheckpointCRIU: the CRIU processes killed to end a lazy dump are those of runc's
// checkpoint of that task run by this shim, and their descendants named criu: never CRIU of
// another task's checkpoint, of another runc command, or elsewhere on the node (a fixture /proc:
// testdata/proc).
func TestCheckpointCRIU(t *testing.T) {
	for _, tc := range []struct {
		self int
		id   string
		want []int
	}{
		{100, "web", []int{300, 301}},
		{100, "other", []int{310}},
		{100, "webx", nil},    // its checkpoint has no CRIU yet; "/web" in an argument is not the id
		{100, "missing", nil}, // no checkpoint of it
		{999, "web", nil},     // another shim's runc
	} {
		got := checkpointCRIU("testdata/proc", tc.self, tc.id)
		slices.Sort(got)
		if !slices.Equal(got, tc.want) {
			t.Errorf("checkpointCRIU(shim %d, %q) = %v, want %v", tc.self, tc.id, got, tc.want)
		}
	}
}

// fakeCheckpointCRIU starts, as a child of the test process (the shim), a process named runc
// whose command line is runc's checkpoint of task id, with a child named criu (a copy of sleep)
// that waits for good, as CRIU serving a client that never finishes; it returns the "runc"
// command, started, once its criu runs.
func fakeCheckpointCRIU(t *testing.T, id string) *exec.Cmd {
	t.Helper()
	dir := t.TempDir()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	b, err := os.ReadFile(sleep)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "criu"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "runc"), []byte("#!/bin/sh\n\"$(dirname \"$0\")/criu\" 600 &\nwait $!\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(dir, "runc"), "--root", "/run/x", "checkpoint", "--work-path", "/x", id)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, pid := range checkpointCRIU("/proc", os.Getpid(), id) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	for deadline := time.Now().Add(5 * time.Second); len(checkpointCRIU("/proc", os.Getpid(), id)) == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the fake checkpoint's criu did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd
}

// TestAbandonLazyDumpKillsCRIU: a lazy dump given up (a Resume, or the pause lease's end) whose
// CRIU still serves a client that never finishes (a local process that took CRIU's one
// connection and holds it) ends within lazyAbandonGrace: CRIU of that checkpoint is killed, and
// nothing else. A dump that ends by itself within the grace is left alone.
func TestAbandonLazyDumpKillsCRIU(t *testing.T) {
	defer func(g time.Duration) { lazyAbandonGrace = g }(lazyAbandonGrace)
	lazyAbandonGrace = 200 * time.Millisecond
	held := fakeCheckpointCRIU(t, "held")
	fakeCheckpointCRIU(t, "other")
	s := NewService(&pausedStub{}, Config{}, Deps{})
	done := make(chan struct{})
	s.lazy = map[string]*lazyDump{
		"held": {id: "held", addr: "127.0.0.1:1", done: make(chan struct{})}, // nothing listens: a client was accepted
		"done": {id: "done", addr: "127.0.0.1:1", done: done},
	}
	ended := make(chan error, 1)
	go func() { ended <- held.Wait() }()
	s.abandonLazyDump(t.Context(), "held", "test")
	s.abandonLazyDump(t.Context(), "held", "test again") // acts once
	select {
	case err := <-ended:
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 128+int(syscall.SIGKILL) {
			t.Errorf("the held checkpoint's runc ended with %v; want its criu killed (exit status 137 from wait)", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the abandoned lazy dump's CRIU was not killed 5s after the grace")
	}
	if len(checkpointCRIU("/proc", os.Getpid(), "other")) != 1 {
		t.Error("the CRIU of another task's checkpoint was killed")
	}
	fakeCheckpointCRIU(t, "done")
	s.abandonLazyDump(t.Context(), "done", "test")
	close(done) // CRIU let go by itself within the grace
	time.Sleep(3 * lazyAbandonGrace)
	if len(checkpointCRIU("/proc", os.Getpid(), "done")) != 1 {
		t.Error("CRIU of a dump that ended within the grace was killed")
	}
}
