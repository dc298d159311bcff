package checkpoint

import (
	"path/filepath"
	"testing"
	"time"
)

func TestLazyTaskRecord(t *testing.T) {
	dir := t.TempDir()
	if got, err := ReadLazyTask(dir); got != nil || err != nil {
		t.Fatalf("no record: %v, %v", got, err)
	}
	want := LazyTask{Pid: 42, Procs: "/sys/fs/cgroup/freezer/ns/x/cgroup.procs", Bundle: "/run/b", Namespace: "ns", ID: "x", Address: "/run/c.sock"}
	if err := WriteLazyTask(dir, want); err != nil {
		t.Fatal(err)
	}
	got, err := ReadLazyTask(dir)
	if err != nil || got == nil || *got != want {
		t.Fatalf("read %+v, %v; want %+v", got, err, want)
	}
	if _, failed := LazyFailed(dir); failed {
		t.Fatal("failed before MarkLazyFailed")
	}
	if err := MarkLazyFailed(dir, "cut"); err != nil {
		t.Fatal(err)
	}
	if r, failed := LazyFailed(dir); !failed || r != "cut" {
		t.Fatalf("LazyFailed = %q, %v", r, failed)
	}
}

// TestLockLazyExcludes: a second LockLazy waits for the first to unlock (flock on separate
// open file descriptions excludes within one process too).
func TestLockLazyExcludes(t *testing.T) {
	dir := t.TempDir()
	unlock, err := LockLazy(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan struct{})
	go func() {
		u, err := LockLazy(dir)
		if err != nil {
			t.Error(err)
		} else {
			u()
		}
		close(got)
	}()
	select {
	case <-got:
		t.Fatal("the second lock was taken while the first was held")
	case <-time.After(100 * time.Millisecond):
	}
	unlock()
	select {
	case <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("the second lock was not taken after unlock")
	}
	if _, err := LockLazy(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("lock in a missing directory succeeded")
	}
}
