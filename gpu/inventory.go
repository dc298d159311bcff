package gpu

import "github.com/berth-dev/berth/gpu/topology"

// Device is one GPU of a node, as an Inventory reports it.
type Device struct {
	// Index is the driver's device index (NVML index, /dev/nvidia<Minor>).
	Index int `json:"index"`
	// UUID is "GPU-<uuid>".
	UUID string `json:"uuid"`
	// Name is the model ("NVIDIA H200").
	Name string `json:"name"`
	// Arch is the architecture ("hopper"); ComputeCapability "9.0".
	Arch              string `json:"arch,omitempty"`
	ComputeCapability string `json:"computeCapability,omitempty"`
	// MemoryTotal and MemoryUsed are device memory in bytes.
	MemoryTotal uint64 `json:"memoryTotal"`
	MemoryUsed  uint64 `json:"memoryUsed"`
	// PCIBusID is the PCI address ("0000:18:00.0").
	PCIBusID string `json:"pciBusId,omitempty"`
	// NUMANode is the NUMA node id of the PCI device (sysfs numa_node), -1 when unknown.
	NUMANode int `json:"numaNode"`
	// CPUAffinity are the CPU ids close to the GPU.
	CPUAffinity []int `json:"cpuAffinity,omitempty"`
	// DevicePaths are the device nodes a container needs for this GPU ("/dev/nvidia0"), or for
	// the fake GPU its directory.
	DevicePaths []string `json:"devicePaths,omitempty"`
	// MIG and Persistence report MIG mode and persistence mode.
	MIG         bool `json:"mig"`
	Persistence bool `json:"persistence"`
}

// MemoryFree is MemoryTotal - MemoryUsed, in bytes.
func (d Device) MemoryFree() uint64 {
	if d.MemoryUsed > d.MemoryTotal {
		return 0
	}
	return d.MemoryTotal - d.MemoryUsed
}

// Inventory lists a node's GPUs and driver versions, and the device memory each process holds.
// Implementations: gpu/nvml (NVML) and gpu/fake.
//
// Per-process memory is part of the inventory, not of Driver: the CUDA driver's checkpoint API
// has no call for it, while NVML (the inventory of a real node) reports it for every process with
// a CUDA context (nvmlDeviceGetComputeRunningProcesses).
type Inventory interface {
	// Devices returns every GPU, in index order.
	Devices() ([]Device, error)
	// Versions returns the driver and CUDA driver versions.
	Versions() (Versions, error)
	// ProcessMemory returns the device memory host PID pid holds on each GPU, in bytes, keyed by
	// GPU UUID ("GPU-<uuid>"). A GPU on which the process has no context is absent; a process
	// without CUDA state gets an empty map and no error. The shim records the sum over a
	// container's processes at checkpoint (checkpoint.GPUDevice.MemoryUsed), so that a restore
	// refuses a GPU with less free memory. Errors wrap ErrUnsupported when the backend cannot
	// tell (NVML reports the value as not available), and name the GPU.
	ProcessMemory(pid int) (map[string]uint64, error)
}

// Topologist is an Inventory that also knows the links between the node's GPUs (gpu/nvml; the
// fake when its node lists links). The topology is indexed like Devices. A restore's device map
// keeps NVLink peers NVLink peers with it (gpu/devicemap); an Inventory without it maps by model
// and memory alone.
type Topologist interface {
	// Topology returns the links between the node's GPUs; nil (and no error) when unknown.
	Topology() (*topology.Topology, error)
}
