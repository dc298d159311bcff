package move

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/cgroups/v3"
	cgroupsv1 "github.com/containerd/cgroups/v3/cgroup1/stats"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	securejoin "github.com/cyphar/filepath-securejoin"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/devicemap"
	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/transfer"
)

// Need is what restoring one container asks of its destination node: read from a checkpoint
// (NeedOfCheckpoint) or, before a move pauses anything, from the running source container
// (NeedOfSource). Its JSON is the preflight query a remote receiver answers (RemotePreflight).
type Need struct {
	// Image and ImageDigest are the container's image and its digest ("" when unknown).
	Image       string `json:"image,omitempty"`
	ImageDigest string `json:"imageDigest,omitempty"`
	// Spec is the container's spec (bind mounts, memory limit, namespaces); nil when unknown.
	Spec *specs.Spec `json:"spec,omitempty"`
	// MemoryBytes is the memory its processes hold: the checkpoint's pages, or the source's
	// current usage.
	MemoryBytes int64 `json:"memoryBytes,omitempty"`
	// DiskBytes is what the checkpoint takes on the destination's disk.
	DiskBytes int64 `json:"diskBytes,omitempty"`
	// PIDs are its processes' PIDs (needed free on the destination when the container shares
	// the host's PID namespace).
	PIDs []int `json:"pids,omitempty"`
	// Fingerprint is the fingerprint it was (or would be) taken against; nil: not compared.
	Fingerprint *fingerprint.Fingerprint `json:"fingerprint,omitempty"`
	// GPU is the container's GPUs (model, device memory it holds on each, links between them),
	// as the checkpoint's manifest records them; nil: none, or unknown.
	GPU *checkpoint.GPUState `json:"gpu,omitempty"`
}

// Destination is what the preflight reads of the destination node.
type Destination struct {
	// Client is the destination containerd; Namespace the containerd namespace of the restore.
	Client    *containerd.Client
	Namespace string
	// Local says the destination's filesystem, /proc and CRIU are this host's (the destination
	// containerd runs here): bind sources, free memory, PIDs, free disk under Root and the
	// fingerprint are then checked; a remote destination is checked for its image only.
	Local bool
	// Root is the destination's checkpoint root (free disk); "" skips the disk check.
	Root string
	// Fingerprint returns the destination node's fingerprint; nil skips the comparison.
	Fingerprint func(ctx context.Context) (fingerprint.Fingerprint, error)
	// ProcRoot is /proc (a test seam); "" means HostRoot's /proc.
	ProcRoot string
	// HostRoot is where the destination host's / is seen, when this process runs in a
	// container with the host's file system mounted there (the berth-probe DaemonSet's /host,
	// read-only): bind sources, /proc (PIDs, MemAvailable) and Root are looked up under it, with
	// symlinks resolved inside it (securejoin), as the host would resolve them. "" is this
	// process's own /.
	HostRoot string
	// GPUs is the destination node's GPU inventory (model, device memory total and used, links):
	// with Local, a checkpoint's GPUs must fit on GPUs of their models with enough free memory
	// (gpu/devicemap, as the shim will map them). nil skips the check.
	GPUs gpu.Inventory
}

// Refusal is one reason a destination cannot take a container: which field, its value there,
// and the limit the container needs.
type Refusal struct {
	Field string `json:"field"`
	Value string `json:"value"`
	Limit string `json:"limit"`
	// Fix says what to do.
	Fix string `json:"fix,omitempty"`
}

// String is the refusal as one clause: "FIELD is VALUE, needs LIMIT (FIX)".
func (r Refusal) String() string {
	s := fmt.Sprintf("%s is %s, needs %s", r.Field, r.Value, r.Limit)
	if r.Fix != "" {
		s += " (" + r.Fix + ")"
	}
	return s
}

// ErrPreflight is what a PreflightError is: the destination cannot take the container
// (errdefs.ErrFailedPrecondition).
var ErrPreflight = fmt.Errorf("destination preflight refused: %w", errdefs.ErrFailedPrecondition)

