package fakecuda_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

// node sets up a fake GPU root under dir with the given driver and GPUs.
func node(t *testing.T, dir, driver string, uuids ...string) *fake.Node {
	t.Helper()
	spec := fake.NodeSpec{Driver: driver, CUDA: "12.8"}
	for _, u := range uuids {
		spec.GPUs = append(spec.GPUs, fake.GPUSpec{UUID: u, Name: "Fake H200", MemoryBytes: 64 << 20})
	}
	n, err := fake.Setup(dir, spec)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// devRoot makes a container view of n's GPUs uuids (symlinks standing in for bind mounts).
func devRoot(t *testing.T, n *fake.Node, uuids ...string) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "berth-gpu")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, u := range uuids {
		dir, err := n.Dir(u)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(dir, filepath.Join(root, fake.ContainerDevicePath(i)[len(fake.DevRoot)+1:])); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// sockDir returns a short directory for control sockets (sockaddr_un holds 108 bytes).
func sockDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "fc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func initCtx(t *testing.T, devRoot string) *fakecuda.Context {
	t.Helper()
	c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: devRoot, SocketDir: sockDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func memFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, fakecuda.MemPrefix+"*"))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// mapping returns the /proc/self/maps line of the mapping that holds p.
func mapping(t *testing.T, p []byte) string {
	t.Helper()
	addr := uintptr(unsafe.Pointer(&p[0]))
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		var lo, hi uintptr
		if _, err := fmtSscanf(l, &lo, &hi); err == nil && lo <= addr && addr < hi {
			return l
		}
	}
	t.Fatalf("no mapping holds %#x", addr)
	return ""
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
}

func TestStateMachine(t *testing.T) {
	type op struct {
		name string
		do   func(c *fakecuda.Context) error
	}
	lock := op{"lock", func(c *fakecuda.Context) error { return c.Lock(time.Second) }}
	ckpt := op{"checkpoint", (*fakecuda.Context).Checkpoint}
	rest := op{"restore", func(c *fakecuda.Context) error { return c.Restore(nil, "") }}
	unlock := op{"unlock", (*fakecuda.Context).Unlock}
	// reach puts a fresh context into a state.
	reach := map[gpu.ProcessState][]op{
		gpu.StateRunning:      nil,
		gpu.StateLocked:       {lock},
		gpu.StateCheckpointed: {lock, ckpt},
	}
	tests := []struct {
		from    gpu.ProcessState
		op      op
		wantErr bool
		want    gpu.ProcessState
	}{
		{gpu.StateRunning, lock, false, gpu.StateLocked},
		{gpu.StateRunning, ckpt, true, gpu.StateRunning},
		{gpu.StateRunning, rest, true, gpu.StateRunning},
		{gpu.StateRunning, unlock, true, gpu.StateRunning},
		{gpu.StateLocked, lock, true, gpu.StateLocked},
		{gpu.StateLocked, ckpt, false, gpu.StateCheckpointed},
		{gpu.StateLocked, rest, true, gpu.StateLocked},
		{gpu.StateLocked, unlock, false, gpu.StateRunning},
		{gpu.StateCheckpointed, lock, true, gpu.StateCheckpointed},
		{gpu.StateCheckpointed, ckpt, true, gpu.StateCheckpointed},
		{gpu.StateCheckpointed, rest, false, gpu.StateLocked},
		{gpu.StateCheckpointed, unlock, true, gpu.StateCheckpointed}, // unlock before restore
		{gpu.StateFailed, lock, true, gpu.StateFailed},
		{gpu.StateFailed, ckpt, true, gpu.StateFailed},
		{gpu.StateFailed, rest, true, gpu.StateFailed},
		{gpu.StateFailed, unlock, true, gpu.StateFailed},
	}
	for _, tt := range tests {
		t.Run(tt.from.String()+"/"+tt.op.name, func(t *testing.T) {
			n := node(t, t.TempDir(), "580.65.06", "GPU-a")
			c := initCtx(t, devRoot(t, n, "GPU-a"))
			buf, err := c.Malloc(0, 4096)
			if err != nil {
				t.Fatal(err)
			}
			fill(buf, 1)
			if tt.from == gpu.StateFailed {
				// A restore onto a node without the GPU fails the context.
				if err := c.Lock(time.Second); err != nil {
					t.Fatal(err)
				}
				if err := c.Checkpoint(); err != nil {
					t.Fatal(err)
				}
				c.SetDevRoot(t.TempDir())
				if err := c.Restore(nil, ""); err == nil || !strings.Contains(err.Error(), "GPU-a") {
					t.Fatalf("restore without the GPU: %v, want an error naming GPU-a", err)
				}
			}
			for _, o := range reach[tt.from] {
				if err := o.do(c); err != nil {
					t.Fatalf("reaching %s: %s: %v", tt.from, o.name, err)
				}
			}
			if got := c.State(); got != tt.from {
				t.Fatalf("state %s, want %s", got, tt.from)
			}
			err = tt.op.do(c)
			if (err != nil) != tt.wantErr {
				t.Fatalf("%s in %s: err %v, wantErr %v", tt.op.name, tt.from, err, tt.wantErr)
			}
			if err != nil && tt.from != gpu.StateFailed && !strings.Contains(err.Error(), "in state "+tt.from.String()) {
				t.Errorf("error %q does not name the state", err)
			}
			if got := c.State(); got != tt.want {
				t.Errorf("state after %s: %s, want %s", tt.op.name, got, tt.want)
			}
			if tt.from == gpu.StateFailed {
				if err := c.Do(func() {}); !errors.Is(err, fakecuda.ErrFailed) {
					t.Errorf("Do in failed: %v, want ErrFailed", err)
				}
				return
			}
			// Whatever happened, the data is intact.
			want := make([]byte, 4096)
			fill(want, 1)
			if !bytes.Equal(buf, want) {
				t.Errorf("device memory changed")
			}
		})
	}
}

