// Package fake is berth's faithful fake GPU for machines without one: the node side (a node-local
// root directory of fake GPUs, its gpu.Inventory, the container mounts that expose GPUs at
// /dev/berth-gpu/<i>, and the spec rewrite for a restore onto other GPUs) and the shim side
// (Driver, the gpu.Driver that talks to a fake CUDA process over its control socket). The
// in-process half, which the test workload links, is package gpu/fake/fakecuda.
//
// Layout of a node's root:
//
//	root/inventory.json     NodeSpec
//	root/process-memory-unavailable  present: per-process memory is not available (as NVML may say)
//	root/<uuid>/uuid        the GPU's UUID
//	root/<uuid>/memory      its memory in bytes
//	root/<uuid>/driver      the node's driver version
//	root/<uuid>/restore-when-full  what a restore onto the GPU does when it is full ("refuse", "hang")
//	root/<uuid>/lock        flock'd while the GPU's memory is accounted or allocated
//	root/<uuid>/mem-*       device memory of processes (MAP_SHARED files)
//
// A container's GPU i is root/<uuid_i> bind-mounted at /dev/berth-gpu/<i>, and its environment
// names them in order: BERTH_FAKE_GPUS=<uuid_0>,<uuid_1>.
//
// Device memory is accounted as the driver does (fakecuda.Account): a process's memory counts
// against its GPU's total while the process lives, and is freed (its files deleted) at the next
// accounting once it has exited, however it exited; an allocation or a restore the GPU's free
// memory cannot take is refused, or, for a restore on a node whose NodeSpec.RestoreWhenFull is
// fakecuda.FullHang, hangs as the real driver's can. A mem-* file not named as a process's
// (fakecuda.IsProcessFile), such as "mem-fill", is memory held outside any CUDA process of the
// node: counted, never freed by the accounting (tests fill a GPU with one).
package fake

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

const (
	// InventoryFile is the name of a node root's NodeSpec file.
	InventoryFile = "inventory.json"
	// ProcessMemoryUnavailableFile is present in a node root whose NodeSpec has
	// ProcessMemoryUnavailable; ProcessMemory looks for it at each call.
	ProcessMemoryUnavailableFile = "process-memory-unavailable"
	// EnvGPUs is the container environment variable naming its fake GPUs in device order.
	EnvGPUs = "BERTH_FAKE_GPUS"
	// DevRoot is where a container sees its fake GPUs (fakecuda.DefaultDevRoot).
	DevRoot = fakecuda.DefaultDevRoot
)

// NodeSpec describes a node's fake GPUs.
type NodeSpec struct {
	// Driver is the driver version ("580.65.06"); CUDA the CUDA driver version ("12.8").
	Driver string    `json:"driver"`
	CUDA   string    `json:"cuda"`
	GPUs   []GPUSpec `json:"gpus"`
	// RestoreWhenFull is what a CUDA restore onto a GPU without enough free memory does:
	// fakecuda.FullRefuse (also "": the restore fails with gpu.ErrOutOfMemory) or
	// fakecuda.FullHang (it never answers, as the real driver's can, until the process is killed).
	RestoreWhenFull string `json:"restoreWhenFull,omitempty"`
	// ProcessMemoryUnavailable makes ProcessMemory fail with gpu.ErrUnsupported, as NVML does
	// where it reports a process's used memory as not available: a checkpoint then records no
	// device memory, so a restore's preflight cannot refuse a full GPU and the driver meets it.
	ProcessMemoryUnavailable bool `json:"processMemoryUnavailable,omitempty"`
	// Links[i][j] is the link between GPUs i and j as nvidia-smi names it ("X" on the diagonal,
	// "NV4", "PIX", "SYS"); empty when the node's links are unknown (Topology returns nil).
	Links [][]string `json:"links,omitempty"`
}

// GPUSpec is one fake GPU.
type GPUSpec struct {
	// UUID is "GPU-<uuid>"; it names the GPU's directory.
	UUID string `json:"uuid"`
	// Name is the model ("Fake H200").
	Name string `json:"name"`
	// MemoryBytes is the GPU's memory; Malloc and restores fail beyond it.
	MemoryBytes uint64 `json:"memoryBytes"`
	// Arch and ComputeCapability are reported as they are.
	Arch              string `json:"arch,omitempty"`
	ComputeCapability string `json:"computeCapability,omitempty"`
}

// Node is a node's fake GPU root. It implements gpu.Inventory.
type Node struct {
	root string
	spec NodeSpec
}