// PreflightError lists every refusal of a preflight.
type PreflightError struct{ Refusals []Refusal }

// Error lists every refusal (Refusal.String), joined with "; ".
func (e *PreflightError) Error() string {
	parts := make([]string, len(e.Refusals))
	for i, r := range e.Refusals {
		parts[i] = r.String()
	}
	return "the destination cannot take the container: " + strings.Join(parts, "; ")
}

// Unwrap returns ErrPreflight, so errors.Is and errdefs classify it as FailedPrecondition.
func (e *PreflightError) Unwrap() error { return ErrPreflight }

// Preflight checks, before the source is paused, that the destination can restore need: the
// image (same digest), every bind source, the memory limit against the memory the container
// holds, free memory, PID namespace, fingerprint (CRIU, kernel, CPU...), free disk and free
// device memory on GPUs of the checkpoint's models (gpuRefusals). It returns
// nil, a *PreflightError naming each refused field with its value and the limit, or the error of
// a check that could not run.
func Preflight(ctx context.Context, dst Destination, need Need) error {
	var refusals []Refusal
	refuse := func(field, value, limit, fix string) {
		refusals = append(refusals, Refusal{Field: field, Value: value, Limit: limit, Fix: fix})
	}
	ctx = namespaces.WithNamespace(ctx, dst.Namespace)
	if need.Image != "" && dst.Client != nil {
		img, err := dst.Client.GetImage(ctx, need.Image)
		switch {
		case errdefs.IsNotFound(err):
			refuse("image", "absent", need.Image, "import the image on the destination first (namespace "+dst.Namespace+")")
		case err != nil:
			return fmt.Errorf("look up image %s on the destination: %w", need.Image, err)
		case need.ImageDigest != "" && img.Target().Digest.String() != need.ImageDigest:
			refuse("image "+need.Image+" digest", img.Target().Digest.String(), need.ImageDigest, "import the source's image")
		}
	}
	if sp := need.Spec; sp != nil && sp.Linux != nil {
		for _, ns := range sp.Linux.Namespaces {
			if ns.Path != "" {
				refuse("linux.namespaces["+string(ns.Type)+"].path", ns.Path, "none (a namespace of its own)",
					"a namespace joined by path is the source node's and does not exist on the destination")
			}
		}
	}
	limit := oci.MemoryLimit(need.Spec)
	if limit > 0 && need.MemoryBytes > limit {
		refuse("linux.resources.memory.limit", strconv.FormatInt(limit, 10)+" bytes", ">= "+strconv.FormatInt(need.MemoryBytes, 10)+" bytes (the container's memory)",
			"raise the limit, or CRIU is OOM-killed restoring it")
	}
	if !dst.Local {
		return result(refusals)
	}
	proc := dst.ProcRoot
	if proc == "" {
		var err error
		if proc, err = HostPath(dst.HostRoot, "/proc"); err != nil {
			return err
		}
	}
	if sp := need.Spec; sp != nil {
		for i, m := range sp.Mounts {
			if !oci.IsBindMount(m) {
				continue
			}
			src, err := HostPath(dst.HostRoot, m.Source)
			if err == nil {
				_, err = os.Stat(src)
			} else if !errors.Is(err, fs.ErrPermission) {
				return err
			}
			// a directory on the way that this process may not search fails the lookup under
			// HostRoot (securejoin's lstat) as it fails the stat: refused as not visible, not an
			// error that stops every other check
			if err != nil {
				value, fix := m.Source+" (missing)", "create it on the destination with what it held on the source"
				if errors.Is(err, fs.ErrPermission) {
					value = m.Source + " (not visible to the check: " + err.Error() + ")"
					fix = "let the checking user (the berth probe's uid 64535) search its directories, or run the probe with DAC_READ_SEARCH (berth-probe-daemonset.yaml)"
				}
				refuse(fmt.Sprintf("mounts[%d].source (destination %s)", i, m.Destination), value, "an existing path", fix)
			}
		}
		if hostPIDs(sp) {
			for _, pid := range need.PIDs {
				if _, err := os.Stat(filepath.Join(proc, strconv.Itoa(pid))); err == nil {
					refuse("PID "+strconv.Itoa(pid), "in use in the host's PID namespace", "free",
						"the container shares the host's PID namespace and CRIU restores each process with its own PID")
				}
			}
		}
	}
	if need.MemoryBytes > 0 {
		if avail, err := memAvailable(proc); err == nil && avail < need.MemoryBytes {
			refuse("MemAvailable", strconv.FormatInt(avail, 10)+" bytes", ">= "+strconv.FormatInt(need.MemoryBytes, 10)+" bytes", "free memory on the destination")
		}
	}
	if dst.Root != "" && need.DiskBytes > 0 {
		var st unix.Statfs_t
		dir, err := HostPath(dst.HostRoot, dst.Root)
		if err != nil {
			return err
		}
		for {
			if err := unix.Statfs(dir, &st); err == nil || dir == "/" {
				break
			}
			dir = filepath.Dir(dir)
		}
		if free := int64(st.Bavail) * st.Bsize; free < need.DiskBytes {
			refuse("free disk under "+dst.Root, strconv.FormatInt(free, 10)+" bytes", ">= "+strconv.FormatInt(need.DiskBytes, 10)+" bytes", "free disk on the destination")
		}
	}
	if need.GPU != nil && len(need.GPU.Devices) > 0 && dst.GPUs != nil {
		r, err := gpuRefusals(need.GPU, dst.GPUs)
		if err != nil {
			return err
		}
		refusals = append(refusals, r...)
	}
	if need.Fingerprint != nil && dst.Fingerprint != nil {
		node, err := dst.Fingerprint(ctx)
		if err != nil {
			return fmt.Errorf("fingerprint of the destination: %w", err)
		}
		want := *need.Fingerprint
		node.ImageDigest, node.GPUs = want.ImageDigest, want.GPUs // compared above / by the shim's device map
		for _, m := range fingerprint.CompareAll(want, node) {
			refuse("fingerprint "+m.Field, strconv.Quote(m.Node), strconv.Quote(m.Checkpoint)+" ("+string(m.Rule)+")", "restore on a node whose fingerprint matches")
		}
	}
	return result(refusals)
}

