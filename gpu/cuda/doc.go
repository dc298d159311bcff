// Package cuda is berth's gpu.Driver on a real NVIDIA GPU: the CUDA driver's process checkpoint
// API (cuCheckpointProcess*), called in libcuda.so.1, which is opened at run time with purego.
// Nothing here needs cgo or CUDA at build time; a node without the driver gets an error wrapping
// gpu.ErrUnsupported from Load.
//
// What belongs here: loading libcuda.so.1 and its symbols, the C structures the checkpoint API
// takes (laid out as NVIDIA's cuda.h declares them), the CUresult codes and their mapping onto
// gpu's sentinel errors, the node's driver version (from /proc/driver/nvidia/version) and the
// gating of what each driver version supports (API >= 570, GPU UUID remapping >= 580).
//
// What does not: which processes of a container to lock, the order of the steps around a CRIU
// dump and rollback (the shim), the GPU inventory (gpu/nvml), fakes (gpu/fake).
//
// cuInit is called once, in Load; every later call goes straight to the checkpoint entry point,
// so a step costs only the driver's own work (an exec of NVIDIA's cuda-checkpoint tool pays a
// cuInit, about 2.7 s, every time). The library stays loaded for the life of the process.
package cuda
