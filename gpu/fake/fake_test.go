package fake_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

func spec(driver string, uuids ...string) fake.NodeSpec {
	s := fake.NodeSpec{Driver: driver, CUDA: "12.8"}
	for _, u := range uuids {
		s.GPUs = append(s.GPUs, fake.GPUSpec{UUID: u, Name: "Fake H200", MemoryBytes: 1 << 30})
	}
	return s
}

func setup(t *testing.T, driver string, uuids ...string) *fake.Node {
	t.Helper()
	n, err := fake.Setup(t.TempDir(), spec(driver, uuids...))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestSetupOpenInventory(t *testing.T) {
	n := setup(t, "580.65.06", "GPU-a", "GPU-b")
	n2, err := fake.Open(n.Root())
	if err != nil {
		t.Fatal(err)
	}
	v, err := n2.Versions()
	if err != nil || v != (gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}) {
		t.Fatalf("Versions = %+v, %v", v, err)
	}
	if err := os.WriteFile(filepath.Join(n.Root(), "GPU-b", "mem-1-x-1"), make([]byte, 12345), 0o600); err != nil {
		t.Fatal(err)
	}
	devs, err := n2.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 2 || devs[0].UUID != "GPU-a" || devs[1].Index != 1 || devs[1].MemoryUsed != 12345 ||
		devs[0].MemoryUsed != 0 || devs[1].MemoryTotal != 1<<30 || devs[1].MemoryFree() != 1<<30-12345 ||
		devs[0].Name != "Fake H200" || devs[0].DevicePaths[0] != filepath.Join(n.Root(), "GPU-a") {
		t.Errorf("Devices = %+v", devs)
	}
	for _, name := range []string{fakecuda.UUIDFile, fakecuda.MemoryFile, fakecuda.DriverFile} {
		if _, err := os.Stat(filepath.Join(n.Root(), "GPU-a", name)); err != nil {
			t.Error(err)
		}
	}

	bad := []struct {
		name string
		spec fake.NodeSpec
	}{
		{"bad driver", spec("x", "GPU-a")},
		{"bad uuid", spec("580.1", "a")},
		{"slash in uuid", spec("580.1", "GPU-a/b")},
		{"duplicate", spec("580.1", "GPU-a", "GPU-a")},
		{"restoreWhenFull", func() fake.NodeSpec { s := spec("580.1", "GPU-a"); s.RestoreWhenFull = "wait"; return s }()},
	}
	for _, tt := range bad {
		if _, err := fake.Setup(t.TempDir(), tt.spec); err == nil {
			t.Errorf("%s: Setup succeeded", tt.name)
		}
	}
	if _, err := fake.Open(t.TempDir()); err == nil {
		t.Errorf("Open of an empty dir succeeded")
	}
}

func TestContainerMountsAndAdaptSpec(t *testing.T) {
	n1 := setup(t, "580.65.06", "GPU-a", "GPU-b")
	n2 := setup(t, "580.65.06", "GPU-c", "GPU-a")
	mounts, env, err := fake.ContainerMounts(n1, []string{"GPU-b", "GPU-a"})
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) != 2 || mounts[0].Destination != "/dev/berth-gpu/0" || mounts[0].Source != filepath.Join(n1.Root(), "GPU-b") ||
		mounts[1].Destination != "/dev/berth-gpu/1" || mounts[0].Type != "bind" {
		t.Errorf("mounts = %+v", mounts)
	}
	if !slices.Equal(env, []string{"BERTH_FAKE_GPUS=GPU-b,GPU-a"}) {
		t.Errorf("env = %v", env)
	}
	if _, _, err := fake.ContainerMounts(n1, []string{"GPU-z"}); err == nil || !strings.Contains(err.Error(), "GPU-z") {
		t.Errorf("unknown GPU: %v", err)
	}
	if _, _, err := fake.ContainerMounts(n1, []string{"GPU-a", "GPU-a"}); err == nil {
		t.Errorf("duplicate GPU: no error")
	}

	newSpec := func() *specs.Spec {
		return &specs.Spec{
			Process: &specs.Process{Env: append([]string{"PATH=/bin"}, env...)},
			Mounts:  append([]specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}}, mounts...),
		}
	}
	if got, err := fake.ContainerGPUs(newSpec()); err != nil || !slices.Equal(got, []string{"GPU-b", "GPU-a"}) {
		t.Errorf("ContainerGPUs = %v, %v", got, err)
	}
	if got, err := fake.ContainerGPUs(&specs.Spec{Process: &specs.Process{}}); err != nil || got != nil {
		t.Errorf("ContainerGPUs of a spec without GPUs = %v, %v", got, err)
	}

	tests := []struct {
		name    string
		pairs   []gpu.UUIDPair
		want    []string // sources in order, as UUIDs of n2
		wantErr string
	}{
		{"remap b to c, a stays", []gpu.UUIDPair{{Old: "GPU-b", New: "GPU-c"}}, []string{"GPU-c", "GPU-a"}, ""},
		{"missing b", nil, nil, "GPU-b"},
		{"map to missing", []gpu.UUIDPair{{Old: "GPU-b", New: "GPU-x"}}, nil, "GPU-x"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newSpec()
			err := fake.AdaptSpec(s, n2, tt.pairs)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("AdaptSpec: %v, want an error naming %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i, u := range tt.want {
				m := s.Mounts[i+1]
				if m.Destination != fake.ContainerDevicePath(i) || m.Source != filepath.Join(n2.Root(), u) {
					t.Errorf("mount %d = %+v, want %s", i, m, u)
				}
			}
			if len(s.Mounts) != 3 {
				t.Errorf("mounts = %+v", s.Mounts)
			}
			if got, _ := fake.ContainerGPUs(s); !slices.Equal(got, tt.want) {
				t.Errorf("env GPUs %v, want %v", got, tt.want)
			}
		})
	}
}

