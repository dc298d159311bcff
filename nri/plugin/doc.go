// Package plugin is berth-nri, the NRI plugin that places each CRI container on NUMA-aligned
// CPUs and memory and link-adjacent GPUs: NRI events in, container adjustments out. It turns an
// NRI container into an alloc.Request (annotations, CPU quota and period, GPUs already in the
// spec), asks nri/alloc under one mutex, and answers with cpuset.cpus, cpuset.mems, the GPUs (CDI
// devices, or device nodes and NVIDIA_VISIBLE_DEVICES) and the annotation berth.dev/placement.
//
// What belongs here: one small method per NRI event (Synchronize, CreateContainer,
// StopContainer, RemoveContainer), the annotations' syntax, reading GPUs out of a container,
// building adjustments, the configuration, the Prometheus metrics and their HTTP server
// (ServeMetrics), and Run, which loads the node model and keeps the plugin connected. What does not: the policy (nri/alloc), the GPU-set objective (nri/placement),
// the node model (nri/node).
//
// # Annotations
//
//   - berth.dev/gpus: "N", a whole number of GPUs berth chooses and injects ("0": none).
//   - berth.dev/numa-policy: none, best-effort, restricted or single-numa-node.
//   - berth.dev/placement: written by berth-nri on every container it places (JSON: cpus,
//     exclusive, mems, numa, gpus, uuids, chosen, policy, aligned, reason); read back by
//     Synchronize so a restarted plugin rebuilds its state without re-pinning anything.
//
// The first two are looked up, in order, as the container's own annotation KEY, the pod's
// annotation KEY.container.NAME (NAME: the container's name; the way to address one container of
// a Kubernetes pod) and the pod's annotation KEY (every container of the pod).
//
// The keys belong in the oci package with the other berth annotations (shim and nri meet there);
// they are here until that package takes them.
//
// # GPUs already in a container
//
// A container's GPUs are the union of: CDI devices of kind cdi_kind ("nvidia.com/gpu=0",
// "=GPU-<uuid>", "=all"), /dev/nvidiaN device nodes of the spec, and, in namespaces trusted to
// name GPUs (gpu_annotation_namespaces, or every namespace with trust_visible_devices_env), the
// NVIDIA_VISIBLE_DEVICES list (indices or UUIDs; "all" in the environment alone is ignored,
// because CUDA base images set it for every container). Elsewhere the variable books nothing:
// any pod can set it; the GPUs it names beyond the container's devices are logged. Names that match no GPU of the node are logged and
// skipped; MIG devices ("MIG-...", "0:1") count as their parent GPU when it can be told.
//
// # Metrics
//
// Each Plugin keeps its own metrics and registers them with the registry WithRegisterer passes
// in (never a global one): decisions by result and policy (berth_nri_placements_total),
// refusals by the sentinel error they wrap (berth_nri_refusals_total), the decision latency
// histogram (berth_nri_decision_duration_seconds) and, per NUMA node, exclusive CPUs held, the
// shared pool, GPUs held and containers bound to its memory (berth_nri_cpus_held,
// berth_nri_shared_pool_cpus, berth_nri_gpus_held, berth_nri_memory_bound_containers), updated
// on create, stop, remove, synchronize and node rebuilds. Label values come from fixed sets.
//
// Every method answers well within NRI's 2 s request timeout: the node model is built before the
// plugin connects, and a decision is a few hundred microseconds on an 8-GPU, 224-CPU node.
package plugin
