package gpu

import specs "github.com/opencontainers/runtime-spec/specs-go"

// Backend is what berth's shim needs from a node's GPUs: the checkpoint driver, the inventory,
// and the convention by which a container's OCI spec names its GPUs (NVIDIA_VISIBLE_DEVICES and
// /dev/nvidia* device nodes for real GPUs; BERTH_FAKE_GPUS and bind mounts for the fake).
type Backend interface {
	// Driver returns the CUDA checkpoint driver.
	Driver() Driver
	// Inventory returns the node's GPUs.
	Inventory() Inventory
	// ContainerGPUs returns the UUIDs of the GPUs spec gives the container, in the container's
	// device order; empty when it has none.
	ContainerGPUs(spec *specs.Spec) ([]string, error)
	// AdaptSpec rewrites spec so the container gets this node's GPUs that pairs map its
	// checkpointed GPUs to, at the same in-container paths (device nodes, mounts, env).
	AdaptSpec(spec *specs.Spec, pairs []UUIDPair) error
}
