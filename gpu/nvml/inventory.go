package nvml

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// Lib is the part of NVML the inventory uses, one method per fact, in berth's types. The real
// one wraps go-nvml (Open); tests pass a fake to New. Devices are named by NVML index.
type Lib interface {
	// DriverVersion is nvmlSystemGetDriverVersion ("580.65.06").
	DriverVersion() (string, error)
	// CUDADriverVersion is nvmlSystemGetCudaDriverVersion (1000*major + 10*minor: 12080).
	CUDADriverVersion() (int, error)
	// DeviceCount is nvmlDeviceGetCount.
	DeviceCount() (int, error)
	// Device returns the static facts of the GPU at index (see DeviceInfo for the calls).
	Device(index int) (DeviceInfo, error)
	// NVLinks returns the active NVLinks of the GPU at index (nvmlDeviceGetNvLinkState,
	// ...GetNvLinkRemotePciInfo, ...GetNvLinkRemoteDeviceType for links 0..NVML_NVLINK_MAX_LINKS-1);
	// none on GPUs without NVLink.
	NVLinks(index int) ([]NVLink, error)
	// CommonAncestor is nvmlDeviceGetTopologyCommonAncestor of the GPUs at indices i and j.
	CommonAncestor(i, j int) (Ancestor, error)
	// ComputeProcesses is nvmlDeviceGetComputeRunningProcesses of the GPU at index: every process
	// with a compute (CUDA) context on it and the device memory it uses. An error wraps
	// gpu.ErrUnsupported when the GPU cannot report it (NVML_ERROR_NOT_SUPPORTED).
	ComputeProcesses(index int) ([]Process, error)
}

// Process is one entry of nvmlDeviceGetComputeRunningProcesses.
type Process struct {
	// PID is the process's PID as NVML sees it: the host PID for a caller in the host's PID
	// namespace (the shim).
	PID int
	// UsedMemory is usedGpuMemory in bytes, or MemoryNotAvailable.
	UsedMemory uint64
}

// MemoryNotAvailable is NVML_VALUE_NOT_AVAILABLE as usedGpuMemory reports it: NVML knows the
// process but not its memory (for example without the rights to see other users' processes).
const MemoryNotAvailable = ^uint64(0)

// DeviceInfo is what NVML says about one GPU.
type DeviceInfo struct {
	UUID string // nvmlDeviceGetUUID, "GPU-<uuid>"
	Name string // nvmlDeviceGetName, "NVIDIA H200"
	// Arch is nvmlDeviceGetArchitecture as a lower-case name ("hopper"), "" when unknown.
	Arch string
	// CCMajor and CCMinor are nvmlDeviceGetCudaComputeCapability (9, 0).
	CCMajor, CCMinor int
	// MemoryTotal and MemoryUsed are nvmlDeviceGetMemoryInfo's total and used, in bytes.
	MemoryTotal, MemoryUsed uint64
	// PCIBusID is nvmlDeviceGetPciInfo's busId ("00000000:18:00.0", any case).
	PCIBusID string
	// Minor is nvmlDeviceGetMinorNumber (/dev/nvidia<Minor>), -1 when unknown.
	Minor int
	// CPUAffinity is nvmlDeviceGetCpuAffinity as Linux CPU ids; nil when unknown.
	CPUAffinity []int
	// MIG is nvmlDeviceGetMigMode's current mode == enabled; false where MIG is not supported.
	MIG bool
	// Persistence is nvmlDeviceGetPersistenceMode == enabled.
	Persistence bool
}

// RemoteType is what sits at the far end of an NVLink (nvmlIntNvLinkDeviceType_t).
type RemoteType int

// Remote ends of an NVLink.
const (
	RemoteUnknown RemoteType = iota // NVML cannot tell (old drivers): decided by the bus id
	RemoteGPU                       // NVML_NVLINK_DEVICE_TYPE_GPU
	RemoteSwitch                    // NVML_NVLINK_DEVICE_TYPE_SWITCH (NVSwitch)
	RemoteOther                     // IBM NPU and the like: ignored
)

// NVLink is one active NVLink of a GPU: its link number and the PCI bus id and kind of the device
// at the other end.
type NVLink struct {
	Link        int
	RemoteBusID string
	Remote      RemoteType
}

// Ancestor is nvmlGpuTopologyLevel_t: the closest common ancestor of two GPUs on PCIe.
type Ancestor int