// sockDir returns a short directory for control sockets.
func sockDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "fc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// container makes a container view of n's GPUs (symlinks standing in for bind mounts).
func container(t *testing.T, n *fake.Node, uuids ...string) string {
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
		if err := os.Symlink(dir, filepath.Join(root, strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestDriverOverSocket(t *testing.T) {
	n := setup(t, "580.65.06", "GPU-a")
	sd := sockDir(t)
	c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: container(t, n, "GPU-a"), SocketDir: sd})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf, err := c.Malloc(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	buf[5] = 42
	d := &fake.Driver{Node: n, SocketDir: sd}
	pid := os.Getpid()

	if v, err := d.Versions(); err != nil || v.DriverMajor != 580 {
		t.Fatalf("Versions = %+v, %v", v, err)
	}
	tid, err := d.RestoreThreadID(pid)
	if err != nil || tid <= 0 {
		t.Fatalf("RestoreThreadID = %d, %v", tid, err)
	}
	if _, err := os.Stat("/proc/self/task/" + strconv.Itoa(tid)); err != nil {
		t.Errorf("restore thread %d is not a thread of this process: %v", tid, err)
	}
	if u, err := d.Usage(pid); err != nil || u["GPU-a"] != 1<<20 {
		t.Errorf("Usage = %v, %v", u, err)
	}
	inv := (&fake.Backend{Node: n, Drv: d}).Inventory() // the contract's per-process memory
	if u, err := inv.ProcessMemory(pid); err != nil || len(u) != 1 || u["GPU-a"] != 1<<20 {
		t.Errorf("ProcessMemory = %v, %v", u, err)
	}
	steps := []struct {
		name    string
		do      func() error
		wantErr error
		want    gpu.ProcessState
	}{
		{"unlock while running", func() error { return d.Unlock(pid) }, gpu.ErrIllegalState, gpu.StateRunning},
		{"lock", func() error { return d.Lock(pid, time.Second) }, nil, gpu.StateLocked},
		{"restore while locked", func() error { return d.Restore(pid, nil) }, gpu.ErrIllegalState, gpu.StateLocked},
		{"checkpoint", func() error { return d.Checkpoint(pid) }, nil, gpu.StateCheckpointed},
		{"unlock before restore", func() error { return d.Unlock(pid) }, gpu.ErrIllegalState, gpu.StateCheckpointed},
		{"restore", func() error { return d.Restore(pid, nil) }, nil, gpu.StateLocked},
		{"unlock", func() error { return d.Unlock(pid) }, nil, gpu.StateRunning},
	}
	for _, s := range steps {
		err := s.do()
		if !errors.Is(err, s.wantErr) || (s.wantErr == nil) != (err == nil) {
			t.Fatalf("%s: %v, want %v", s.name, err, s.wantErr)
		}
		if err != nil && (!strings.Contains(err.Error(), "pid "+strconv.Itoa(pid)) || !strings.Contains(err.Error(), strings.Fields(s.name)[0])) {
			t.Errorf("%s: error %q does not name the pid and step", s.name, err)
		}
		if st, err := d.State(pid); err != nil || st != s.want {
			t.Fatalf("after %s: state %v, %v, want %v", s.name, st, err, s.want)
		}
	}
	if buf[5] != 42 {
		t.Fatalf("data lost")
	}

	// A lock that cannot complete in time.
	release := make(chan struct{})
	started := make(chan struct{})
	go c.Do(func() { close(started); <-release })
	<-started
	if err := d.Lock(pid, 30*time.Millisecond); !errors.Is(err, gpu.ErrTimeout) {
		t.Errorf("busy lock: %v, want ErrTimeout", err)
	}
	close(release)

	// Remapping needs driver >= 580; the checkpoint API needs >= 570.
	old := setup(t, "570.86.10", "GPU-a")
	if err := (&fake.Driver{Node: old, SocketDir: sd}).Restore(pid, []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-b"}}); !errors.Is(err, gpu.ErrUnsupported) {
		t.Errorf("remap on 570: %v, want ErrUnsupported", err)
	}
	older := setup(t, "550.1", "GPU-a")
	if _, err := (&fake.Driver{Node: older, SocketDir: sd}).State(pid); !errors.Is(err, gpu.ErrUnsupported) {
		t.Errorf("state on 550: %v, want ErrUnsupported", err)
	}

	// A process without a control socket is not a CUDA process.
	cmd := exec.Command("sleep", "10")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if _, err := d.State(cmd.Process.Pid); !errors.Is(err, gpu.ErrNotCUDA) {
		t.Errorf("sleep: %v, want ErrNotCUDA", err)
	}
	if u, err := inv.ProcessMemory(cmd.Process.Pid); err != nil || len(u) != 0 {
		t.Errorf("ProcessMemory(sleep) = %v, %v; want no memory, no error", u, err)
	}
	if _, err := d.State(1 << 30); !errors.Is(err, gpu.ErrNotCUDA) {
		t.Errorf("no such pid: %v, want ErrNotCUDA", err)
	}
	// A closed context's stale socket path is not a CUDA process either.
	c2dir := sockDir(t)
	if err := os.WriteFile(filepath.Join(c2dir, strconv.Itoa(pid)+".sock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := (&fake.Driver{SocketDir: c2dir}).State(pid); !errors.Is(err, gpu.ErrNotCUDA) {
		t.Errorf("stale socket: %v, want ErrNotCUDA", err)
	}
}

func TestNSPid(t *testing.T) {
	if got, err := fake.NSPid(os.Getpid()); err != nil || got != os.Getpid() {
		t.Errorf("NSPid(self) = %d, %v", got, err)
	}
}
