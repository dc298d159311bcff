// Package node is berth-nri's model of one node: its online CPUs (socket, core, SMT siblings,
// NUMA node), its NUMA nodes (CPUs, memory, distances) and its GPUs (the gpu/topology model:
// links and CPU/NUMA affinity, plus each GPU's identity from the gpu inventory types).
//
// Where the facts come from:
//   - CPUs and NUMA nodes: Linux sysfs under a configurable root (ReadSysfs): devices/system/cpu/online,
//     cpu<N>/topology/{physical_package_id,core_id,thread_siblings_list},
//     devices/system/node/{online,node<N>/cpulist,node<N>/distance,node<N>/meminfo}.
//   - GPUs: a *topology.Topology (from `nvidia-smi topo -m` text through topology.Parse, or an
//     inventory), joined to the CPUs with WithGPUs, which checks that the two agree.
//   - For `berthctl plan`, a node can also be synthesised from a topology alone (FromTopology).
//
// A Node is built once at start (and again when the inputs change), never inside an NRI request,
// and is immutable afterwards: it is safe to share between goroutines.
//
// What belongs here: reading and validating the model, and looking things up in it. What does not:
// which CPUs or GPUs are taken (nri/alloc), choosing GPU sets (nri/placement), NRI (nri/plugin).
//
// Units: CPU ids are Linux logical CPU ids (cpu<N> in sysfs); NUMA node ids are Linux NUMA node
// ids (node<N>); GPU indices are nvidia-smi indices; memory is in bytes.
package node
