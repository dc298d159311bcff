package oci

// RuntimeName is the containerd runtime type that containerd-shim-berth-v2 serves: the value of
// runtime_type for the berth runtime handler in containerd's CRI configuration, and of
// `ctr run --runtime`. Clients (berthctl) create restored containers with it.
const RuntimeName = "io.containerd.berth.v2"

// Annotations berth reads from or writes to an OCI runtime spec (config.json), a CRI request or a
// pod. These keys are the whole contract between a pod, the shim (which never imports nri) and
// berth-nri (which never imports shim).
const (
	// AnnotationRestoreFrom names the checkpoint a container is restored from instead of being
	// started fresh: a checkpoint directory (or archive) path, relative to the shim's configured
	// checkpoint root or absolute inside it, or a registry reference
	// oci://HOST[:PORT]/REPOSITORY:TAG (or ...@sha256:HEX) of a registry in the shim's
	// allowed_registries (registry.ParseRestoreFrom). Read by the shim's Create, which validates
	// it (pulling a reference first); its Start runs CRIU.
	AnnotationRestoreFrom = "berth.dev/restore-from"
	// AnnotationGPUs asks berth-nri for a number of GPUs ("2") for a container that got none from
	// a device plugin or CDI. Read by berth-nri on CreateContainer.
	AnnotationGPUs = "berth.dev/gpus"
	// AnnotationNUMAPolicy overrides the node's Topology Manager policy for one pod or container
	// ("none", "best-effort", "restricted", "single-numa-node"). Read by berth-nri.
	AnnotationNUMAPolicy = "berth.dev/numa-policy"
	// AnnotationPlacement is written by berth-nri into the container's spec: the placement it
	// chose (JSON: GPUs, cpus, mems, NUMA nodes, reason).
	AnnotationPlacement = "berth.dev/placement"
)

// Annotations that containerd's CRI plugin sets on every container's spec; berth reads them.
const (
	// AnnotationCRIContainerType is "sandbox" for a pod's pause container, "container" otherwise.
	AnnotationCRIContainerType = "io.kubernetes.cri.container-type"
	// AnnotationCRISandboxNamespace is the container's Kubernetes namespace.
	AnnotationCRISandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
	// AnnotationCRISandboxName is the container's pod name.
	AnnotationCRISandboxName = "io.kubernetes.cri.sandbox-name"
	// AnnotationCRIContainerName is the container's name in its pod.
	AnnotationCRIContainerName = "io.kubernetes.cri.container-name"
	// AnnotationCRIImageName is the image reference the container was created from.
	AnnotationCRIImageName = "io.kubernetes.cri.image-name"
)

// AnnotationCRIUConfig is runc's annotation naming a CRIU configuration file for the container;
// the shim points it at the per-bundle file it writes.
const AnnotationCRIUConfig = "org.criu.config"
