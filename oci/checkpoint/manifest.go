package checkpoint

import (
	"time"

	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
)

// ManifestVersion is the version of the berth manifest format this package writes and reads.
const ManifestVersion = 1

// Manifest is the berth manifest (berth.json) at the top of a checkpoint. Every path in it is
// relative to the directory that holds berth.json, slash-separated.
type Manifest struct {
	// Version is ManifestVersion of the writer.
	Version int `json:"version"`
	// Created is when the checkpoint was taken (UTC).
	Created time.Time `json:"created"`
	// Container describes the checkpointed container.
	Container ContainerInfo `json:"container"`
	// Fingerprint is the source node's fingerprint at checkpoint time.
	Fingerprint fingerprint.Fingerprint `json:"fingerprint"`
	// CRIU holds CRIU's dump statistics, read from its stats-dump file.
	CRIU CRIUStats `json:"criu"`
	// ImageSize is the sum of the sizes of Files, in bytes.
	ImageSize int64 `json:"imageSize"`
	// Files lists every file of the checkpoint except berth.json itself, sorted by Path.
	Files []File `json:"files"`
	// Phases are the durations of the steps that produced the checkpoint, in order.
	Phases []Phase `json:"phases,omitempty"`
	// GPU is the container's GPU state at checkpoint time; nil for a container without GPUs.
	GPU *GPUState `json:"gpu,omitempty"`
	// Security is the source container's security context as its OCI spec gave it (user,
	// capabilities, privileged, no_new_privs, seccomp and AppArmor profiles, host namespaces;
	// privilege.FromSpec), recorded by the shim at checkpoint. A restore compares it with the
	// destination spec (privilege.CheckContainer). nil in manifests written before berth recorded it.
	Security *privilege.Container `json:"security,omitempty"`
	// PageStream, in a checkpoint moved in copy mode, is the memory CRIU sent straight to the
	// destination's page server: its page images are not in Files (see PageStream).
	PageStream *PageStream `json:"pageStream,omitempty"`
	// PostCopy marks a checkpoint taken in lazy (post-copy) mode: its CRIU images hold no
	// memory that CRIU could send lazily (only the few pages it cannot, in Files); the rest is
	// served by the source's CRIU, after the restore, to the destination's `criu lazy-pages`
	// daemon (LazyPagesDir), over the move's mutual-TLS connection. Those pages are covered by
	// that connection's authentication, not by the signature. Such a checkpoint restores only
	// while its source still serves it.
	PostCopy bool `json:"postCopy,omitempty"`
	// LazyStream, in a PostCopy checkpoint, is the ID of the lazy page stream that serves its
	// memory (32 hex digits, random, chosen by the source's relay for this move and sent in
	// that stream's header). Under the signature it binds the stream to this checkpoint: the
	// receiver runs the lazy-pages daemon only for the stream that carries it, so that no other
	// peer can pair a page stream of its own with a checkpoint of the same name.
	LazyStream string `json:"lazyStream,omitempty"`
}

// GPUState records what a checkpoint of a GPU container needs on restore.
type GPUState struct {
	// Devices are the container's GPUs in the container's device order.
	Devices []GPUDevice `json:"devices"`
	// Driver and CUDA are the source node's NVIDIA driver and CUDA driver versions.
	Driver string `json:"driver"`
	CUDA   string `json:"cuda"`
	// PIDs are the host PIDs of the container's CUDA processes at checkpoint time, and NSPIDs the
	// same processes' PIDs inside the container (stable across restore).
	PIDs   []int `json:"pids"`
	NSPIDs []int `json:"nsPids"`
	// Links[i][j] is the link between the container's GPUs i and j on the source node, as
	// nvidia-smi names it ("NV18", "SYS", "X" for i == j); absent when the node's links are
	// unknown. A restore maps the GPUs onto a set with the same links where one exists.
	Links [][]string `json:"links,omitempty"`
	// Steps are the durations of the GPU steps (thaw, lock, checkpoint, restore, unlock), in order.
	Steps []Phase `json:"steps,omitempty"`
}

// GPUDevice is one GPU of a checkpointed container.
type GPUDevice struct {
	// UUID and Name identify the source GPU ("GPU-...", "NVIDIA H200").
	UUID string `json:"uuid"`
	Name string `json:"name"`
	// MemoryTotal is the GPU's memory in bytes; MemoryUsed what the container's processes held on
	// it at checkpoint time (a destination GPU needs at least this much free).
	MemoryTotal uint64 `json:"memoryTotal"`
	MemoryUsed  uint64 `json:"memoryUsed"`
	// DevicePaths are the device nodes (or fake GPU directories) the container used for it.
	DevicePaths []string `json:"devicePaths,omitempty"`
}