// PreflightAnswer is a receiving node's answer to a preflight query: the refusals of its
// host-only checks (none: it can take the container).
type PreflightAnswer struct {
	Refusals []Refusal `json:"refusals"`
}

// AnswerPreflight is the receiving node's side of a remote preflight (berthctl receive wires it
// as transfer.Receiver.Preflight): query is a Need's JSON, checked against this node (dst,
// whose Local must be set; with no Client, the image is left to the sender, which checks it
// with the destination's containerd). It returns a PreflightAnswer's JSON. Errors: a query that
// is not a Need (wrapping transfer.ErrProtocol), or a check that could not run.
func AnswerPreflight(ctx context.Context, dst Destination, query json.RawMessage) (json.RawMessage, error) {
	var need Need
	if err := json.Unmarshal(query, &need); err != nil {
		return nil, fmt.Errorf("%w: preflight query: %w", transfer.ErrProtocol, err)
	}
	a := PreflightAnswer{Refusals: []Refusal{}}
	err := Preflight(ctx, dst, need)
	var pe *PreflightError
	switch {
	case errors.As(err, &pe):
		a.Refusals = pe.Refusals
	case err != nil:
		return nil, err
	}
	return json.Marshal(a)
}

// RemotePreflight asks the berth receiver on conn (dialed, not yet greeted; one query per
// connection, closed by the caller) to check need against its node before anything is paused,
// naming the checkpoint name the move will send. It returns the receiver's refusals (none: it
// can take the container). Errors: transfer.QueryPreflight's, transfer.ErrNoPreflight among
// them when the receiver gives no answer (an older receiver: its checks are then not run), or
// an answer that is not a PreflightAnswer (transfer.ErrProtocol).
func RemotePreflight(ctx context.Context, conn net.Conn, name string, need Need) ([]Refusal, error) {
	raw, err := transfer.QueryPreflight(ctx, conn, name, need)
	if err != nil {
		return nil, err
	}
	var a PreflightAnswer
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("%w: preflight answer of %s: %w", transfer.ErrProtocol, conn.RemoteAddr(), err)
	}
	return a.Refusals, nil
}

