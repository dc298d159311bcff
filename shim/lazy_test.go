package shim

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