var _ gpu.Inventory = (*Node)(nil)

// Setup creates (or refreshes) the fake GPU root at root for spec: inventory.json and one
// directory per GPU. Existing device memory files are kept. It returns the opened Node.
func Setup(root string, spec NodeSpec) (*Node, error) {
	if err := validate(spec); err != nil {
		return nil, fmt.Errorf("fake GPU setup %s: %w", root, err)
	}
	for _, g := range spec.GPUs {
		dir := filepath.Join(root, g.UUID)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("fake GPU setup: %w", err)
		}
		full := spec.RestoreWhenFull
		if full == "" {
			full = fakecuda.FullRefuse
		}
		for name, val := range map[string]string{
			fakecuda.UUIDFile:            g.UUID,
			fakecuda.MemoryFile:          strconv.FormatUint(g.MemoryBytes, 10),
			fakecuda.DriverFile:          spec.Driver,
			fakecuda.RestoreWhenFullFile: full,
		} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte(val+"\n"), 0o644); err != nil {
				return nil, fmt.Errorf("fake GPU setup: %w", err)
			}
		}
		// the lock file is never truncated or replaced: a process may hold its flock
		f, err := os.OpenFile(filepath.Join(dir, fakecuda.LockFile), os.O_CREATE|os.O_RDONLY, 0o644)
		if err != nil {
			return nil, fmt.Errorf("fake GPU setup: %w", err)
		}
		f.Close()
	}
	unavailable := filepath.Join(root, ProcessMemoryUnavailableFile)
	var err error
	if spec.ProcessMemoryUnavailable {
		err = os.WriteFile(unavailable, nil, 0o644)
	} else if err = os.Remove(unavailable); errors.Is(err, os.ErrNotExist) {
		err = nil
	}
	if err != nil {
		return nil, fmt.Errorf("fake GPU setup: %w", err)
	}
	b, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("fake GPU setup: %w", err)
	}
	if err := os.WriteFile(filepath.Join(root, InventoryFile), append(b, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("fake GPU setup: %w", err)
	}
	return Open(root)
}

// Open opens the fake GPU root that Setup created at root.
func Open(root string) (*Node, error) {
	b, err := os.ReadFile(filepath.Join(root, InventoryFile))
	if err != nil {
		return nil, fmt.Errorf("fake GPU node: %w", err)
	}
	var spec NodeSpec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("fake GPU node %s: %w", filepath.Join(root, InventoryFile), err)
	}
	if err := validate(spec); err != nil {
		return nil, fmt.Errorf("fake GPU node %s: %w", root, err)
	}
	for _, g := range spec.GPUs {
		if _, err := os.Stat(filepath.Join(root, g.UUID, fakecuda.UUIDFile)); err != nil {
			return nil, fmt.Errorf("fake GPU node %s: GPU %s: %w", root, g.UUID, err)
		}
	}
	return &Node{root: root, spec: spec}, nil
}

func validate(spec NodeSpec) error {
	if _, err := parseMajor(spec.Driver); err != nil {
		return err
	}
	switch spec.RestoreWhenFull {
	case "", fakecuda.FullRefuse, fakecuda.FullHang:
	default:
		return fmt.Errorf("restoreWhenFull %q: want %q or %q", spec.RestoreWhenFull, fakecuda.FullRefuse, fakecuda.FullHang)
	}
	seen := map[string]bool{}
	for i, g := range spec.GPUs {
		if !strings.HasPrefix(g.UUID, "GPU-") || strings.ContainsAny(g.UUID, "/,\n") || g.UUID == "GPU-" {
			return fmt.Errorf("GPU %d: UUID %q: want GPU-<id> without '/' or ','", i, g.UUID)
		}
		if seen[g.UUID] {
			return fmt.Errorf("GPU %d: UUID %s listed twice", i, g.UUID)
		}
		seen[g.UUID] = true
	}
	if _, err := linksTopology(spec); err != nil {
		return err
	}
	return nil
}

func parseMajor(driver string) (int, error) {
	major, err := strconv.Atoi(strings.SplitN(driver, ".", 2)[0])
	if err != nil || major <= 0 {
		return 0, fmt.Errorf("driver version %q: want MAJOR.MINOR[.PATCH]", driver)
	}
	return major, nil
}

// Root returns the node's fake GPU root.
func (n *Node) Root() string { return n.root }

// Spec returns the node's NodeSpec.
func (n *Node) Spec() NodeSpec {
	s := n.spec
	s.GPUs = slices.Clone(s.GPUs)
	return s
}