// MergeRefusals returns a followed by those of b that a lacks (the same String), as one error
// (nil for none): the refusals of this host's checks and of a remote receiver's, which repeat the
// checks that need no host.
func MergeRefusals(a, b []Refusal) error {
	seen := map[string]bool{}
	var out []Refusal
	for _, r := range append(append([]Refusal{}, a...), b...) {
		if !seen[r.String()] {
			seen[r.String()] = true
			out = append(out, r)
		}
	}
	return result(out)
}

func result(refusals []Refusal) error {
	if len(refusals) == 0 {
		return nil
	}
	return &PreflightError{Refusals: refusals}
}

// NeedOfSource is what the running container id (namespace ns of c) will need of a destination,
// read before anything is paused: its image, spec, current memory usage (cgroup) as the memory
// and the disk the checkpoint will take, and its processes' PIDs.
func NeedOfSource(ctx context.Context, c *containerd.Client, ns, id string) (Need, error) {
	ctx = namespaces.WithNamespace(ctx, ns)
	var n Need
	ctr, err := c.LoadContainer(ctx, id)
	if err != nil {
		return n, fmt.Errorf("container %s in namespace %s: %w", id, ns, err)
	}
	info, err := ctr.Info(ctx)
	if err != nil {
		return n, err
	}
	n.Image = info.Image
	if info.Image != "" {
		if img, err := c.GetImage(ctx, info.Image); err == nil {
			n.ImageDigest = img.Target().Digest.String()
		}
	}
	if n.Spec, err = ctr.Spec(ctx); err != nil {
		return n, fmt.Errorf("spec of %s: %w", id, err)
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		return n, fmt.Errorf("container %s has no task: %w", id, err)
	}
	if m, err := task.Metrics(ctx); err == nil && m.Data != nil {
		if v, err := typeurl.UnmarshalAny(m.Data); err == nil {
			if st, ok := v.(*cgroupsv1.Metrics); ok && st.Memory != nil && st.Memory.Usage != nil {
				n.MemoryBytes = int64(st.Memory.RSS + st.Memory.RSSHuge)
				if n.MemoryBytes == 0 {
					n.MemoryBytes = int64(st.Memory.Usage.Usage)
				}
			}
		}
	}
	n.DiskBytes = n.MemoryBytes
	if pids, err := task.Pids(ctx); err == nil {
		for _, p := range pids {
			n.PIDs = append(n.PIDs, int(p.Pid))
		}
	}
	return n, nil
}

// GPUNeedOfSource is the device memory the processes pids (host PIDs: a source container's
// task) hold on the GPUs of inv (the source node's inventory), as a checkpoint would record it:
// one device per GPU on which they hold memory, in the inventory's order, with its model and the
// bytes held (no links). It returns nil when they hold none, or when inv cannot tell
// (gpu.ErrUnsupported: the shim's checkpoint then records none either). Errors: the inventory's.
func GPUNeedOfSource(inv gpu.Inventory, pids []int) (*checkpoint.GPUState, error) {
	held := map[string]uint64{}
	for _, pid := range pids {
		m, err := inv.ProcessMemory(pid)
		if errors.Is(err, gpu.ErrUnsupported) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("device memory of pid %d: %w", pid, err)
		}
		for uuid, b := range m {
			held[uuid] += b
		}
	}
	if len(held) == 0 {
		return nil, nil
	}
	devs, err := inv.Devices()
	if err != nil {
		return nil, fmt.Errorf("GPUs of the source: %w", err)
	}
	st := &checkpoint.GPUState{}
	for _, d := range devs {
		if b := held[d.UUID]; b > 0 {
			st.Devices = append(st.Devices, checkpoint.GPUDevice{UUID: d.UUID, Name: d.Name, MemoryTotal: d.MemoryTotal, MemoryUsed: b})
		}
	}
	return st, nil
}