// The values of nvmlGpuTopologyLevel_t.
const (
	AncestorInternal   Ancestor = 0  // NVML_TOPOLOGY_INTERNAL: same board (multi-GPU board)
	AncestorSingle     Ancestor = 10 // NVML_TOPOLOGY_SINGLE: one PCIe switch
	AncestorMultiple   Ancestor = 20 // NVML_TOPOLOGY_MULTIPLE: several PCIe switches
	AncestorHostBridge Ancestor = 30 // NVML_TOPOLOGY_HOSTBRIDGE: the same PCIe host bridge
	AncestorNode       Ancestor = 40 // NVML_TOPOLOGY_NODE: host bridges of one NUMA node
	AncestorSystem     Ancestor = 50 // NVML_TOPOLOGY_SYSTEM: across NUMA nodes (SMP interconnect)
)

// Link returns the `nvidia-smi topo -m` class of a: INTERNAL and SINGLE are PIX, MULTIPLE PXB,
// HOSTBRIDGE PHB, NODE NODE, SYSTEM SYS; anything else is an error.
func (a Ancestor) Link() (topology.Link, error) {
	switch a {
	case AncestorInternal, AncestorSingle:
		return topology.PIX, nil
	case AncestorMultiple:
		return topology.PXB, nil
	case AncestorHostBridge:
		return topology.PHB, nil
	case AncestorNode:
		return topology.NODE, nil
	case AncestorSystem:
		return topology.SYS, nil
	}
	return topology.Link{}, fmt.Errorf("unknown NVML topology level %d", int(a))
}

// DefaultSysfsRoot is where sysfs is mounted.
const DefaultSysfsRoot = "/sys"

// Option configures an Inventory.
type Option func(*options)

type options struct {
	sysfs   string
	libPath string
}

// WithSysfsRoot reads sysfs under root instead of DefaultSysfsRoot (a host's /sys mounted
// elsewhere, or a test fixture).
func WithSysfsRoot(root string) Option { return func(o *options) { o.sysfs = root } }

// WithLibraryPath makes Open load NVML from path instead of libnvidia-ml.so.1 (no effect on New).
func WithLibraryPath(path string) Option { return func(o *options) { o.libPath = path } }

func newOptions(opts []Option) options {
	o := options{sysfs: DefaultSysfsRoot}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// Inventory is gpu.Inventory on NVML, plus the node's topology. Make one with Open (real NVML)
// or New (any Lib). Each call asks NVML afresh (memory used changes); nothing is cached.
type Inventory struct {
	lib   Lib
	sysfs string
	close func() error
}

var _ gpu.Inventory = (*Inventory)(nil)

// New returns an Inventory over lib, which must already be initialised.
func New(lib Lib, opts ...Option) *Inventory {
	o := newOptions(opts)
	return &Inventory{lib: lib, sysfs: o.sysfs, close: func() error { return nil }}
}

// Close releases NVML (nvmlShutdown) when the Inventory came from Open.
func (inv *Inventory) Close() error { return inv.close() }

// Versions returns the kernel driver version (nvmlSystemGetDriverVersion) and the CUDA driver API
// version (nvmlSystemGetCudaDriverVersion, formatted "12.8").
func (inv *Inventory) Versions() (gpu.Versions, error) {
	drv, err := inv.lib.DriverVersion()
	if err != nil {
		return gpu.Versions{}, fmt.Errorf("get NVIDIA driver version: %w", err)
	}
	cv, err := inv.lib.CUDADriverVersion()
	if err != nil {
		return gpu.Versions{}, fmt.Errorf("get CUDA driver version: %w", err)
	}
	v := gpu.Versions{Driver: drv, CUDA: fmt.Sprintf("%d.%d", cv/1000, (cv%1000)/10)}
	head, _, _ := strings.Cut(drv, ".")
	if v.DriverMajor, err = strconv.Atoi(head); err != nil {
		return gpu.Versions{}, fmt.Errorf("NVIDIA driver version %q: no major number", drv)
	}
	return v, nil
}

// Devices returns every GPU in NVML index order. NUMANode comes from sysfs
// (<root>/bus/pci/devices/<bus id>/numa_node; -1 when absent or unknown), DevicePaths are
// /dev/nvidia<minor>, the rest from NVML (see DeviceInfo).
func (inv *Inventory) Devices() ([]gpu.Device, error) {
	n, err := inv.lib.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("count GPUs: %w", err)
	}
	devs := make([]gpu.Device, 0, n)
	for i := range n {
		info, err := inv.lib.Device(i)
		if err != nil {
			return nil, fmt.Errorf("read GPU %d: %w", i, err)
		}
		d := gpu.Device{
			Index:       i,
			UUID:        info.UUID,
			Name:        info.Name,
			Arch:        info.Arch,
			MemoryTotal: info.MemoryTotal,
			MemoryUsed:  info.MemoryUsed,
			PCIBusID:    NormalizeBusID(info.PCIBusID),
			NUMANode:    -1,
			CPUAffinity: info.CPUAffinity,
			MIG:         info.MIG,
			Persistence: info.Persistence,
		}
		if info.CCMajor > 0 {
			d.ComputeCapability = fmt.Sprintf("%d.%d", info.CCMajor, info.CCMinor)
		}
		if info.Minor >= 0 {
			d.DevicePaths = []string{"/dev/nvidia" + strconv.Itoa(info.Minor)}
		}
		if d.PCIBusID != "" {
			if node, err := readNUMANode(inv.sysfs, d.PCIBusID); err == nil {
				d.NUMANode = node
			}
		}
		devs = append(devs, d)
	}
	return devs, nil
}

