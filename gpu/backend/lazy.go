package backend

import (
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/nvidia"
	"github.com/berth-dev/berth/gpu/topology"
)

// OpenLazy is Open for a process that may never use its GPUs: for CUDA it returns at once a
// Backend that opens the CUDA driver and the inventory (Open, with openInventory) on its first
// call, not before. Every container has its own shim, and opening CUDA runs cuInit and loads
// libcuda (and, with nvml.OpenInventory, NVML) into the process, or starts the shim's inventory
// helper: a node's containers that never checkpoint or restore a GPU (most of them: sidecars,
// CPU workloads) would each pay that memory and start time. A failed open is not kept: the next
// call tries again (a driver that was still loading at boot), and until then every call returns
// Open's error. None and Fake open as Open does (the fake costs nothing to open); so do unknown
// names, whose error wraps ErrUnknown.
func OpenLazy(kind, fakeRoot string, openInventory InventoryOpener) (gpu.Backend, error) {
	if kind != CUDA {
		return Open(kind, fakeRoot, openInventory)
	}
	return newLazy(func() (gpu.Backend, error) { return Open(kind, fakeRoot, openInventory) }), nil
}

// lazy is a Backend opened by open on first use.
type lazy struct {
	open func() (gpu.Backend, error)
	mu   sync.Mutex
	b    gpu.Backend
}

func newLazy(open func() (gpu.Backend, error)) *lazy { return &lazy{open: open} }

// get returns the opened backend, opening it now if no call did yet.
func (l *lazy) get() (gpu.Backend, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.b != nil {
		return l.b, nil
	}
	b, err := l.open()
	if err != nil {
		return nil, err
	}
	l.b = b
	return b, nil
}

func (l *lazy) Driver() gpu.Driver       { return lazyDriver{l} }
func (l *lazy) Inventory() gpu.Inventory { return lazyInventory{l} }

// ContainerGPUs opens the backend only for a spec that names a GPU (nvidia.NamesGPUs): a CPU-only
// container checkpoints on a node whose driver cannot be opened (a CUDA node with a broken or
// missing driver once refused every checkpoint, not only its GPU containers').
func (l *lazy) ContainerGPUs(spec *specs.Spec) ([]string, error) {
	if !nvidia.NamesGPUs(spec) {
		return nil, nil
	}
	b, err := l.get()
	if err != nil {
		return nil, err
	}
	return b.ContainerGPUs(spec)
}

func (l *lazy) AdaptSpec(spec *specs.Spec, pairs []gpu.UUIDPair) error {
	b, err := l.get()
	if err != nil {
		return err
	}
	return b.AdaptSpec(spec, pairs)
}

// lazyDriver is the Driver of a lazy backend.
type lazyDriver struct{ l *lazy }

func (d lazyDriver) driver() (gpu.Driver, error) {
	b, err := d.l.get()
	if err != nil {
		return nil, err
	}
	return b.Driver(), nil
}

func (d lazyDriver) Versions() (gpu.Versions, error) {
	drv, err := d.driver()
	if err != nil {
		return gpu.Versions{}, err
	}
	return drv.Versions()
}

func (d lazyDriver) State(pid int) (gpu.ProcessState, error) {
	drv, err := d.driver()
	if err != nil {
		return 0, err
	}
	return drv.State(pid)
}

func (d lazyDriver) RestoreThreadID(pid int) (int, error) {
	drv, err := d.driver()
	if err != nil {
		return 0, err
	}
	return drv.RestoreThreadID(pid)
}

func (d lazyDriver) Lock(pid int, timeout time.Duration) error {
	drv, err := d.driver()
	if err != nil {
		return err
	}
	return drv.Lock(pid, timeout)
}

func (d lazyDriver) Checkpoint(pid int) error {
	drv, err := d.driver()
	if err != nil {
		return err
	}
	return drv.Checkpoint(pid)
}

func (d lazyDriver) Restore(pid int, pairs []gpu.UUIDPair) error {
	drv, err := d.driver()
	if err != nil {
		return err
	}
	return drv.Restore(pid, pairs)
}

func (d lazyDriver) Unlock(pid int) error {
	drv, err := d.driver()
	if err != nil {
		return err
	}
	return drv.Unlock(pid)
}

// lazyInventory is the Inventory of a lazy backend; it is a Topologist, answering "unknown" (nil)
// when the opened backend's inventory is not.
type lazyInventory struct{ l *lazy }

func (i lazyInventory) inventory() (gpu.Inventory, error) {
	b, err := i.l.get()
	if err != nil {
		return nil, err
	}
	return b.Inventory(), nil
}

func (i lazyInventory) Devices() ([]gpu.Device, error) {
	inv, err := i.inventory()
	if err != nil {
		return nil, err
	}
	return inv.Devices()
}

func (i lazyInventory) Versions() (gpu.Versions, error) {
	inv, err := i.inventory()
	if err != nil {
		return gpu.Versions{}, err
	}
	return inv.Versions()
}

func (i lazyInventory) ProcessMemory(pid int) (map[string]uint64, error) {
	inv, err := i.inventory()
	if err != nil {
		return nil, err
	}
	return inv.ProcessMemory(pid)
}

func (i lazyInventory) Topology() (*topology.Topology, error) {
	inv, err := i.inventory()
	if err != nil {
		return nil, err
	}
	if t, ok := inv.(gpu.Topologist); ok {
		return t.Topology()
	}
	return nil, nil
}