// Dir returns the directory of GPU uuid, or an error naming it if the node has no such GPU.
func (n *Node) Dir(uuid string) (string, error) {
	for _, g := range n.spec.GPUs {
		if g.UUID == uuid {
			return filepath.Join(n.root, g.UUID), nil
		}
	}
	return "", fmt.Errorf("fake GPU node %s has no GPU %s", n.root, uuid)
}

// Versions returns the node's driver versions.
func (n *Node) Versions() (gpu.Versions, error) {
	major, err := parseMajor(n.spec.Driver)
	if err != nil {
		return gpu.Versions{}, err
	}
	return gpu.Versions{Driver: n.spec.Driver, DriverMajor: major, CUDA: n.spec.CUDA}, nil
}

// SetRestoreWhenFull sets what a CUDA restore onto a full GPU of the node does from now on
// (NodeSpec.RestoreWhenFull: fakecuda.FullRefuse or fakecuda.FullHang), for every GPU, in the
// node's files: processes read it at each restore, shims that open the node later see it.
func (n *Node) SetRestoreWhenFull(mode string) error {
	spec := n.Spec()
	spec.RestoreWhenFull = mode
	if _, err := Setup(n.root, spec); err != nil {
		return err
	}
	n.spec = spec
	return nil
}

// SetProcessMemoryUnavailable sets NodeSpec.ProcessMemoryUnavailable from now on, in the node's
// files (ProcessMemory of every Node of this root sees it at its next call).
func (n *Node) SetProcessMemoryUnavailable(unavailable bool) error {
	spec := n.Spec()
	spec.ProcessMemoryUnavailable = unavailable
	if _, err := Setup(n.root, spec); err != nil {
		return err
	}
	n.spec = spec
	return nil
}

// ProcessMemory returns the device memory host PID pid holds on each of the node's GPUs, keyed
// by UUID, in bytes, as the driver accounts it (NVML's per-process used memory): the size of
// every device memory file of the GPU that pid maps, found by device and inode in
// /proc/<pid>/maps, so it does not ask the process (which may be locked, or stuck in a restore).
// A process without device memory (not a CUDA process, a CHECKPOINTED one, or one that has
// exited) gets an empty map; reading another user's maps needs root (else an error wrapping
// gpu.ErrUnsupported). Where the node's NodeSpec has ProcessMemoryUnavailable, it fails wrapping
// gpu.ErrUnsupported.
func (n *Node) ProcessMemory(pid int) (map[string]uint64, error) {
	if _, err := os.Stat(filepath.Join(n.root, ProcessMemoryUnavailableFile)); err == nil {
		return nil, fmt.Errorf("fake GPU node %s: device memory of pid %d: not available (%s): %w",
			n.root, pid, ProcessMemoryUnavailableFile, gpu.ErrUnsupported)
	}
	type file struct {
		uuid string
		size uint64
	}
	files := map[[2]uint64]file{} // {dev, ino}
	for _, g := range n.spec.GPUs {
		dir := filepath.Join(n.root, g.UUID)
		ents, err := os.ReadDir(dir)
		if err != nil {
			return nil, fmt.Errorf("fake GPU %s: %w", g.UUID, err)
		}
		for _, e := range ents {
			if !strings.HasPrefix(e.Name(), fakecuda.MemPrefix) {
				continue
			}
			var st unix.Stat_t
			if err := unix.Stat(filepath.Join(dir, e.Name()), &st); err != nil {
				continue // freed meanwhile
			}
			files[[2]uint64{st.Dev, st.Ino}] = file{g.UUID, uint64(st.Size)}
		}
	}
	use := map[string]uint64{}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH) {
		return use, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fake GPU memory of pid %d: %w: %w", pid, err, gpu.ErrUnsupported)
	}
	seen := map[[2]uint64]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		// address perms offset dev inode [path]
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		var major, minor uint32
		if _, err := fmt.Sscanf(f[3], "%x:%x", &major, &minor); err != nil {
			continue
		}
		ino, err := strconv.ParseUint(f[4], 10, 64)
		if err != nil || ino == 0 {
			continue
		}
		k := [2]uint64{unix.Mkdev(major, minor), ino}
		if fl, ok := files[k]; ok && !seen[k] {
			seen[k] = true
			use[fl.uuid] += fl.size
		}
	}
	return use, nil
}

