// Package fingerprint describes what a checkpoint was taken against (kernel, CRIU, CPU, runc,
// containerd, image, and room for GPUs), collects it on this node, and compares a checkpoint's
// fingerprint with a destination node's, naming the field that differs.
//
// What belongs here: the Fingerprint type, its comparison rules, and collection from injected
// sources (a /proc root, version probes). What does not: talking to containerd or running CRIU
// itself; this package imports neither berth's oci nor its criu package (oci imports this one),
// so CRIU's version reaches Collect through Sources.CRIUVersion.
//
// # Comparison rules
//
// Compare and CompareAll check a checkpoint's fingerprint against a node's, field by field, in
// the order of this table (the Field column is MismatchError.Field):
//
//	Field               Rule                 Restore on the node is allowed when
//	arch                exact                equal (GOARCH form)
//	kernel              exact                equal release strings; CRIU can restore across
//	                                         kernels in theory, but vDSO layout and kernel
//	                                         feature differences break restores, so berth
//	                                         requires the same release
//	criu                at-least             node's CRIU major.minor >= the checkpoint's; newer
//	                                         CRIU reads older images, older CRIU may not know
//	                                         newer image entries
//	cpu.vendor          exact                equal vendor_id ("GenuineIntel", "AuthenticAMD")
//	cpu.flags           superset             node has every flag the checkpoint has (a restored
//	                                         process may execute any instruction its CPU
//	                                         advertised when it started)
//	runc                same-major-minor     equal major.minor
//	containerd          same-major           equal major
//	imageDigest         exact-if-both-set    equal, checked only when both are non-empty
//	gpus                exact                equal number of GPUs
//	gpus[i].name        exact                equal, GPUs paired in Index order
//	gpus[i].driver      exact                equal driver version
//	gpus[i].cuda        exact                equal CUDA driver version
//	gpus[i].memoryBytes at-least             node's GPU memory >= the checkpoint's
//
// Not compared (informational only): version (the format version), cpu.family, cpu.model,
// cpu.modelName, gpus[i].uuid.
//
// Version-valued fields (criu, runc, containerd) are parsed as dotted decimals with an optional
// leading "v" ("4.2.1", "v2.4.2", "1.5.3-rc.1"). A checkpoint value that is empty imposes no
// constraint; a node value that is empty or unparsable when the checkpoint's is set is a
// mismatch, since compatibility cannot be shown.
package fingerprint

// Version is the fingerprint format version this package writes.
const Version = 1

// Fingerprint is a node's (or a checkpoint's) fingerprint. The JSON form is what
// `berthctl fingerprint` prints and what berth.json records.
type Fingerprint struct {
	// Version is the format version (Version).
	Version int `json:"version"`
	// Kernel is the kernel release (uname -r; /proc/sys/kernel/osrelease).
	Kernel string `json:"kernel"`
	// Arch is the machine architecture (GOARCH form, e.g. "amd64").
	Arch string `json:"arch"`
	// CRIU is CRIU's version as "major.minor.sublevel" (from CRIU's version RPC through
	// go-criu; berth's criu.Client.VersionString).
	CRIU string `json:"criu"`
	// CPU describes the CPU model and the flags CRIU checks (from /proc/cpuinfo).
	CPU CPU `json:"cpu"`
	// Runc is runc's version ("runc --version", first line), normalized as ExecVersion does
	// ("1.5.3").
	Runc string `json:"runc"`
	// Containerd is containerd's version (its version API or "containerd --version"),
	// normalized as ExecVersion does: no leading "v", no "+build" suffix ("2.4.2").
	Containerd string `json:"containerd"`
	// ImageDigest is the container image's manifest digest; empty for a node fingerprint.
	ImageDigest string `json:"imageDigest,omitempty"`
	// GPUs is filled by the GPU issue; empty on nodes without GPUs.
	GPUs []GPU `json:"gpus,omitempty"`
}

// CPU is the part of /proc/cpuinfo that decides whether CRIU can restore a process here.
type CPU struct {
	// Vendor is vendor_id ("GenuineIntel", "AuthenticAMD").
	Vendor string `json:"vendor"`
	// Family and Model are "cpu family" and "model".
	Family string `json:"family"`
	Model  string `json:"model"`
	// ModelName is "model name", informational only.
	ModelName string `json:"modelName"`
	// Flags are the CPU feature flags that change what a restored process may execute
	// (instruction-set extensions and xsave features; CPUFlagRelevant lists them for x86, on
	// arm64 every "Features" hwcap is kept), deduplicated and sorted.
	Flags []string `json:"flags"`
}

// GPU is one GPU as a fingerprint records it (filled by the GPU inventory).
type GPU struct {
	// Index is the device index in the container's device order.
	Index int `json:"index"`
	// UUID is the GPU's UUID ("GPU-...").
	UUID string `json:"uuid"`
	// Name is the model ("NVIDIA H200").
	Name string `json:"name"`
	// MemoryBytes is total device memory in bytes.
	MemoryBytes uint64 `json:"memoryBytes"`
	// Driver and CUDA are the driver and CUDA driver versions.
	Driver string `json:"driver"`
	CUDA   string `json:"cuda"`
}