// NeedOfCheckpoint is what the checkpoint at path (a directory, or a tar archive of one, gzip
// or not) needs of a destination: from its berth.json (image, memory pages, fingerprint, size)
// and spec.dump.
func NeedOfCheckpoint(p string) (Need, error) {
	var n Need
	files, err := readCheckpointFiles(p, checkpoint.ManifestFile, checkpoint.SpecFile, checkpoint.ImagesDir+"/"+checkpoint.ManifestFile)
	if err != nil {
		return n, err
	}
	mb := files[checkpoint.ManifestFile]
	if mb == nil {
		mb = files[checkpoint.ImagesDir+"/"+checkpoint.ManifestFile]
	}
	if mb == nil {
		return n, fmt.Errorf("checkpoint %s: no %s: %w", p, checkpoint.ManifestFile, checkpoint.ErrMissingFile)
	}
	m, err := checkpoint.ParseManifest(mb)
	if err != nil {
		return n, fmt.Errorf("checkpoint %s: %w", p, err)
	}
	n.Image, n.ImageDigest = m.Container.Image, m.Container.ImageDigest
	n.MemoryBytes, n.DiskBytes = m.MemoryBytes(), m.ImageSize
	if n.DiskBytes == 0 {
		for _, f := range m.Files {
			n.DiskBytes += f.Size
		}
	}
	fp := m.Fingerprint
	n.Fingerprint = &fp
	n.GPU = m.GPU
	if b := files[checkpoint.SpecFile]; b != nil {
		var sp specs.Spec
		if err := json.Unmarshal(b, &sp); err != nil {
			return n, fmt.Errorf("checkpoint %s: %s: %w", p, checkpoint.SpecFile, err)
		}
		n.Spec = &sp
	}
	return n, nil
}

// readCheckpointFiles reads the named files (slash paths relative to the checkpoint) of the
// checkpoint directory or archive at p; a file it lacks is absent from the map.
func readCheckpointFiles(p string, names ...string) (map[string][]byte, error) {
	out := map[string][]byte{}
	fi, err := os.Stat(p)
	if err != nil {
		return nil, err
	}
	if fi.IsDir() {
		for _, name := range names {
			if b, err := os.ReadFile(filepath.Join(p, filepath.FromSlash(name))); err == nil {
				out[name] = b
			}
		}
		return out, nil
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	br := bufio.NewReader(f)
	var r io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
		}
		defer gz.Close()
		r = gz
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	tr := tar.NewReader(r)
	for len(out) < len(names) {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
		}
		name := path.Clean(strings.TrimPrefix(h.Name, "./"))
		if !want[name] || h.Typeflag != tar.TypeReg || h.Size > 64<<20 {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, name, err)
		}
		out[name] = b
	}
	return out, nil
}

// HostPath is p (an absolute path on the host) as seen under root (the host's / mounted
// there): symlinks resolved inside root (securejoin.SecureJoin), so a host link to /run does not
// lead to this container's /run. With root "" it is p.
func HostPath(root, p string) (string, error) {
	if root == "" {
		return p, nil
	}
	hp, err := securejoin.SecureJoin(root, p)
	if err != nil {
		return "", fmt.Errorf("host path %s under %s: %w", p, root, err)
	}
	return hp, nil
}

// Anchor says where a container's cgroup must lie for ContainerPIDs to count its processes.
// PodUID is the UID of a CRI container's pod (metadata.uid, as the kubelet names the pod's
// cgroup: pod<UID> with cgroupfs, kubepods[-QOS]-pod<UID, - as _>.slice with systemd); ""
// accepts any pod's cgroup. Namespace is a non-CRI container's containerd namespace (containerd's
// default cgroupsPath is /<namespace>/<id>); "" accepts any. With PodUID set only the CRI form
// counts, with only Namespace set only the containerd form, with neither either form.
type Anchor struct {
	PodUID    string
	Namespace string
}