// Devices returns the node's GPUs in spec order. MemoryUsed is what live processes (and
// reservations) hold: the device memory of processes that have exited is freed first
// (fakecuda.Account deletes their files), as the driver frees it.
func (n *Node) Devices() ([]gpu.Device, error) {
	out := make([]gpu.Device, 0, len(n.spec.GPUs))
	for i, g := range n.spec.GPUs {
		dir := filepath.Join(n.root, g.UUID)
		mem, err := fakecuda.Account(dir)
		if err != nil {
			return nil, fmt.Errorf("fake GPU %s: %w", g.UUID, err)
		}
		out = append(out, gpu.Device{
			Index:             i,
			UUID:              g.UUID,
			Name:              g.Name,
			Arch:              g.Arch,
			ComputeCapability: g.ComputeCapability,
			MemoryTotal:       g.MemoryBytes,
			MemoryUsed:        mem.Used,
			NUMANode:          -1,
			DevicePaths:       []string{dir},
			Persistence:       true,
		})
	}
	return out, nil
}

// ContainerDevicePath returns where a container sees its GPU i ("/dev/berth-gpu/<i>").
func ContainerDevicePath(i int) string { return path.Join(DevRoot, strconv.Itoa(i)) }

// ContainerMounts returns the bind mounts and environment entry that give a container the
// node's GPUs uuids, in that device order.
func ContainerMounts(node *Node, uuids []string) ([]specs.Mount, []string, error) {
	if len(uuids) == 0 {
		return nil, nil, errors.New("fake GPU mounts: no GPUs")
	}
	var mounts []specs.Mount
	for i, u := range uuids {
		if slices.Contains(uuids[:i], u) {
			return nil, nil, fmt.Errorf("fake GPU mounts: GPU %s listed twice", u)
		}
		dir, err := node.Dir(u)
		if err != nil {
			return nil, nil, fmt.Errorf("fake GPU mounts: %w", err)
		}
		mounts = append(mounts, specs.Mount{
			Destination: ContainerDevicePath(i),
			Type:        "bind",
			Source:      dir,
			Options:     []string{"rbind", "rw"},
		})
	}
	return mounts, []string{EnvGPUs + "=" + strings.Join(uuids, ",")}, nil
}

// ContainerGPUs returns the fake GPUs of spec in device order, from its EnvGPUs entry; none when
// it has none.
func ContainerGPUs(spec *specs.Spec) ([]string, error) {
	if spec == nil || spec.Process == nil {
		return nil, nil
	}
	var uuids []string
	for _, e := range spec.Process.Env {
		if v, ok := strings.CutPrefix(e, EnvGPUs+"="); ok {
			uuids = nil
			if v == "" {
				continue
			}
			for _, u := range strings.Split(v, ",") {
				if !strings.HasPrefix(u, "GPU-") {
					return nil, fmt.Errorf("fake GPUs: %s: bad UUID %q", EnvGPUs, u)
				}
				uuids = append(uuids, u)
			}
		}
	}
	return uuids, nil
}

// AdaptSpec rewrites spec for a restore on node: each GPU i of the container (ContainerGPUs)
// becomes pairs' New for its Old (or stays the same UUID), its /dev/berth-gpu/<i> bind mount
// gets node's directory of that GPU as source (added if missing; the destination is kept so the
// restored process finds its devices at the same paths), and EnvGPUs names the new UUIDs.
// Errors name a GPU the node lacks.
func AdaptSpec(spec *specs.Spec, node *Node, pairs []gpu.UUIDPair) error {
	old, err := ContainerGPUs(spec)
	if err != nil {
		return err
	}
	if len(old) == 0 {
		return nil
	}
	remap := map[string]string{}
	for _, p := range pairs {
		remap[p.Old] = p.New
	}
	uuids := make([]string, len(old))
	for i, u := range old {
		uuids[i] = u
		if n, ok := remap[u]; ok {
			uuids[i] = n
		}
	}
	mounts, env, err := ContainerMounts(node, uuids)
	if err != nil {
		return fmt.Errorf("adapt spec: %w", err)
	}
	for _, m := range mounts {
		found := false
		for j := range spec.Mounts {
			if path.Clean(spec.Mounts[j].Destination) == m.Destination {
				spec.Mounts[j].Source = m.Source
				found = true
			}
		}
		if !found {
			spec.Mounts = append(spec.Mounts, m)
		}
	}
	for j, e := range spec.Process.Env {
		if strings.HasPrefix(e, EnvGPUs+"=") {
			spec.Process.Env[j] = env[0]
		}
	}
	return nil
}