func TestLockTimeoutAndBlocking(t *testing.T) {
	n := node(t, t.TempDir(), "580.65.06", "GPU-a")
	c := initCtx(t, devRoot(t, n, "GPU-a"))

	// A Do that outlasts the lock's timeout: the lock times out and the context stays RUNNING.
	release := make(chan struct{})
	started := make(chan struct{})
	go c.Do(func() { close(started); <-release })
	<-started
	t0 := time.Now()
	err := c.Lock(50 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "still running") {
		t.Fatalf("lock while busy: %v, want a timeout", err)
	}
	if d := time.Since(t0); d < 50*time.Millisecond || d > 2*time.Second {
		t.Errorf("lock returned after %v, want about 50ms", d)
	}
	if s := c.State(); s != gpu.StateRunning {
		t.Fatalf("state after timeout %s, want running", s)
	}
	// New work is not blocked after a failed lock.
	if err := c.Do(func() {}); err != nil {
		t.Fatal(err)
	}
	close(release)

	// A lock waits for in-flight work that ends within its timeout.
	release2 := make(chan struct{})
	started2 := make(chan struct{})
	go c.Do(func() { close(started2); <-release2 })
	<-started2
	time.AfterFunc(50*time.Millisecond, func() { close(release2) })
	if err := c.Lock(5 * time.Second); err != nil {
		t.Fatalf("lock: %v", err)
	}

	// While LOCKED and CHECKPOINTED, Do and Malloc block; after Unlock they run.
	var ran atomic.Int32
	go func() {
		_ = c.Do(func() { ran.Add(1) })
	}()
	go func() {
		if _, err := c.Malloc(0, 100); err == nil {
			ran.Add(1)
		}
	}()
	if err := c.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if ran.Load() != 0 {
		t.Fatalf("GPU work ran while locked")
	}
	if err := c.Restore(nil, ""); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if ran.Load() != 0 {
		t.Fatalf("GPU work ran while locked after restore")
	}
	if err := c.Unlock(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for ran.Load() != 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if ran.Load() != 2 {
		t.Fatalf("blocked work did not run after unlock (%d of 2)", ran.Load())
	}
}

func TestCheckpointRestoreSameGPU(t *testing.T) {
	n := node(t, t.TempDir(), "580.65.06", "GPU-a")
	dir, _ := n.Dir("GPU-a")
	c := initCtx(t, devRoot(t, n, "GPU-a"))
	buf, err := c.Malloc(0, 3<<20+5)
	if err != nil {
		t.Fatal(err)
	}
	fill(buf, 9)
	want := bytes.Clone(buf)
	addr := &buf[0]
	if m := mapping(t, buf); !strings.Contains(m, dir) || !strings.Contains(m, " rw-s ") {
		t.Fatalf("device memory is not a shared mapping of a file in %s: %s", dir, m)
	}
	devs, _ := n.Devices()
	if devs[0].MemoryUsed < 3<<20 {
		t.Errorf("MemoryUsed %d, want >= 3 MiB", devs[0].MemoryUsed)
	}
	if u := c.Usage(); u["GPU-a"] != devs[0].MemoryUsed {
		t.Errorf("Usage %v, node counts %d", u, devs[0].MemoryUsed)
	}

	if err := c.Lock(time.Second); err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	if f := memFiles(t, dir); len(f) != 0 {
		t.Errorf("memory files after checkpoint: %v", f)
	}
	if m := mapping(t, buf); strings.Contains(m, dir) || !strings.Contains(m, " rw-p ") {
		t.Errorf("checkpointed memory is not private anonymous: %s", m)
	}
	if !bytes.Equal(buf, want) {
		t.Fatalf("data changed by checkpoint")
	}
	if devs, _ := n.Devices(); devs[0].MemoryUsed != 0 {
		t.Errorf("device memory not freed: %d", devs[0].MemoryUsed)
	}

	if err := c.Restore(nil, ""); err != nil {
		t.Fatal(err)
	}
	if &buf[0] != addr {
		t.Fatalf("pointer moved")
	}
	if !bytes.Equal(buf, want) {
		t.Fatalf("data changed by restore")
	}
	files := memFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("memory files after restore: %v", files)
	}
	buf[17] ^= 0xff // writes reach the device file
	onDev, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDev[:len(buf)], buf) {
		t.Errorf("device file does not hold the buffer")
	}
	if err := c.Unlock(); err != nil {
		t.Fatal(err)
	}
	if err := c.Do(func() { buf[0]++ }); err != nil {
		t.Fatal(err)
	}
	if err := c.Free(buf); err != nil {
		t.Fatal(err)
	}
	if f := memFiles(t, dir); len(f) != 0 {
		t.Errorf("memory files after free: %v", f)
	}
}