// ProcessMemory returns the device memory host PID pid holds on each GPU, in bytes, keyed by GPU
// UUID, from nvmlDeviceGetComputeRunningProcesses of every GPU (several entries of pid on one GPU,
// as with MIG, are added up). A GPU that does not list pid is absent. Errors name the GPU index;
// a value NVML reports as not available (MemoryNotAvailable) or a GPU that cannot list its
// processes gives an error wrapping gpu.ErrUnsupported.
func (inv *Inventory) ProcessMemory(pid int) (map[string]uint64, error) {
	n, err := inv.lib.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("count GPUs: %w", err)
	}
	out := map[string]uint64{}
	for i := range n {
		procs, err := inv.lib.ComputeProcesses(i)
		if err != nil {
			return nil, fmt.Errorf("processes on GPU %d: %w", i, err)
		}
		var used uint64
		listed := false
		for _, p := range procs {
			if p.PID != pid {
				continue
			}
			if p.UsedMemory == MemoryNotAvailable {
				return nil, fmt.Errorf("device memory of pid %d on GPU %d: NVML reports it as not available: %w", pid, i, gpu.ErrUnsupported)
			}
			used += p.UsedMemory
			listed = true
		}
		if !listed {
			continue
		}
		info, err := inv.lib.Device(i)
		if err != nil {
			return nil, fmt.Errorf("read GPU %d: %w", i, err)
		}
		out[info.UUID] += used
	}
	return out, nil
}

// Topology returns the node's GPUs and the link between every pair: NV<n> where the pair shares
// NVLinks (directly, or through the same NVSwitches), else the PCIe class from
// nvmlDeviceGetTopologyCommonAncestor. Each GPU's CPUs are its NVML CPU affinity and its NUMA the
// sysfs NUMA node of its PCI device; GPUNUMA is -1.
func (inv *Inventory) Topology() (*topology.Topology, error) {
	devs, err := inv.Devices()
	if err != nil {
		return nil, err
	}
	return inv.topology(devs)
}

func (inv *Inventory) topology(devs []gpu.Device) (*topology.Topology, error) {
	n := len(devs)
	if n == 0 {
		return nil, fmt.Errorf("build GPU topology: no GPUs")
	}
	t := &topology.Topology{GPUs: make([]topology.GPU, n), Links: make([][]topology.Link, n)}
	for i, d := range devs {
		g := topology.GPU{Index: i, CPUs: d.CPUAffinity, GPUNUMA: -1}
		if d.NUMANode >= 0 {
			g.NUMA = []int{d.NUMANode}
		}
		t.GPUs[i] = g
	}
	counts, err := inv.nvlinkCounts(devs)
	if err != nil {
		return nil, err
	}
	for i := range n {
		t.Links[i] = make([]topology.Link, n)
		for j := range n {
			switch {
			case i == j:
				t.Links[i][j] = topology.Self
			case counts[i][j] > 0:
				t.Links[i][j] = topology.NV(min(counts[i][j], topology.MaxNVLinks))
			case j < i:
				t.Links[i][j] = t.Links[j][i]
			default:
				a, err := inv.lib.CommonAncestor(i, j)
				if err != nil {
					return nil, fmt.Errorf("PCIe relation of GPU %d and GPU %d: %w", i, j, err)
				}
				if t.Links[i][j], err = a.Link(); err != nil {
					return nil, fmt.Errorf("PCIe relation of GPU %d and GPU %d: %w", i, j, err)
				}
			}
		}
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("build GPU topology: %w", err)
	}
	return t, nil
}

