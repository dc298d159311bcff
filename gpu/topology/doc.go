// Package topology is berth's one model of a GPU node's topology: the GPUs, the link between
// every pair of them (NVLink with its link count, or the PCIe relation that `nvidia-smi topo -m`
// reports), and each GPU's CPU and NUMA affinity. It also reads that model from the text of
// `nvidia-smi topo -m`, so that users and tests can load a node from a file.
//
// What belongs here: the types (Link, GPU, Topology), their validation, the ranking of links by
// bandwidth, the parser and printer of the `nvidia-smi topo -m` text, and the Linux list format of
// CPU and NUMA node ids ("0-55,112-167").
//
// What does not: reading the model from a live machine (NVML, sysfs) belongs to the GPU inventory
// package that wraps go-nvml behind cgo; choosing GPUs for a container belongs to
// nri/placement; CPU and memory topology (sockets, cores, SMT siblings, NUMA distances) belongs to
// the NRI plugin's node model. This package does no I/O beyond reading the io.Reader it is given,
// keeps no package-level mutable state and needs no cgo.
//
// Units: GPU indices are nvidia-smi's GPU indices (GPU0 is index 0); CPU ids are Linux logical
// CPU ids; NUMA node ids are Linux NUMA node ids.
package topology