func TestRestoreOtherNode(t *testing.T) {
	tests := []struct {
		name      string
		dstDriver string
		dstGPUs   []string
		pairs     []gpu.UUIDPair
		wantCode  string // "" success
		wantState gpu.ProcessState
		wantUUIDs []string
	}{
		{"same uuid on the other node", "580.65.06", []string{"GPU-a", "GPU-b"}, nil, "", gpu.StateLocked, []string{"GPU-a", "GPU-b"}},
		{"remapped", "580.65.06", []string{"GPU-c", "GPU-d"}, []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-d"}, {Old: "GPU-b", New: "GPU-c"}}, "", gpu.StateLocked, []string{"GPU-d", "GPU-c"}},
		{"missing gpu fails", "580.65.06", []string{"GPU-c", "GPU-d"}, nil, "GPU-a", gpu.StateFailed, nil},
		{"remap on 570 unsupported", "570.86.10", []string{"GPU-c", "GPU-d"}, []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-c"}, {Old: "GPU-b", New: "GPU-d"}}, "driver >= 580", gpu.StateCheckpointed, nil},
		{"identity pairs on 570", "570.86.10", []string{"GPU-a", "GPU-b"}, []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-a"}}, "", gpu.StateLocked, []string{"GPU-a", "GPU-b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := node(t, t.TempDir(), "580.65.06", "GPU-a", "GPU-b")
			c := initCtx(t, devRoot(t, src, "GPU-a", "GPU-b"))
			b0, err := c.Malloc(0, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			b1, err := c.Malloc(1, 8192)
			if err != nil {
				t.Fatal(err)
			}
			fill(b0, 1)
			fill(b1, 2)
			w0, w1 := bytes.Clone(b0), bytes.Clone(b1)
			if err := c.Lock(time.Second); err != nil {
				t.Fatal(err)
			}
			if err := c.Checkpoint(); err != nil {
				t.Fatal(err)
			}
			// Move: the destination node's GPUs are mounted in the order the device map gives.
			dst := node(t, t.TempDir(), tt.dstDriver, tt.dstGPUs...)
			order := tt.dstGPUs
			if tt.wantUUIDs != nil {
				order = tt.wantUUIDs
			}
			c.SetDevRoot(devRoot(t, dst, order...))
			err = c.Restore(tt.pairs, "")
			if tt.wantCode == "" && err != nil {
				t.Fatal(err)
			}
			if tt.wantCode != "" && (err == nil || !strings.Contains(err.Error(), tt.wantCode)) {
				t.Fatalf("restore: %v, want an error with %q", err, tt.wantCode)
			}
			if s := c.State(); s != tt.wantState {
				t.Fatalf("state %s, want %s", s, tt.wantState)
			}
			if err != nil {
				return
			}
			if got := c.UUIDs(); strings.Join(got, ",") != strings.Join(tt.wantUUIDs, ",") {
				t.Errorf("UUIDs %v, want %v", got, tt.wantUUIDs)
			}
			if !bytes.Equal(b0, w0) || !bytes.Equal(b1, w1) {
				t.Fatalf("data lost")
			}
			for i, b := range [][]byte{b0, b1} {
				d, _ := dst.Dir(tt.wantUUIDs[i])
				if m := mapping(t, b); !strings.Contains(m, d) {
					t.Errorf("buffer %d not on %s: %s", i, d, m)
				}
			}
			sd, _ := src.Dir("GPU-a")
			if f := memFiles(t, sd); len(f) != 0 {
				t.Errorf("source node still holds %v", f)
			}
		})
	}
}

func TestMallocLimits(t *testing.T) {
	n := node(t, t.TempDir(), "580.65.06", "GPU-a")
	c := initCtx(t, devRoot(t, n, "GPU-a"))
	if _, err := c.Malloc(0, 60<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Malloc(0, 8<<20); err == nil || !strings.Contains(err.Error(), "out of memory") {
		t.Errorf("over the GPU's memory: %v", err)
	}
	if _, err := c.Malloc(1, 1); err == nil {
		t.Errorf("device 1 of 1: no error")
	}
	if _, err := c.Malloc(0, 0); err == nil {
		t.Errorf("0 bytes: no error")
	}
	if _, err := fakecuda.InitWith(fakecuda.Options{DevRoot: t.TempDir(), SocketDir: sockDir(t)}); err == nil {
		t.Errorf("Init without GPUs: no error")
	}
}

// TestOutOfMemory checks the refusals of a full GPU, as cudaMalloc and the checkpoint API's
// restore give them: errors.Is gpu.ErrOutOfMemory, naming the GPU, the bytes requested (needed)
// and the bytes free; a refused restore places nothing and leaves the context CHECKPOINTED, and
// succeeds once the memory is free. Concurrent allocations never over-commit the GPU.
func TestOutOfMemory(t *testing.T) {
	n := node(t, t.TempDir(), "580.65.06", "GPU-a", "GPU-b") // 64 MiB each
	a := initCtx(t, devRoot(t, n, "GPU-a", "GPU-b"))
	b := initCtx(t, devRoot(t, n, "GPU-a", "GPU-b"))
	if _, err := a.Malloc(0, 50<<20); err != nil {
		t.Fatal(err)
	}
	_, err := b.Malloc(0, 20<<20+1)
	if !errors.Is(err, gpu.ErrOutOfMemory) {
		t.Fatalf("malloc beyond the free memory: %v, want ErrOutOfMemory", err)
	}
	for _, w := range []string{"GPU GPU-a", "20971521 bytes requested", "14680064 bytes free of 67108864"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("malloc error %q does not say %q", err, w)
		}
	}

	// a's 50 MiB on GPU-a, checkpointed, then restored onto GPU-b where b took 20 MiB
	if err := a.Lock(time.Second); err != nil {
		t.Fatal(err)
	}
	if err := a.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	bb, err := b.Malloc(1, 20<<20)
	if err != nil {
		t.Fatal(err)
	}
	dirB, _ := n.Dir("GPU-b")
	before := memFiles(t, dirB)
	err = a.Restore([]gpu.UUIDPair{{Old: "GPU-a", New: "GPU-b"}}, "")
	if !errors.Is(err, gpu.ErrOutOfMemory) {
		t.Fatalf("restore onto a GPU without room: %v, want ErrOutOfMemory", err)
	}
	for _, w := range []string{"GPU GPU-b (checkpointed on GPU-a)", fmt.Sprintf("%d bytes needed", 50<<20), fmt.Sprintf("%d bytes free of %d", 44<<20, 64<<20)} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("restore error %q does not say %q", err, w)
		}
	}
	if s := a.State(); s != gpu.StateCheckpointed {
		t.Errorf("state after a refused restore %s, want checkpointed", s)
	}
	if f := memFiles(t, dirB); len(f) != len(before) {
		t.Errorf("a refused restore placed memory: %v", f)
	}
	if err := b.Free(bb); err != nil {
		t.Fatal(err)
	}
	if err := a.Restore([]gpu.UUIDPair{{Old: "GPU-a", New: "GPU-b"}}, ""); err != nil {
		t.Fatalf("restore once GPU-b has room: %v", err)
	}

	// Racing allocations of 1 MiB from 4 contexts on GPU-b, where a's 50 MiB leave 14 MiB free:
	// exactly 14 succeed.
	var ctxs []*fakecuda.Context
	for range 4 {
		ctxs = append(ctxs, initCtx(t, devRoot(t, n, "GPU-b")))
	}
	var ok atomic.Int32
	done := make(chan struct{})
	for _, c := range ctxs {
		go func() {
			defer func() { done <- struct{}{} }()
			for range 10 {
				if _, err := c.Malloc(0, 1<<20); err == nil {
					ok.Add(1)
				} else if !errors.Is(err, gpu.ErrOutOfMemory) {
					t.Error(err)
				}
			}
		}()
	}
	for range ctxs {
		<-done
	}
	if got := ok.Load(); got != 14 {
		t.Errorf("%d racing 1 MiB allocations succeeded on a GPU with 14 MiB free, want 14", got)
	}
	if devs, _ := n.Devices(); devs[1].MemoryUsed != 64<<20 {
		t.Errorf("GPU-b used %d, want all of it", devs[1].MemoryUsed)
	}
}

func TestIsProcessFile(t *testing.T) {
	for name, want := range map[string]bool{
		"mem-12-0a1b2c3d-1": true, "mem-1-x-1": false, "mem-fill": false, "mem-12-0a1b2c3d-": false, "uuid": false,
	} {
		if got := fakecuda.IsProcessFile(name); got != want {
			t.Errorf("IsProcessFile(%q) = %v", name, got)
		}
	}
}
