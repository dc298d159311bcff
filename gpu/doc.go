// Package gpu holds berth's GPU domain types: the CUDA checkpoint driver contract (Driver), the
// GPU inventory of a node (Inventory, Device, and each process's device memory), the backend that
// ties a driver, an inventory and a container convention together (Backend), the device map used
// on restore, and the errors that name what a driver or a node lacks. Implementations live in
// sub-packages: gpu/backend (the one switch that opens a backend by name), gpu/cuda (the CUDA
// driver's checkpoint API, loaded from libcuda.so.1 at run time), gpu/nvml (inventory and
// per-process memory through NVML, the only package that needs cgo), gpu/nvidia (the NVIDIA
// container convention), gpu/fake (a faithful fake GPU for machines without one), gpu/topology
// (the node topology model and the nvidia-smi topo -m parser).
//
// What does not belong here: containerd, CRIU, placement policy.
package gpu
