package fake

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
)

// Backend is the fake GPU as a gpu.Backend for berth's shim: the node's fake GPUs (Node), the
// driver that talks to a process's fake CUDA context (Driver), and the container convention
// (BERTH_FAKE_GPUS and bind mounts at /dev/berth-gpu/<i>).
type Backend struct {
	Node *Node
	Drv  *Driver
}

// NewBackend opens the fake GPU node at root (see Open) and returns its backend; errors are
// Open's.
func NewBackend(root string) (*Backend, error) {
	n, err := Open(root)
	if err != nil {
		return nil, err
	}
	return &Backend{Node: n, Drv: &Driver{Node: n}}, nil
}

// Driver returns the fake checkpoint driver.
func (b *Backend) Driver() gpu.Driver { return b.Drv }

// Inventory returns the node's fake GPUs (Node: devices, versions and per-process memory as the
// driver accounts them).
func (b *Backend) Inventory() gpu.Inventory { return b.Node }

// ContainerGPUs returns the UUIDs in the spec's BERTH_FAKE_GPUS, in container order.
func (b *Backend) ContainerGPUs(spec *specs.Spec) ([]string, error) { return ContainerGPUs(spec) }

// AdaptSpec points the container's /dev/berth-gpu/<i> mounts at this node's mapped GPUs.
func (b *Backend) AdaptSpec(spec *specs.Spec, pairs []gpu.UUIDPair) error {
	return AdaptSpec(spec, b.Node, pairs)
}
