package backend

import (
	"errors"
	"fmt"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// stubBackend answers every call with fixed values; its inventory is a Topologist when topo is set.
type stubBackend struct{ topo *topology.Topology }

func (s stubBackend) Driver() gpu.Driver { return stubDriver{} }
func (s stubBackend) Inventory() gpu.Inventory {
	if s.topo != nil {
		return stubTopologist{t: s.topo}
	}
	return stubInventory{}
}
func (stubBackend) ContainerGPUs(*specs.Spec) ([]string, error) { return []string{"GPU-a"}, nil }
func (stubBackend) AdaptSpec(*specs.Spec, []gpu.UUIDPair) error { return nil }

type stubDriver struct{}

func (stubDriver) Versions() (gpu.Versions, error)      { return gpu.Versions{Driver: "580.65.06"}, nil }
func (stubDriver) State(int) (gpu.ProcessState, error)  { return gpu.StateLocked, nil }
func (stubDriver) RestoreThreadID(pid int) (int, error) { return pid + 1, nil }
func (stubDriver) Lock(int, time.Duration) error        { return nil }
func (stubDriver) Checkpoint(int) error                 { return nil }
func (stubDriver) Restore(int, []gpu.UUIDPair) error    { return nil }
func (stubDriver) Unlock(int) error                     { return nil }

type stubInventory struct{}

func (stubInventory) Devices() ([]gpu.Device, error)  { return []gpu.Device{{UUID: "GPU-a"}}, nil }
func (stubInventory) Versions() (gpu.Versions, error) { return gpu.Versions{CUDA: "12.8"}, nil }
func (stubInventory) ProcessMemory(int) (map[string]uint64, error) {
	return map[string]uint64{"GPU-a": 7}, nil
}

type stubTopologist struct {
	stubInventory
	t *topology.Topology
}

func (s stubTopologist) Topology() (*topology.Topology, error) { return s.t, nil }

// TestLazyOpensOnFirstUse: nothing is opened until a call needs the backend; a failed open is
// every call's error and is tried again by the next call; once open, the backend is kept.
func TestLazyOpensOnFirstUse(t *testing.T) {
	opens := 0
	fail := true
	l := newLazy(func() (gpu.Backend, error) {
		opens++
		if fail {
			return nil, fmt.Errorf("load CUDA driver library libcuda.so.1: %w", gpu.ErrUnsupported)
		}
		return stubBackend{}, nil
	})
	drv, inv := l.Driver(), l.Inventory()
	if opens != 0 {
		t.Fatalf("opened %d times before any call", opens)
	}
	if _, err := drv.Versions(); !errors.Is(err, gpu.ErrUnsupported) {
		t.Fatalf("Versions with the driver missing: %v", err)
	}
	if _, err := inv.Devices(); !errors.Is(err, gpu.ErrUnsupported) {
		t.Fatalf("Devices with the driver missing: %v", err)
	}
	gpuSpec := &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{{Path: "/dev/nvidia0"}}}}
	if _, err := l.ContainerGPUs(gpuSpec); !errors.Is(err, gpu.ErrUnsupported) {
		t.Fatalf("ContainerGPUs of a GPU container with the driver missing: %v", err)
	}
	// a CPU-only container needs no driver (issue 21: it once failed every checkpoint of a node
	// configured for CUDA whose driver could not be opened)
	if u, err := l.ContainerGPUs(&specs.Spec{Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=void"}}}); err != nil || u != nil {
		t.Fatalf("ContainerGPUs of a CPU-only container with the driver missing: %v %v", u, err)
	}
	if opens != 3 {
		t.Fatalf("%d opens for three failed calls, want 3 (a failed open is not kept)", opens)
	}
	fail = false
	if v, err := drv.Versions(); err != nil || v.Driver != "580.65.06" {
		t.Fatalf("Versions: %+v %v", v, err)
	}
	if tid, err := drv.RestoreThreadID(41); err != nil || tid != 42 {
		t.Fatalf("RestoreThreadID: %d %v", tid, err)
	}
	if st, err := drv.State(1); err != nil || st != gpu.StateLocked {
		t.Fatalf("State: %v %v", st, err)
	}
	if m, err := inv.ProcessMemory(1); err != nil || m["GPU-a"] != 7 {
		t.Fatalf("ProcessMemory: %v %v", m, err)
	}
	if u, err := l.ContainerGPUs(gpuSpec); err != nil || len(u) != 1 {
		t.Fatalf("ContainerGPUs: %v %v", u, err)
	}
	if opens != 4 {
		t.Fatalf("%d opens, want 4: the opened backend is kept", opens)
	}
	if topo, err := inv.(gpu.Topologist).Topology(); err != nil || topo != nil {
		t.Fatalf("Topology of an inventory without one: %v %v; want nil (unknown)", topo, err)
	}
	want := &topology.Topology{}
	withTopo := newLazy(func() (gpu.Backend, error) { return stubBackend{topo: want}, nil })
	if topo, err := withTopo.Inventory().(gpu.Topologist).Topology(); err != nil || topo != want {
		t.Fatalf("Topology: %v %v; want the opened inventory's", topo, err)
	}
}

// TestOpenLazy: CUDA opens nothing up front (this machine may have no libcuda); the other names
// behave as Open.
func TestOpenLazy(t *testing.T) {
	b, err := OpenLazy(CUDA, "", nil)
	if err != nil || b == nil {
		t.Fatalf("OpenLazy(cuda): %v %v; want a backend that opens on first use", b, err)
	}
	if _, ok := b.(*lazy); !ok {
		t.Fatalf("OpenLazy(cuda) is %T, not lazy", b)
	}
	if b, err := OpenLazy(None, "", nil); b != nil || err != nil {
		t.Fatalf("OpenLazy(none): %v %v", b, err)
	}
	if _, err := OpenLazy("tpu", "", nil); !errors.Is(err, ErrUnknown) {
		t.Fatalf("OpenLazy(tpu): %v", err)
	}
}
