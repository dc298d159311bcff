package node

import (
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// Sentinel errors. Every error of this package wraps exactly one of them.
var (
	// ErrSysfs: a sysfs file is missing, unreadable or malformed; the error names the file.
	ErrSysfs = errors.New("read node topology from sysfs")
	// ErrInconsistent: the parts of the model disagree (a GPU's affinity names a CPU that is not
	// online or a NUMA node that does not exist, a CPU in no NUMA node, ...).
	ErrInconsistent = errors.New("inconsistent node model")
)

// CPU is one online logical CPU.
type CPU struct {
	// ID is the Linux logical CPU id (sysfs cpu<ID>).
	ID int `json:"id"`
	// Socket is the physical package id (topology/physical_package_id).
	Socket int `json:"socket"`
	// Core is the core id (topology/core_id); unique only within a socket.
	Core int `json:"core"`
	// NUMA is the id of the NUMA node the CPU belongs to (node<N>/cpulist).
	NUMA int `json:"numa"`
	// Siblings are the online CPU ids of this CPU's core, itself included, ascending
	// (topology/thread_siblings_list): SMT siblings share a core.
	Siblings []int `json:"siblings"`
}

// NUMANode is one NUMA node.
type NUMANode struct {
	// ID is the Linux NUMA node id (sysfs node<ID>).
	ID int `json:"id"`
	// CPUs are the online CPU ids of the node, ascending; empty for a memory-only node
	// (for example the GPU memory of a Grace system, or CXL memory).
	CPUs []int `json:"cpus"`
	// MemTotal is the node's memory in bytes (node<ID>/meminfo "MemTotal"); 0 when unknown.
	MemTotal uint64 `json:"memTotal"`
	// Distance maps every NUMA node id to the relative distance from this node
	// (node<ID>/distance; 10 is local, larger is farther).
	Distance map[int]int `json:"distance"`
}

// Node is the model of one node. Build it with ReadSysfs (and WithGPUs) or FromTopology; it is
// immutable afterwards. Use the methods for lookups: they are O(1).
type Node struct {
	// CPUs are the online CPUs, ascending by ID.
	CPUs []CPU `json:"cpus"`
	// NUMANodes are the online NUMA nodes, ascending by ID.
	NUMANodes []NUMANode `json:"numaNodes"`
	// GPUs is the GPU topology (links, affinity); nil when the node has no GPUs.
	GPUs *topology.Topology `json:"-"`
	// Devices are the GPUs' identities (UUID, device nodes), index-aligned with GPUs.GPUs. A
	// Device's UUID is "" when unknown; DevicePaths nil means the default /dev/nvidia<Index>.
	Devices []gpu.Device `json:"gpus,omitempty"`
	// Source says where the model came from, for `berthctl topology` ("sysfs /sys", ...).
	Source string `json:"source"`

	cpuIdx  []int   // by CPU id: index into CPUs, -1 if not online
	numaIdx []int   // by NUMA id: index into NUMANodes, -1 if none
	gpuNUMA [][]int // by GPU index: NUMA node ids (with CPUs) the GPU is close to; nil unknown
}

// CPU returns the online CPU with id, and whether there is one.
func (n *Node) CPU(id int) (CPU, bool) {
	if id < 0 || id >= len(n.cpuIdx) || n.cpuIdx[id] < 0 {
		return CPU{}, false
	}
	return n.CPUs[n.cpuIdx[id]], true
}

// MaxCPUID returns the largest online CPU id, or -1 for a node without CPUs.
func (n *Node) MaxCPUID() int { return len(n.cpuIdx) - 1 }

// NUMA returns the NUMA node with id, and whether there is one.
func (n *Node) NUMA(id int) (NUMANode, bool) {
	if id < 0 || id >= len(n.numaIdx) || n.numaIdx[id] < 0 {
		return NUMANode{}, false
	}
	return n.NUMANodes[n.numaIdx[id]], true
}

// NUMAIDs returns the ids of the NUMA nodes that have CPUs, ascending: the nodes a container
// can be aligned to.
func (n *Node) NUMAIDs() []int {
	var ids []int
	for _, m := range n.NUMANodes {
		if len(m.CPUs) > 0 {
			ids = append(ids, m.ID)
		}
	}
	return ids
}

// NumGPUs returns the number of GPUs (0 without a topology).
func (n *Node) NumGPUs() int {
	if n.GPUs == nil {
		return 0
	}
	return len(n.GPUs.GPUs)
}

// GPUNUMA returns the ids of the NUMA nodes (with CPUs) GPU index i is close to, ascending: the
// topology's NUMA affinity where known, else the NUMA nodes of its CPU affinity; nil when both
// are unknown. The slice is shared: do not modify it.
func (n *Node) GPUNUMA(i int) []int { return n.gpuNUMA[i] }

// GPUUUID returns GPU index i's UUID ("GPU-..."), or "" when unknown.
func (n *Node) GPUUUID(i int) string {
	if i < len(n.Devices) {
		return n.Devices[i].UUID
	}
	return ""
}

// GPUByUUID returns the index of the GPU with the given UUID, and whether there is one.
func (n *Node) GPUByUUID(uuid string) (int, bool) {
	for i, d := range n.Devices {
		if d.UUID != "" && d.UUID == uuid {
			return i, true
		}
	}
	return 0, false
}

// GPUDevicePaths returns the device nodes of GPU index i: the inventory's DevicePaths, or
// "/dev/nvidia<i>" (the NVIDIA driver's convention: minor number = index) when it has none.
func (n *Node) GPUDevicePaths(i int) []string {
	if i < len(n.Devices) && len(n.Devices[i].DevicePaths) > 0 {
		return n.Devices[i].DevicePaths
	}
	return []string{"/dev/nvidia" + strconv.Itoa(i)}
}

// WithGPUs returns a copy of n with the GPU topology t and the identities devs (index-aligned
// with t.GPUs, may be nil: UUIDs unknown). t must be valid; every CPU id of a GPU's CPU affinity
// must be online and every NUMA node id of its NUMA affinity must exist on n. A GPU whose NUMA
// affinity is unknown gets the NUMA nodes of its CPU affinity. NUMA nodes without CPUs (Grace
// GPU memory) are left out of a GPU's alignment. Errors wrap ErrInconsistent (or the topology's
// ErrMalformed) and name the GPU and the id.
func (n *Node) WithGPUs(t *topology.Topology, devs []gpu.Device) (*Node, error) {
	if t == nil {
		c := *n
		c.GPUs, c.Devices, c.gpuNUMA = nil, nil, nil
		return &c, nil
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("add GPUs to node model: %w", err)
	}
	if devs != nil && len(devs) != len(t.GPUs) {
		return nil, fmt.Errorf("add GPUs to node model: %w: the topology has %d GPUs but the inventory lists %d",
			ErrInconsistent, len(t.GPUs), len(devs))
	}
	seen := map[string]int{}
	for i, d := range devs {
		if d.Index != i {
			return nil, fmt.Errorf("add GPUs to node model: %w: inventory entry %d has index %d", ErrInconsistent, i, d.Index)
		}
		if d.UUID == "" {
			continue
		}
		if j, dup := seen[d.UUID]; dup {
			return nil, fmt.Errorf("add GPUs to node model: %w: GPUs %d and %d have the same UUID %s", ErrInconsistent, j, i, d.UUID)
		}
		seen[d.UUID] = i
	}
	c := *n
	c.GPUs, c.Devices = t, devs
	c.gpuNUMA = make([][]int, len(t.GPUs))
	for i, g := range t.GPUs {
		for _, id := range g.CPUs {
			if _, ok := n.CPU(id); !ok {
				return nil, fmt.Errorf("add GPUs to node model: %w: GPU%d's CPU affinity names CPU %d, which is not online here (online: %s)",
					ErrInconsistent, i, id, topology.FormatIDList(n.cpuIDs()))
			}
		}
		var numa []int
		for _, id := range g.NUMA {
			m, ok := n.NUMA(id)
			if !ok {
				return nil, fmt.Errorf("add GPUs to node model: %w: GPU%d's NUMA affinity names NUMA node %d, which does not exist here (nodes: %s)",
					ErrInconsistent, i, id, topology.FormatIDList(n.numaIDs()))
			}
			if len(m.CPUs) > 0 {
				numa = append(numa, id)
			}
		}
		if len(numa) == 0 {
			for _, id := range g.CPUs {
				cpu, _ := n.CPU(id)
				numa = append(numa, cpu.NUMA)
			}
		}
		if len(numa) > 0 {
			slices.Sort(numa)
			c.gpuNUMA[i] = slices.Compact(numa)
		}
	}
	return &c, nil
}

func (n *Node) cpuIDs() []int {
	ids := make([]int, len(n.CPUs))
	for i, c := range n.CPUs {
		ids[i] = c.ID
	}
	return ids
}

func (n *Node) numaIDs() []int {
	ids := make([]int, len(n.NUMANodes))
	for i, m := range n.NUMANodes {
		ids[i] = m.ID
	}
	return ids
}

// build checks the CPU and NUMA parts and fills the lookup tables. cpus and numa must be sorted
// by id. Errors wrap ErrInconsistent.
func build(cpus []CPU, numa []NUMANode, source string) (*Node, error) {
	n := &Node{CPUs: cpus, NUMANodes: numa, Source: source}
	if len(cpus) == 0 {
		return nil, fmt.Errorf("%w: no online CPUs", ErrInconsistent)
	}
	n.cpuIdx = make([]int, cpus[len(cpus)-1].ID+1)
	for i := range n.cpuIdx {
		n.cpuIdx[i] = -1
	}
	for i, c := range cpus {
		n.cpuIdx[c.ID] = i
	}
	maxNUMA := 0
	for _, m := range numa {
		maxNUMA = max(maxNUMA, m.ID)
	}
	n.numaIdx = make([]int, maxNUMA+1)
	for i := range n.numaIdx {
		n.numaIdx[i] = -1
	}
	for i, m := range numa {
		n.numaIdx[m.ID] = i
	}
	for _, c := range cpus {
		m, ok := n.NUMA(c.NUMA)
		if !ok || !slices.Contains(m.CPUs, c.ID) {
			return nil, fmt.Errorf("%w: CPU %d is in no NUMA node's cpulist", ErrInconsistent, c.ID)
		}
		if !slices.Contains(c.Siblings, c.ID) {
			return nil, fmt.Errorf("%w: CPU %d is not among its own thread siblings %s", ErrInconsistent, c.ID, topology.FormatIDList(c.Siblings))
		}
		for _, s := range c.Siblings {
			sc, ok := n.CPU(s)
			if !ok {
				return nil, fmt.Errorf("%w: CPU %d's sibling %d is not online", ErrInconsistent, c.ID, s)
			}
			if !slices.Equal(sc.Siblings, c.Siblings) {
				return nil, fmt.Errorf("%w: CPU %d lists siblings %s but its sibling %d lists %s", ErrInconsistent,
					c.ID, topology.FormatIDList(c.Siblings), s, topology.FormatIDList(sc.Siblings))
			}
		}
	}
	for _, m := range numa {
		for _, id := range m.CPUs {
			if c, ok := n.CPU(id); !ok || c.NUMA != m.ID {
				return nil, fmt.Errorf("%w: NUMA node %d lists CPU %d, which is not online or belongs to another node", ErrInconsistent, m.ID, id)
			}
		}
		for _, o := range numa {
			if _, ok := m.Distance[o.ID]; !ok && m.Distance != nil {
				return nil, fmt.Errorf("%w: NUMA node %d has no distance to node %d", ErrInconsistent, m.ID, o.ID)
			}
		}
	}
	return n, nil
}

// Distance returns the NUMA distance from node a to node b (10 when unknown and a == b,
// 20 when unknown otherwise: the kernel's defaults).
func (n *Node) Distance(a, b int) int {
	if m, ok := n.NUMA(a); ok {
		if d, ok := m.Distance[b]; ok {
			return d
		}
	}
	if a == b {
		return 10
	}
	return 20
}