// ContainerPIDs returns the PIDs, in the PID namespace of proc (a procfs: the host's /proc for
// host PIDs), of the processes in the cgroup of the container id (a CRI or containerd container
// ID, 12 characters at least), sorted: those whose proc/PID/cgroup (parsed by containerd's
// cgroups.ParseCgroupFromReaderUnified: the unified hierarchy's line and every cgroup v1
// hierarchy's) names a path (cgroupOfContainer) whose container element (the first element from
// the root that names any container) is exactly id's, ID (cgroupfs) or PREFIX-ID.scope (systemd:
// cri-containerd-ID.scope), anchored as a makes it: right below its pod's cgroup under the
// kubelet's kubepods (CRI), or right below its namespace at the cgroup root (containerd's
// /<namespace>/<id>). A cgroup that only contains id in its name, one named after id below
// another container's, or one below a delegated systemd unit (a user's user@UID.service, a
// podman or service's scope) is not id's: no tenant or local user can have its own processes
// counted as another container's. It needs no privilege (cgroup files are world-readable); a
// process gone meanwhile, or whose file does not parse, is skipped. Errors: an id too short to be
// unique, or proc unreadable.
func ContainerPIDs(proc, id string, a Anchor) ([]int, error) {
	if len(id) < 12 {
		return nil, fmt.Errorf("container id %q: too short to find its cgroup", id)
	}
	ents, err := os.ReadDir(proc)
	if err != nil {
		return nil, fmt.Errorf("processes of container %s: %w", id, err)
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(proc, e.Name(), "cgroup"))
		if err != nil {
			continue
		}
		if inContainerCgroup(b, id, a) {
			out = append(out, pid)
		}
	}
	slices.Sort(out)
	return out, nil
}

// inContainerCgroup reports whether the /proc/PID/cgroup contents b place the process in the
// cgroup of container id (or below it) in any hierarchy (cgroupOfContainer).
func inContainerCgroup(b []byte, id string, a Anchor) bool {
	v1, unified, err := cgroups.ParseCgroupFromReaderUnified(bytes.NewReader(b))
	if err != nil {
		return false
	}
	paths := []string{unified}
	for _, p := range v1 {
		paths = append(paths, p)
	}
	for _, p := range paths {
		if cgroupOfContainer(p, id, a) {
			return true
		}
	}
	return false
}

// containerIDElem is a containerd CRI container id: 64 lowercase hex digits.
var containerIDElem = regexp.MustCompile(`^[0-9a-f]{64}$`)

// elemContainer returns the container id that the cgroup path element el names: a 64-hex id or
// id itself (cgroupfs), or PREFIX-ID.scope with such an id (systemd); ok is false for any other.
func elemContainer(el, id string) (string, bool) {
	isID := func(s string) bool { return s == id || containerIDElem.MatchString(s) }
	if isID(el) {
		return el, true
	}
	if scope, found := strings.CutSuffix(el, ".scope"); found {
		if i := strings.LastIndexByte(scope, '-'); i > 0 && isID(scope[i+1:]) {
			return scope[i+1:], true
		}
	}
	return "", false
}

