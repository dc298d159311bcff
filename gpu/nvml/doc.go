// Package nvml is berth's GPU inventory of a live node, read through NVIDIA's NVML
// (github.com/NVIDIA/go-nvml, which dlopens libnvidia-ml.so.1 at run time) and sysfs: every
// GPU as a gpu.Device, the driver and CUDA versions as gpu.Versions, and the links between GPUs
// as a gpu/topology.Topology (the same model `nvidia-smi topo -m` text is parsed into).
//
// What belongs here: the NVML calls and their translation into berth's types, NVLink counting
// (including NVSwitch boards, where the remote end of every link is a switch, not a GPU), the PCIe
// relation of GPU pairs (nvmlDeviceGetTopologyCommonAncestor), and the sysfs facts NVML does not
// give reliably (the NUMA node of a PCI device).
//
// What does not: the topology model and its parser (gpu/topology), choosing GPUs (nri), CUDA
// checkpointing (gpu/cuda).
//
// The shim does not link this package (go-nvml's bindings are linked whole, about 1.4 MB that
// every container's shim would keep resident): it reads the inventory from berth-shim-helper,
// which serves it with OpenInventory (package shim/helper, Inventory). berthctl and berth-nri
// open it in their own process.
//
// Only one file needs cgo (go-nvml): the logic sits behind the small Lib interface, so it is tested
// with a fake NVML anywhere, and without cgo Open returns an error wrapping gpu.ErrUnsupported
// while the rest of berth builds.
package nvml
