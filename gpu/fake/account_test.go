package fake_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

const childMem = 4 << 20 // what child allocates

// smallNode is a node with one GPU GPU-a of memBytes.
func smallNode(t *testing.T, memBytes uint64) *fake.Node {
	t.Helper()
	s := spec("580.65.06", "GPU-a")
	s.GPUs[0].MemoryBytes = memBytes
	n, err := fake.Setup(t.TempDir(), s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// startChild runs the test binary as a fake CUDA process on n's GPU-a (child, with mode "" or
// "exit") and waits until it has checked its device memory a few times.
func startChild(t *testing.T, n *fake.Node, mode string) (*exec.Cmd, string) {
	t.Helper()
	sd := sockDir(t)
	status := filepath.Join(t.TempDir(), "status")
	arg := container(t, n, "GPU-a") + ":" + sd + ":" + status
	if mode != "" {
		arg += ":" + mode
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+arg)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	if !waitProgress(t, status, 0, 10*time.Second) {
		t.Fatalf("child made no progress: %d", progress(t, status))
	}
	return cmd, sd
}

// memFiles lists the mem-* files in dir.
func memFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, fakecuda.MemPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range m {
		m[i] = filepath.Base(m[i])
	}
	return m
}

func used(t *testing.T, n *fake.Node) uint64 {
	t.Helper()
	devs, err := n.Devices()
	if err != nil {
		t.Fatal(err)
	}
	return devs[0].MemoryUsed
}

// TestExitedProcessMemoryFreed runs a fake CUDA process with 4 MiB on a GPU, checks that the GPU
// and the per-process accounting count it, and ends it the ways a process ends (SIGKILL, an exit
// without freeing, SIGTERM): the GPU shows the memory free again, nothing of the process is left
// in the node's directory, and an allocation that needs its memory succeeds. A reservation (a
// mem-* file no process owns) is counted throughout and never freed.
func TestExitedProcessMemoryFreed(t *testing.T) {
	for _, how := range []string{"sigkill", "exit", "sigterm"} {
		t.Run(how, func(t *testing.T) {
			n := smallNode(t, 7<<20)
			dir, _ := n.Dir("GPU-a")
			if err := os.WriteFile(filepath.Join(dir, fakecuda.MemPrefix+"fill"), make([]byte, 1<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			mode := ""
			if how == "exit" {
				mode = "exit"
			}
			cmd, sd := startChild(t, n, mode)
			pid := cmd.Process.Pid
			if how != "exit" {
				if got := used(t, n); got != childMem+1<<20 {
					t.Errorf("GPU used %d while the child runs, want %d (its 4 MiB and the 1 MiB reservation)", got, childMem+1<<20)
				}
				if u, err := n.ProcessMemory(pid); err != nil || !maps(u, map[string]uint64{"GPU-a": childMem}) {
					t.Errorf("ProcessMemory(child) = %v, %v; want GPU-a: %d", u, err, childMem)
				}
				if u, err := (&fake.Driver{Node: n, SocketDir: sd}).Usage(pid); err != nil || u["GPU-a"] != childMem {
					t.Errorf("the child's own usage %v, %v", u, err)
				}
				// while the child lives, its memory is not another's to take
				if err := mallocOnce(t, n, 3<<20); !errors.Is(err, gpu.ErrOutOfMemory) {
					t.Errorf("malloc of 3 MiB with 2 MiB free: %v, want out of memory", err)
				}
			}
			switch how {
			case "sigkill":
				cmd.Process.Kill()
			case "sigterm":
				cmd.Process.Signal(syscall.SIGTERM)
			}
			// Freed as soon as the process is gone, before it is reaped: poll the accounting.
			deadline := time.Now().Add(5 * time.Second)
			for used(t, n) != 1<<20 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if got := used(t, n); got != 1<<20 {
				t.Fatalf("GPU used %d after the child ended (%s), want only the 1 MiB reservation", got, how)
			}
			if f := memFiles(t, dir); !slices.Equal(f, []string{fakecuda.MemPrefix + "fill"}) {
				t.Errorf("device memory files left: %v, want only the reservation", f)
			}
			cmd.Wait()
			if u, err := n.ProcessMemory(pid); err != nil || len(u) != 0 {
				t.Errorf("ProcessMemory of the exited child = %v, %v; want none", u, err)
			}
			if err := mallocOnce(t, n, 6<<20); err != nil {
				t.Errorf("malloc of the freed memory: %v", err)
			}
		})
	}
}

// mallocOnce allocates bytes on n's GPU-a in a fresh context of this process and frees it.
func mallocOnce(t *testing.T, n *fake.Node, bytes int) error {
	t.Helper()
	c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: container(t, n, "GPU-a"), SocketDir: sockDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.Malloc(0, bytes)
	return err
}

func maps(a, b map[string]uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestProcessMemoryMatchesAllocations checks that the inventory's per-process memory (from the
// process's mappings, not its own word) is what the process allocated, page by page, on each GPU,
// through a checkpoint (none held) and a restore (held again).
func TestProcessMemoryMatchesAllocations(t *testing.T) {
	n := setup(t, "580.65.06", "GPU-a", "GPU-b")
	sd := sockDir(t)
	c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: container(t, n, "GPU-a", "GPU-b"), SocketDir: sd})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	page := uint64(os.Getpagesize())
	round := func(b int) uint64 { return (uint64(b) + page - 1) / page * page }
	want := map[string]uint64{}
	for _, a := range []struct {
		dev, bytes int
	}{{0, 1}, {0, 3<<20 + 5}, {1, 8192}, {1, 12345}, {0, 1 << 20}} {
		if _, err := c.Malloc(a.dev, a.bytes); err != nil {
			t.Fatal(err)
		}
		want[[]string{"GPU-a", "GPU-b"}[a.dev]] += round(a.bytes)
	}
	pid := os.Getpid()
	inv := (&fake.Backend{Node: n, Drv: &fake.Driver{Node: n, SocketDir: sd}}).Inventory()
	if u, err := inv.ProcessMemory(pid); err != nil || !maps(u, want) {
		t.Fatalf("ProcessMemory = %v, %v; want %v", u, err, want)
	}
	if u := c.Usage(); !maps(u, want) {
		t.Errorf("the context's usage %v, want %v", u, want)
	}
	devs, err := n.Devices()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range devs {
		if d.MemoryUsed != want[d.UUID] || d.MemoryFree() != d.MemoryTotal-want[d.UUID] {
			t.Errorf("%s: used %d free %d, want used %d", d.UUID, d.MemoryUsed, d.MemoryFree(), want[d.UUID])
		}
	}
	// Checkpointed, the process holds no device memory (as NVML reports it); restored, it does.
	d := &fake.Driver{Node: n, SocketDir: sd}
	if err := d.Lock(pid, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := d.Checkpoint(pid); err != nil {
		t.Fatal(err)
	}
	if u, err := inv.ProcessMemory(pid); err != nil || len(u) != 0 {
		t.Errorf("ProcessMemory while checkpointed = %v, %v; want none", u, err)
	}
	if err := d.Restore(pid, nil); err != nil {
		t.Fatal(err)
	}
	if err := d.Unlock(pid); err != nil {
		t.Fatal(err)
	}
	if u, err := inv.ProcessMemory(pid); err != nil || !maps(u, want) {
		t.Errorf("ProcessMemory after restore = %v, %v; want %v", u, err, want)
	}
	if u, err := inv.ProcessMemory(1 << 30); err != nil || len(u) != 0 {
		t.Errorf("ProcessMemory(no such pid) = %v, %v; want none", u, err)
	}

	// Where the node says per-process memory is not available (as NVML may), every Node of the
	// root (the shim's, opened earlier) fails with ErrUnsupported until it is available again.
	other, err := fake.Open(n.Root())
	if err != nil {
		t.Fatal(err)
	}
	if err := other.SetProcessMemoryUnavailable(true); err != nil {
		t.Fatal(err)
	}
	if u, err := inv.ProcessMemory(pid); !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), "not available") {
		t.Errorf("ProcessMemory where not available = %v, %v; want ErrUnsupported", u, err)
	}
	if err := other.SetProcessMemoryUnavailable(false); err != nil {
		t.Fatal(err)
	}
	if u, err := inv.ProcessMemory(pid); err != nil || !maps(u, want) {
		t.Errorf("ProcessMemory available again = %v, %v; want %v", u, err, want)
	}
}

// TestRestoreOntoFullGPU checkpoints a process holding 40 MiB of a 64 MiB GPU, lets another
// take 40 MiB of it, and restores through the driver: refused with ErrOutOfMemory naming the
// GPU, the bytes needed and free (the process still CHECKPOINTED, nothing placed), and it
// restores once the other frees its memory. With the node's RestoreWhenFull "hang" the restore
// never answers (the driver's call times out, later calls too) until the process ends.
func TestRestoreOntoFullGPU(t *testing.T) {
	for _, mode := range []string{fakecuda.FullRefuse, fakecuda.FullHang} {
		t.Run(mode, func(t *testing.T) {
			n := smallNode(t, 64<<20)
			if mode == fakecuda.FullHang {
				if err := n.SetRestoreWhenFull(mode); err != nil {
					t.Fatal(err)
				}
				if n2, err := fake.Open(n.Root()); err != nil || n2.Spec().RestoreWhenFull != mode {
					t.Fatalf("reopened node: %+v, %v", n2.Spec(), err)
				}
			}
			dir, _ := n.Dir("GPU-a")
			sd := sockDir(t)
			c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: container(t, n, "GPU-a"), SocketDir: sd})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			buf, err := c.Malloc(0, 40<<20)
			if err != nil {
				t.Fatal(err)
			}
			buf[123] = 45
			pid := os.Getpid()
			d := &fake.Driver{Node: n, SocketDir: sd, CallTimeout: 300 * time.Millisecond}
			if err := d.Lock(pid, time.Second); err != nil {
				t.Fatal(err)
			}
			if err := d.Checkpoint(pid); err != nil {
				t.Fatal(err)
			}
			other, err := fakecuda.InitWith(fakecuda.Options{DevRoot: container(t, n, "GPU-a"), SocketDir: sockDir(t)})
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close()
			taken, err := other.Malloc(0, 40<<20)
			if err != nil {
				t.Fatal(err)
			}
			before := memFiles(t, dir)

			if mode == fakecuda.FullHang {
				start := time.Now()
				err := d.Restore(pid, nil)
				if !errors.Is(err, gpu.ErrTimeout) || time.Since(start) > 5*time.Second {
					t.Fatalf("restore onto a full GPU that hangs: %v after %v, want ErrTimeout after the 300ms call timeout", err, time.Since(start))
				}
				if _, err := d.State(pid); !errors.Is(err, gpu.ErrTimeout) {
					t.Errorf("state while the restore hangs: %v, want ErrTimeout (the driver is stuck)", err)
				}
				if f := memFiles(t, dir); !slices.Equal(f, before) {
					t.Errorf("a hung restore placed memory: %v, before %v", f, before)
				}
				if used(t, n) != 40<<20 { // the accounting is not blocked by the hung restore
					t.Errorf("GPU used %d, want 40 MiB", used(t, n))
				}
				done := make(chan error, 1)
				go func() { done <- c.Close() }() // the process ends
				select {
				case <-done:
				case <-time.After(5 * time.Second):
					t.Fatal("Close did not end the hung restore")
				}
				return
			}

			err = d.Restore(pid, nil)
			if !errors.Is(err, gpu.ErrOutOfMemory) {
				t.Fatalf("restore onto a full GPU: %v, want ErrOutOfMemory", err)
			}
			for _, w := range []string{fmt.Sprintf("pid %d", pid), "restore", "GPU GPU-a", fmt.Sprintf("%d bytes needed", 40<<20),
				fmt.Sprintf("%d bytes free of %d", 24<<20, 64<<20), "state checkpointed"} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if strings.Count(err.Error(), "out of memory") != 1 {
				t.Errorf("error %q: want \"out of memory\" once", err)
			}
			if st, err := d.State(pid); err != nil || st != gpu.StateCheckpointed {
				t.Errorf("state after the refused restore: %v, %v; want checkpointed", st, err)
			}
			if f := memFiles(t, dir); !slices.Equal(f, before) {
				t.Errorf("a refused restore placed memory: %v, before %v", f, before)
			}
			if err := other.Free(taken); err != nil {
				t.Fatal(err)
			}
			if err := d.Restore(pid, nil); err != nil {
				t.Fatalf("restore once the GPU has room: %v", err)
			}
			if err := d.Unlock(pid); err != nil {
				t.Fatal(err)
			}
			if buf[123] != 45 {
				t.Error("data lost")
			}
		})
	}
}