// cgroupOfContainer reports whether the cgroup path p is container id's cgroup or lies below it.
// p's elements ("" and "." dropped, and the leading ".." of a path outside the reader's cgroup
// namespace: outside is above the reader's own pod, which a tenant cannot write) are read from
// the root; the first one that names a container (elemContainer) decides, so a child cgroup that
// a container made is that container's whatever its name, and it must be id's and anchored:
//   - CRI (a.Namespace ""): the element before it is the pod's cgroup (pod<UID>, or a
//     kubepods[-QOS]-pod<UID>.slice), with an optional QOS element (besteffort, burstable,
//     kubepods-QOS.slice) and then kubepods or kubepods.slice before that; above kubepods (the
//     kubelet's cgroupRoot) no element is a delegated systemd unit (*.service, *.scope) or a
//     container. A path that starts with ".." may start at the pod's or QOS element.
//   - containerd (a.PodUID ""): the path is /<namespace>/ID..., namespace a.Namespace if set.
func cgroupOfContainer(p, id string, a Anchor) bool {
	var els []string
	outside := false
	for _, el := range strings.Split(p, "/") {
		switch {
		case el == "" || el == ".":
		case el == ".." && len(els) == 0:
			outside = true
		default:
			els = append(els, el)
		}
	}
	c := -1
	for i, el := range els {
		if owner, ok := elemContainer(el, id); ok {
			if owner != id {
				return false
			}
			c = i
			break
		}
	}
	if c < 0 {
		return false
	}
	if a.PodUID == "" && c == 1 && !strings.HasPrefix(els[0], "kubepods") && (a.Namespace == "" || els[0] == a.Namespace) {
		return true
	}
	if a.Namespace != "" && a.PodUID == "" {
		return false
	}
	return criAnchored(els[:c], a.PodUID, outside)
}

// criAnchored reports whether above, the elements above a CRI container's own, end in its pod's
// cgroup (uid "": any pod's) under the kubelet's kubepods, as cgroupOfContainer says.
func criAnchored(above []string, uid string, outside bool) bool {
	n := len(above)
	if n == 0 || !isPodCgroup(above[n-1], uid) {
		return false
	}
	rest := above[:n-1]
	if len(rest) > 0 {
		switch q := rest[len(rest)-1]; q {
		case "besteffort", "burstable", "kubepods-besteffort.slice", "kubepods-burstable.slice":
			rest = rest[:len(rest)-1]
		}
	}
	if len(rest) == 0 {
		return outside
	}
	if k := rest[len(rest)-1]; k != "kubepods" && k != "kubepods.slice" {
		return false
	}
	for _, el := range rest[:len(rest)-1] {
		if _, ok := elemContainer(el, ""); ok || strings.HasSuffix(el, ".service") || strings.HasSuffix(el, ".scope") {
			return false
		}
	}
	return true
}

// podCgroupElem is a pod's cgroup as the kubelet names it: pod<UID> (cgroupfs) or
// kubepods[-QOS]-pod<UID with _ for ->.slice (systemd); the group is the UID as written there.
var podCgroupElem = regexp.MustCompile(`^(?:pod([0-9A-Za-z_-]+)|kubepods(?:-besteffort|-burstable)?-pod([0-9A-Za-z_]+)\.slice)$`)

// isPodCgroup reports whether el is the cgroup of the pod with UID uid ("": of any pod).
func isPodCgroup(el, uid string) bool {
	m := podCgroupElem.FindStringSubmatch(el)
	if m == nil {
		return false
	}
	if uid == "" {
		return true
	}
	if m[1] != "" {
		return m[1] == uid
	}
	return m[2] == strings.ReplaceAll(uid, "-", "_")
}

// HeldOnHost is what the running container id holds on the host whose / is at hostRoot ("":
// this process's /), as a Need with PIDs and GPU only: its processes' PIDs in hostRoot's /proc
// (ContainerPIDs with a: host PIDs when that is the host's procfs) and, with inv (the host's GPU
// inventory; nil: none), the device memory they hold on each GPU (GPUNeedOfSource; inv must
// speak the same PIDs: run in the host's PID namespace). Errors: no process of the container
// there, ContainerPIDs', the inventory's.
func HeldOnHost(hostRoot, id string, a Anchor, inv gpu.Inventory) (Need, error) {
	var n Need
	proc, err := HostPath(hostRoot, "/proc")
	if err != nil {
		return n, err
	}
	if n.PIDs, err = ContainerPIDs(proc, id, a); err != nil {
		return n, err
	}
	if len(n.PIDs) == 0 {
		return n, fmt.Errorf("container %s: no process in %s has its cgroup (not running on this node?)", id, proc)
	}
	if inv != nil {
		if n.GPU, err = GPUNeedOfSource(inv, n.PIDs); err != nil {
			return n, fmt.Errorf("container %s: %w", id, err)
		}
	}
	return n, nil
}