// ContainerInfo is what a checkpoint records about its container (config.dump holds the same).
type ContainerInfo struct {
	// ID is the container id on the source node.
	ID string `json:"id"`
	// Namespace is the containerd namespace on the source node.
	Namespace string `json:"namespace,omitempty"`
	// KubernetesNamespace, Pod and ContainerName are the container's Kubernetes namespace, pod
	// name and name in its pod, from the CRI annotations of its spec (oci.AnnotationCRISandboxNamespace,
	// AnnotationCRISandboxName, AnnotationCRIContainerName); empty outside Kubernetes. The shim's
	// namespace check on restore reads KubernetesNamespace from the signed manifest.
	KubernetesNamespace string `json:"kubernetesNamespace,omitempty"`
	Pod                 string `json:"pod,omitempty"`
	ContainerName       string `json:"containerName,omitempty"`
	// Image is the image reference the container was created from.
	Image string `json:"image,omitempty"`
	// ImageDigest is the digest of that image's manifest ("sha256:<hex>").
	ImageDigest string `json:"imageDigest,omitempty"`
	// Runtime is the containerd runtime type (io.containerd.berth.v2).
	Runtime string `json:"runtime,omitempty"`
	// SnapshotKey is the source's snapshot key of the writable layer.
	SnapshotKey string `json:"snapshotKey,omitempty"`
	// Snapshotter is the source's snapshotter name.
	Snapshotter string `json:"snapshotter,omitempty"`
}

// CRIUStats are CRIU's dump statistics, as CRIU writes them to its stats-dump file
// (DumpStatsEntry in CRIU's stats.proto). Times are in microseconds, as CRIU records them.
type CRIUStats struct {
	FreezingTimeUs     uint32 `json:"freezingTimeUs"`
	FrozenTimeUs       uint32 `json:"frozenTimeUs"`
	MemdumpTimeUs      uint32 `json:"memdumpTimeUs"`
	MemwriteTimeUs     uint32 `json:"memwriteTimeUs"`
	PagesScanned       uint64 `json:"pagesScanned"`
	PagesSkippedParent uint64 `json:"pagesSkippedParent"`
	PagesWritten       uint64 `json:"pagesWritten"`
	PagesLazy          uint64 `json:"pagesLazy,omitempty"`
}

// File is one file of a checkpoint.
type File struct {
	// Path is relative to the checkpoint directory, slash-separated, never absolute or with "..".
	Path string `json:"path"`
	// Size is the file's size in bytes.
	Size int64 `json:"size"`
	// Digest is "sha256:<hex>" of the file's content.
	Digest string `json:"digest"`
}

// Phase is the duration of one step of a checkpoint or a move.
type Phase struct {
	// Name is the step ("gpu-lock", "criu-dump", "transfer", ...).
	Name string `json:"name"`
	// Ms is the step's wall time in milliseconds.
	Ms float64 `json:"ms"`
}

// Phases times the steps of one checkpoint, restore or move with one clock and keeps them, in
// the order they ended, as Phase values (wall time in milliseconds, microsecond resolution). The
// zero value is not usable: make one with NewPhases. It is not safe for concurrent use.
type Phases struct {
	now  func() time.Time
	list []Phase
}

// NewPhases returns an empty Phases that reads the clock now (time.Now when now is nil).
func NewPhases(now func() time.Time) *Phases {
	if now == nil {
		now = time.Now
	}
	return &Phases{now: now}
}

// Start starts timing the step name and returns the function that ends it: the first call of
// that function records the phase, later calls do nothing.
func (p *Phases) Start(name string) (end func()) {
	start := p.now()
	done := false
	return func() {
		if done {
			return
		}
		done = true
		p.list = append(p.list, Phase{Name: name, Ms: Millis(p.now().Sub(start))})
	}
}

// Time runs fn as the step name and returns fn's error; the phase is recorded whether fn fails
// or not.
func (p *Phases) Time(name string, fn func() error) error {
	defer p.Start(name)()
	return fn()
}

// Add records phases measured elsewhere (by another Phases), after those recorded so far.
func (p *Phases) Add(phases ...Phase) { p.list = append(p.list, phases...) }

// List returns a copy of the phases recorded so far, in the order they ended.
func (p *Phases) List() []Phase { return append([]Phase(nil), p.list...) }

// Len returns the number of phases recorded so far (List()[Len():] after more steps are the new ones).
func (p *Phases) Len() int { return len(p.list) }

// Millis is d in milliseconds with microsecond resolution, as Phase.Ms holds it.
func Millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