// nvlinkCounts returns, for every pair of GPUs, the NVLinks between them. A link whose remote end
// is another GPU counts for that pair. A link whose remote end is an NVSwitch connects the GPU to
// every GPU on that switch, so for a pair it counts min(links of i to the switch, links of j to the
// switch), summed over the switches both reach: 8 GPUs with 18 links over 4 switches (5+4+4+5)
// give NV18 for every pair, as nvidia-smi reports. Counting switch links as links to nobody, or
// attributing them by the remote bus id, would make an HGX board look like PCIe only.
func (inv *Inventory) nvlinkCounts(devs []gpu.Device) ([][]int, error) {
	n := len(devs)
	byBus := make(map[string]int, n)
	for i, d := range devs {
		if d.PCIBusID != "" {
			byBus[d.PCIBusID] = i
		}
	}
	counts := make([][]int, n)
	toSwitch := make([]map[string]int, n) // switch bus id -> links
	for i := range n {
		counts[i] = make([]int, n)
		toSwitch[i] = map[string]int{}
		links, err := inv.lib.NVLinks(i)
		if err != nil {
			return nil, fmt.Errorf("read NVLinks of GPU %d: %w", i, err)
		}
		for _, l := range links {
			bus := NormalizeBusID(l.RemoteBusID)
			j, isGPU := byBus[bus]
			switch {
			case l.Remote == RemoteSwitch, l.Remote == RemoteUnknown && !isGPU:
				toSwitch[i][bus]++
			case isGPU && j != i && (l.Remote == RemoteGPU || l.Remote == RemoteUnknown):
				counts[i][j]++
			}
		}
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			sw := 0
			for bus, li := range toSwitch[i] {
				sw += min(li, toSwitch[j][bus])
			}
			// Direct links are seen from both ends; take the smaller count in case one
			// end reports a link down.
			c := min(counts[i][j], counts[j][i]) + sw
			counts[i][j], counts[j][i] = c, c
		}
	}
	return counts, nil
}

// NormalizeBusID turns NVML's PCI bus id ("00000000:18:00.0") into the sysfs form
// ("0000:18:00.0"): lower case, a 4-digit domain when the domain fits in 4 digits.
func NormalizeBusID(id string) string {
	id = strings.ToLower(strings.TrimSpace(id))
	dom, rest, ok := strings.Cut(id, ":")
	if !ok || strings.Count(rest, ":") != 1 {
		return id
	}
	if len(dom) > 4 && strings.Trim(dom[:len(dom)-4], "0") == "" {
		dom = dom[len(dom)-4:]
	}
	return dom + ":" + rest
}

// readNUMANode reads <root>/bus/pci/devices/<busID>/numa_node; -1 there (no NUMA information)
// is returned as is.
func readNUMANode(root, busID string) (int, error) {
	b, err := os.ReadFile(filepath.Join(root, "bus", "pci", "devices", busID, "numa_node"))
	if err != nil {
		return -1, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < -1 {
		return -1, fmt.Errorf("numa_node of %s: %q", busID, strings.TrimSpace(string(b)))
	}
	return n, nil
}

// CPUMaskIDs turns a CPU bitmask (nvmlDeviceGetCpuAffinity's array of words, CPU k is bit k%bits
// of word k/bits) into ascending CPU ids.
func CPUMaskIDs(words []uint64, bits int) []int {
	ids := []int{}
	for w, word := range words {
		for b := range bits {
			if word&(1<<uint(b)) != 0 {
				ids = append(ids, w*bits+b)
			}
		}
	}
	return ids
}

// ArchName is the lower-case name of an nvmlDeviceArchitecture_t value ("hopper"), "" when
// unknown.
func ArchName(a uint32) string {
	names := map[uint32]string{2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing",
		7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell", 13: "rubin"}
	return names[a]
}

// Snapshot is everything the inventory reports at one time.
type Snapshot struct {
	Versions gpu.Versions       `json:"versions"`
	Devices  []gpu.Device       `json:"devices"`
	Topology *topology.Topology `json:"-"`
}

// Snapshot reads versions, devices and topology with one pass over the devices.
func (inv *Inventory) Snapshot() (Snapshot, error) {
	v, err := inv.Versions()
	if err != nil {
		return Snapshot{}, err
	}
	devs, err := inv.Devices()
	if err != nil {
		return Snapshot{}, err
	}
	t, err := inv.topology(devs)
	if err != nil {
		return Snapshot{}, err
	}
	return Snapshot{Versions: v, Devices: devs, Topology: t}, nil
}

// ErrNotLoaded is wrapped by Open's error when NVML cannot be loaded or initialised; it
// wraps gpu.ErrUnsupported.
var ErrNotLoaded = fmt.Errorf("NVML not available: %w", gpu.ErrUnsupported)

// OpenInventory is Open with no options, returned as a gpu.Inventory (a gpu.Topologist too):
// the inventory opener (backend.InventoryOpener) of processes that read NVML themselves, berthctl
// and berth-shim-helper. Errors are Open's.
func OpenInventory() (gpu.Inventory, error) {
	inv, err := Open()
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return inv, nil
}