// hostPIDs reports whether sp shares the host's PID namespace (no pid namespace of its own).
func hostPIDs(sp *specs.Spec) bool {
	if sp.Linux == nil {
		return true
	}
	for _, ns := range sp.Linux.Namespaces {
		if ns.Type == specs.PIDNamespace {
			return false
		}
	}
	return true
}

// memAvailable is MemAvailable of proc/meminfo, in bytes.
func memAvailable(proc string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(proc, "meminfo"))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, fmt.Errorf("no MemAvailable in %s/meminfo", proc)
}

// gpuRefusals checks that the checkpoint's GPUs (st) fit on the destination's GPUs (inv) as the
// shim will map them (devicemap.Choose: a GPU of the same model with at least the device memory
// the container held on it free, each GPU used once). It returns nil when they fit, else one
// refusal per checkpointed GPU that no GPU of its model could take alone (the model missing, or
// the most free memory of its model's GPUs too small), or one for the set when each fits alone
// but not all together. The error is the inventory's.
func gpuRefusals(st *checkpoint.GPUState, inv gpu.Inventory) ([]Refusal, error) {
	devs, err := inv.Devices()
	if err != nil {
		return nil, fmt.Errorf("GPUs of the destination: %w", err)
	}
	var topo *topology.Topology
	if t, ok := inv.(gpu.Topologist); ok {
		topo, _ = t.Topology() // unknown: mapped by model and memory alone
	}
	_, err = devicemap.Choose(devicemap.ForCheckpoint(st, devs, topo))
	if err == nil {
		return nil, nil
	}
	if !errors.Is(err, devicemap.ErrNoFit) {
		return nil, fmt.Errorf("device map onto the destination's GPUs: %w", err)
	}
	var out []Refusal
	for i, src := range st.Devices {
		var best *gpu.Device
		for j := range devs {
			if devs[j].Name == src.Name && (best == nil || devs[j].MemoryFree() > best.MemoryFree()) {
				best = &devs[j]
			}
		}
		switch {
		case best == nil:
			out = append(out, Refusal{Field: fmt.Sprintf("gpu[%d] model", i), Value: "no " + src.Name + " (" + describeGPUs(devs) + ")",
				Limit: src.Name + " (as " + src.UUID + " on the source)", Fix: "restore on a node with a GPU of that model"})
		case best.MemoryFree() < src.MemoryUsed:
			out = append(out, Refusal{Field: fmt.Sprintf("gpu[%d] device memory free (%s)", i, src.Name),
				Value: fmt.Sprintf("%d bytes at most, on %s (%d of %d bytes used)", best.MemoryFree(), best.UUID, best.MemoryUsed, best.MemoryTotal),
				Limit: fmt.Sprintf(">= %d bytes (what the container held on %s)", src.MemoryUsed, src.UUID),
				Fix:   "free device memory on the destination's GPUs, or restore where a GPU of that model has it free"})
		}
	}
	if len(out) == 0 {
		out = append(out, Refusal{Field: "gpus", Value: describeGPUs(devs),
			Limit: fmt.Sprintf("%d GPUs of their models, each with the device memory free that the container held on its GPU", len(st.Devices)),
			Fix:   "free device memory on the destination's GPUs, or restore on a node with more of them"})
	}
	return out, nil
}

// describeGPUs lists devs as "UUID MODEL (FREE bytes free)", comma-separated; "no GPUs" when empty.
func describeGPUs(devs []gpu.Device) string {
	if len(devs) == 0 {
		return "no GPUs"
	}
	parts := make([]string, len(devs))
	for i, d := range devs {
		parts[i] = fmt.Sprintf("%s %s (%d bytes free)", d.UUID, d.Name, d.MemoryFree())
	}
	return strings.Join(parts, ", ")
}
