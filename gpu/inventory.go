package gpu

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

// Inventory lists a node's GPUs and driver versions.
type Inventory interface {
	// Devices returns every GPU, in index order.
	Devices() ([]Device, error)
	// Versions returns the driver and CUDA driver versions.
	Versions() (Versions, error)
}
