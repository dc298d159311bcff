// Package alloc is berth-nri's allocation state and placement policy: which container holds which
// CPUs and GPUs of a node (State), and where the next container goes (State.Allocate). It is pure:
// no I/O, no clock, no logging, no locking (the caller serialises calls; berth-nri holds one
// mutex around each decision and its commit).
//
// What belongs here: the Kubernetes Topology Manager policies, exclusive-CPU choice, the shared
// CPU pool, GPU bookkeeping, rebuilding the state from running containers, and the messages that
// explain a refusal in node terms. What does not: reading the node (nri/node), the GPU-set
// objective (nri/placement, which this package calls), or NRI messages (nri/plugin).
//
// # CPUs
//
// A container with ExclusiveCPUs > 0 (an integer CPU limit equal to its request) gets that many
// CPUs of its own. Whole cores are taken first, SMT siblings together, preferring CPUs in the
// CPU affinity of its GPUs, then CPUs of its GPUs' NUMA nodes, then lower ids; an odd remainder on
// an SMT machine takes one thread of a core whose other thread is already taken (or, failing that,
// splits a free core). Reserved CPUs are never given exclusively, and when no CPU is reserved
// one CPU always stays shared, so that containers without exclusive CPUs have somewhere to run.
//
// Every other container shares the pool: the CPUs no container holds exclusively (reserved CPUs
// included), restricted to the NUMA nodes it is aligned to (all of them when it is not aligned,
// or when its nodes' part of the pool is empty). When exclusive CPUs are taken or given back,
// Allocate and Release return Updates: the new cpuset of every shared container berth placed
// whose pool changed. Containers adopted without a berth placement are never updated.
//
// # Policies
//
// The policies mean what the Kubernetes Topology Manager's do. A request is aligned when it has
// exclusive CPUs or GPUs and the policy is not none; a NUMA-node set M is feasible when M's free
// resources hold the whole request (GPUs whose NUMA affinity lies inside M, exclusive CPUs of M,
// GPUs already chosen by someone else lie inside M), and preferred when no smaller set could
// hold the request even on an empty node.
//
//   - none: no alignment. GPUs are chosen by links alone, exclusive CPUs come from anywhere,
//     shared containers get the whole pool, and cpuset.mems is left as it is.
//   - best-effort: the best feasible set (below); admitted even when it is not preferred.
//   - restricted: only preferred feasible sets; otherwise the container is refused.
//   - single-numa-node: only feasible sets of one NUMA node; otherwise refused (also when the
//     request can never fit one NUMA node).
//
// Among the admissible sets the choice is, in order: the fastest slowest GPU pair that
// nri/placement finds inside the set; fewer NUMA nodes; smaller total NUMA distance inside the
// set; fewer free GPUs left unused inside the set (best fit, keeping GPU-rich nodes for GPU
// requests); fewer free exclusive CPUs inside the set (best fit); lower NUMA node ids. The GPUs
// are then nri/placement's choice inside the set, the CPUs as above inside the set, and
// cpuset.mems is the set. Node sets are enumerated exhaustively up to 8 NUMA nodes with CPUs;
// beyond that only single nodes, pairs and the whole node are considered.
//
// Memory is aligned, not sized: cpuset.mems is the chosen NUMA node set, and a container's memory
// limit is not checked against the nodes' MemTotal (the Kubernetes memory manager's job).
//
// GPUs that someone else chose (CDI, NVIDIA_VISIBLE_DEVICES, device nodes) are booked as given;
// the set must contain their NUMA nodes, and a warning says when a better-connected set of the
// same size exists on this node.
//
// Units: CPU ids are Linux logical CPU ids, NUMA node ids Linux NUMA node ids, GPU indices
// nvidia-smi indices; CPU amounts are whole CPUs or thousandths of a CPU (milli-CPUs) as named.
package alloc
