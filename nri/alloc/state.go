package alloc

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/node"
)

// Sentinel errors; every error of this package wraps exactly one of them.
var (
	// ErrInvalidRequest: the request means nothing (negative counts, an unknown policy, a GPU
	// index that is not a GPU of this node, GPUs both chosen and requested).
	ErrInvalidRequest = errors.New("invalid placement request")
	// ErrUnknownPolicy: a policy name that is not none, best-effort, restricted or single-numa-node.
	ErrUnknownPolicy = fmt.Errorf("%w: unknown NUMA policy", ErrInvalidRequest)
	// ErrUnplaceable: the request is valid but cannot be placed now under its policy; the
	// message says why in terms of the node's free GPUs and CPUs per NUMA node.
	ErrUnplaceable = errors.New("cannot place")
	// ErrConflict: a CPU or GPU is already held by another container, or the container id is
	// already placed.
	ErrConflict = errors.New("already allocated")
)

// Policy is a NUMA alignment policy, named as the Kubernetes Topology Manager's.
type Policy string

// The policies; see the package documentation.
const (
	PolicyNone           Policy = "none"
	PolicyBestEffort     Policy = "best-effort"
	PolicyRestricted     Policy = "restricted"
	PolicySingleNUMANode Policy = "single-numa-node"
)

// ParsePolicy returns the policy named s (exactly one of the four names). The error wraps
// ErrUnknownPolicy and lists the valid names.
func ParsePolicy(s string) (Policy, error) {
	switch p := Policy(s); p {
	case PolicyNone, PolicyBestEffort, PolicyRestricted, PolicySingleNUMANode:
		return p, nil
	}
	return "", fmt.Errorf("%w %q (want none, best-effort, restricted or single-numa-node)", ErrUnknownPolicy, s)
}

// Request is what one container needs.
type Request struct {
	// ID is the container id (the key of the allocation); Name names it in messages, as a noun
	// phrase ("container default/infer/main"; "container <ID>" when empty).
	ID, Name string
	// ExclusiveCPUs is the number of whole CPUs the container gets for itself (an integer CPU
	// limit equal to its request); 0 means it shares the pool.
	ExclusiveCPUs int
	// MilliCPU is the container's CPU limit in thousandths of a CPU (0: none). Informational:
	// shared containers are not sized.
	MilliCPU int64
	// GPUs is how many GPUs berth must choose (the berth.dev/gpus annotation); 0 for none.
	GPUs int
	// AssignedGPUs are GPU indices someone else already gave the container (CDI devices,
	// NVIDIA_VISIBLE_DEVICES, /dev/nvidiaN); berth books and aligns to them. Not with GPUs > 0.
	AssignedGPUs []int
	// Policy is the NUMA policy for this container.
	Policy Policy
}

// Placement is where a container goes.
type Placement struct {
	// ID is the container id.
	ID string `json:"-"`
	// CPUs is the container's cpuset.cpus: its exclusive CPUs, or the shared pool of its NUMA
	// nodes when it was placed (CPU ids, ascending).
	CPUs []int `json:"-"`
	// Exclusive reports whether CPUs are the container's alone.
	Exclusive bool `json:"exclusive"`
	// Mems is cpuset.mems (NUMA node ids, ascending); nil means leave it unset (policy none or
	// nothing to align).
	Mems []int `json:"mems,omitempty"`
	// NUMANodes are the NUMA node ids the container is aligned to; its shared pool follows
	// them. nil: not aligned (the whole node).
	NUMANodes []int `json:"numa,omitempty"`
	// GPUs are the container's GPU indices, ascending.
	GPUs []int `json:"gpus,omitempty"`
	// ChosenGPUs reports whether berth chose GPUs (and must inject them); false when they were
	// assigned by someone else or there are none.
	ChosenGPUs bool `json:"chosen,omitempty"`
	// Policy is the policy the container was placed under.
	Policy Policy `json:"policy"`
	// Aligned reports whether the placement uses a preferred NUMA node set (see the package doc).
	Aligned bool `json:"aligned"`
	// Reason explains the choice in words (for logs and the placement annotation).
	Reason string `json:"-"`
	// Warnings are things an operator should know (an assigned GPU set that is not the best
	// connected one, a best-effort placement that is not aligned).
	Warnings []string `json:"-"`
	// Misaligned says, in fixed words, how GPUs someone else gave the container (the kubelet's
	// device plugin or DRA) fall short: MisalignedLinks, MisalignedNUMA; nil when they do not
	// (or berth chose them). Recorded in the placement annotation and counted by berth-nri.
	Misaligned []string `json:"misaligned,omitempty"`
}

// The values of Placement.Misaligned.
const (
	// MisalignedLinks: the assigned GPUs' slowest pair is slower than the best set of as many
	// GPUs on this node has (not one NVLink island when the node has one of that size).
	MisalignedLinks = "gpu_links"
	// MisalignedNUMA: the assigned GPUs hang off more than one NUMA node.
	MisalignedNUMA = "gpu_numa"
)

// Update is a new cpuset for a running shared container whose pool changed.
type Update struct {
	// ID is the container id; CPUs its new cpuset.cpus (CPU ids, ascending). Updates of one call
	// with the same pool share the CPUs slice: treat it as read-only.
	ID   string
	CPUs []int
}

// State is the allocation state of one node: which container holds which exclusive CPUs and
// GPUs, and the shared containers whose pool berth maintains. It is not safe for concurrent use.
type State struct {
	node      *node.Node
	reserved  []bool   // by CPU id
	owner     []string // by CPU id: the container holding it exclusively, "" if none
	gpuOwner  []string // by GPU index
	nReserved int
	pool      int // online CPUs held exclusively by nobody
	ctrs      map[string]*entry
	numaIDs   []int // NUMA nodes with CPUs, ascending; bit p of a mask is numaIDs[p]
	numaPos   map[int]int
	gpuMask   []uint64 // by GPU index: the NUMA mask of the GPU's affinity (0: unknown, fits anywhere)
	masks     []uint64 // candidate NUMA sets, by size then value
	bestRank  map[int]int
}

type entry struct {
	p       Placement
	cur     []int // the cpuset berth last gave it, or observed
	managed bool  // berth placed it: its shared pool is kept up to date
}

// New returns the empty state of node n. reserved are CPU ids never given exclusively (system
// daemons); they must be online. Errors wrap ErrInvalidRequest.
func New(n *node.Node, reserved []int) (*State, error) {
	s := &State{
		node:     n,
		reserved: make([]bool, n.MaxCPUID()+1),
		owner:    make([]string, n.MaxCPUID()+1),
		gpuOwner: make([]string, n.NumGPUs()),
		ctrs:     map[string]*entry{},
		numaIDs:  n.NUMAIDs(),
		numaPos:  map[int]int{},
		bestRank: map[int]int{},
		pool:     len(n.CPUs),
	}
	for _, id := range reserved {
		if _, ok := n.CPU(id); !ok {
			return nil, fmt.Errorf("%w: reserved CPU %d is not online (online: %s)", ErrInvalidRequest, id, topology.FormatIDList(cpuIDs(n)))
		}
		if !s.reserved[id] {
			s.reserved[id] = true
			s.nReserved++
		}
	}
	if n.NumGPUs() > 64 {
		return nil, fmt.Errorf("%w: %d GPUs; at most 64 are supported", ErrInvalidRequest, n.NumGPUs())
	}
	if len(s.numaIDs) > 64 {
		return nil, fmt.Errorf("%w: %d NUMA nodes with CPUs; at most 64 are supported", ErrInvalidRequest, len(s.numaIDs))
	}
	for p, id := range s.numaIDs {
		s.numaPos[id] = p
	}
	s.gpuMask = make([]uint64, n.NumGPUs())
	for g := range s.gpuMask {
		for _, id := range n.GPUNUMA(g) {
			if p, ok := s.numaPos[id]; ok {
				s.gpuMask[g] |= 1 << p
			}
		}
	}
	s.masks = candidateMasks(len(s.numaIDs))
	return s, nil
}

// candidateMasks lists the NUMA node sets considered, smallest first (see the package doc).
func candidateMasks(m int) []uint64 {
	var out []uint64
	if m <= 8 {
		for size := 1; size <= m; size++ {
			for mask := uint64(1); mask < 1<<m; mask++ {
				if popcount(mask) == size {
					out = append(out, mask)
				}
			}
		}
		return out
	}
	for i := range m {
		out = append(out, 1<<i)
	}
	for i := range m {
		for j := i + 1; j < m; j++ {
			out = append(out, 1<<i|1<<j)
		}
	}
	all := uint64(1)<<m - 1
	if m == 64 {
		all = ^uint64(0)
	}
	return append(out, all)
}

// Node returns the node model the state was built for.
func (s *State) Node() *node.Node { return s.node }

// Placement returns the placement of container id, and whether it is placed. The CPUs are the
// cpuset berth last gave (or observed for) the container.
func (s *State) Placement(id string) (Placement, bool) {
	e, ok := s.ctrs[id]
	if !ok {
		return Placement{}, false
	}
	p := e.p
	p.CPUs = slices.Clone(e.cur)
	return p, true
}

// Len returns the number of containers the state holds.
func (s *State) Len() int { return len(s.ctrs) }

// GPUOwner returns the id of the container holding GPU index g, or "".
func (s *State) GPUOwner(g int) string { return s.gpuOwner[g] }

// CPUOwner returns the id of the container holding CPU id c exclusively, or "".
func (s *State) CPUOwner(c int) string {
	if c < 0 || c >= len(s.owner) {
		return ""
	}
	return s.owner[c]
}

// Decide returns where request r would go, without booking anything. Commit books it; the
// caller must not change the state in between. Errors are those of Allocate.
func (s *State) Decide(r Request) (Placement, error) { return s.decide(r) }

// Commit books a placement Decide returned (on this state, with no change in between) and
// returns the cpuset updates of shared containers whose pool shrank.
func (s *State) Commit(p Placement) []Update { return s.commit(p, true) }

// Each calls f with every placement the state holds, in container id order; managed reports
// whether berth placed the container (see Adopt).
func (s *State) Each(f func(p Placement, managed bool)) {
	ids := make([]string, 0, len(s.ctrs))
	for id := range s.ctrs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		p, _ := s.Placement(id)
		f(p, s.ctrs[id].managed)
	}
}

// Allocate decides where request r goes and books it: exclusive CPUs and GPUs become r.ID's. It
// returns the placement and the cpuset updates of shared containers whose pool shrank. On error
// nothing changes. Errors wrap ErrInvalidRequest, ErrUnplaceable (with the node's free
// resources per NUMA node in the message) or ErrConflict.
func (s *State) Allocate(r Request) (Placement, []Update, error) {
	p, err := s.decide(r)
	if err != nil {
		return Placement{}, nil, err
	}
	return p, s.commit(p, true), nil
}

// Release gives back everything container id holds and returns the cpuset updates of shared
// containers whose pool grew. Releasing an unknown id is a no-op (ok false).
func (s *State) Release(id string) (updates []Update, ok bool) {
	e, ok := s.ctrs[id]
	if !ok {
		return nil, false
	}
	delete(s.ctrs, id)
	for _, g := range e.p.GPUs {
		if s.gpuOwner[g] == id {
			s.gpuOwner[g] = ""
		}
	}
	if !e.p.Exclusive {
		return nil, true
	}
	for _, c := range e.cur {
		if s.owner[c] == id {
			s.owner[c] = ""
			s.pool++
		}
	}
	return s.refreshShared(nil), true
}

// Adopt books a placement found on a running container (berth-nri restarted, Synchronize): its
// exclusive CPUs and its GPUs, without deciding anything and without producing updates, so that
// running containers are never re-pinned. managed says berth placed it (its placement annotation
// was found): its shared pool is maintained from now on. p.CPUs is the container's current
// cpuset. Errors (nothing is booked then) wrap ErrConflict (a CPU or GPU already held, the id
// already known) or ErrInvalidRequest (a CPU that is not online, a GPU index not on this node).
func (s *State) Adopt(p Placement, managed bool) error {
	if _, dup := s.ctrs[p.ID]; dup {
		return fmt.Errorf("adopt %s: %w: container is already placed", p.ID, ErrConflict)
	}
	for _, c := range p.CPUs {
		if _, ok := s.node.CPU(c); !ok {
			return fmt.Errorf("adopt %s: %w: CPU %d is not online", p.ID, ErrInvalidRequest, c)
		}
		if p.Exclusive && s.owner[c] != "" {
			return fmt.Errorf("adopt %s: %w: CPU %d is held exclusively by %s", p.ID, ErrConflict, c, s.owner[c])
		}
	}
	for _, g := range p.GPUs {
		if g < 0 || g >= len(s.gpuOwner) {
			return fmt.Errorf("adopt %s: %w: GPU %d is not a GPU of this node (%d GPUs)", p.ID, ErrInvalidRequest, g, len(s.gpuOwner))
		}
		if s.gpuOwner[g] != "" {
			return fmt.Errorf("adopt %s: %w: GPU %d is held by %s", p.ID, ErrConflict, g, s.gpuOwner[g])
		}
	}
	s.commit(p, managed)
	return nil
}

// commit books p (already checked) and returns the shared containers' updates.
func (s *State) commit(p Placement, managed bool) []Update {
	s.ctrs[p.ID] = &entry{p: p, cur: slices.Clone(p.CPUs), managed: managed}
	for _, g := range p.GPUs {
		s.gpuOwner[g] = p.ID
	}
	if !p.Exclusive {
		return nil
	}
	taken := make([]bool, len(s.owner))
	for _, c := range p.CPUs {
		if s.owner[c] == "" {
			s.pool--
		}
		s.owner[c] = p.ID
		taken[c] = true
	}
	return s.refreshShared(taken)
}

// refreshShared recomputes the cpuset of every managed shared container. With taken != nil
// only containers that hold a taken CPU change (the pool shrank); otherwise every container whose
// pool differs from its cpuset (the pool grew).
func (s *State) refreshShared(taken []bool) []Update {
	var ups []Update
	pools := map[uint64][]int{} // by NUMA mask (^0: all nodes); shared read-only between entries
	for id, e := range s.ctrs {
		if e.p.Exclusive || !e.managed {
			continue
		}
		if taken != nil && !slices.ContainsFunc(e.cur, func(c int) bool { return taken[c] }) {
			continue
		}
		key := ^uint64(0)
		if e.p.NUMANodes != nil {
			key = 0
			for _, n := range e.p.NUMANodes {
				key |= 1 << s.numaPos[n]
			}
		}
		next, ok := pools[key]
		if !ok {
			next = s.sharedCPUs(e.p.NUMANodes)
			pools[key] = next
		}
		if slices.Equal(next, e.cur) {
			continue
		}
		e.cur = next
		ups = append(ups, Update{ID: id, CPUs: next})
	}
	slices.SortFunc(ups, func(a, b Update) int { return strings.Compare(a.ID, b.ID) })
	return ups
}

// SharedCPUs returns the shared pool of the given NUMA nodes (all nodes when numa is nil, or when
// those nodes' part of the pool is empty): online CPUs no container holds exclusively, ascending.
func (s *State) SharedCPUs(numa []int) []int { return s.sharedCPUs(numa) }

func (s *State) sharedCPUs(numa []int) []int {
	var out []int
	if numa != nil {
		for _, id := range numa {
			m, _ := s.node.NUMA(id)
			for _, c := range m.CPUs {
				if s.owner[c] == "" {
					out = append(out, c)
				}
			}
		}
		if len(out) > 0 {
			slices.Sort(out)
			return out
		}
	}
	for _, c := range s.node.CPUs {
		if s.owner[c.ID] == "" {
			out = append(out, c.ID)
		}
	}
	return out
}

// Free describes the free resources of NUMA node id: GPUs nobody holds whose affinity is that
// node, CPUs that could be given exclusively, and the shared pool.
type Free struct {
	NUMA int `json:"numa"`
	// GPUs are the free GPU indices close to this node (only this node).
	GPUs []int `json:"gpus"`
	// ExclusiveCPUs are free CPUs that are not reserved; SharedCPUs the node's part of the pool.
	ExclusiveCPUs int `json:"exclusiveCPUs"`
	SharedCPUs    int `json:"sharedCPUs"`
}

// FreeByNUMA returns the free resources of every NUMA node with CPUs, by ascending id, plus the
// free GPUs whose NUMA affinity is unknown or spans nodes (as NUMA -1), if any.
func (s *State) FreeByNUMA() []Free {
	out := make([]Free, len(s.numaIDs))
	for p, id := range s.numaIDs {
		f := Free{NUMA: id}
		m, _ := s.node.NUMA(id)
		for _, c := range m.CPUs {
			if s.owner[c] == "" {
				f.SharedCPUs++
				if !s.reserved[c] {
					f.ExclusiveCPUs++
				}
			}
		}
		for g, gm := range s.gpuMask {
			if gm == 1<<p && s.gpuOwner[g] == "" {
				f.GPUs = append(f.GPUs, g)
			}
		}
		out[p] = f
	}
	other := Free{NUMA: -1}
	for g, gm := range s.gpuMask {
		if popcount(gm) != 1 && s.gpuOwner[g] == "" {
			other.GPUs = append(other.GPUs, g)
		}
	}
	if len(other.GPUs) > 0 {
		out = append(out, other)
	}
	return out
}

// Held describes what containers hold on NUMA node NUMA (berth-nri's metrics report it).
type Held struct {
	// NUMA is the Linux NUMA node id; -1 stands for GPUs whose NUMA affinity is unknown or spans
	// several nodes (no CPU counts then).
	NUMA int
	// ExclusiveCPUs is the number of the node's CPUs a container holds exclusively.
	ExclusiveCPUs int
	// SharedCPUs is the number of the node's CPUs in the shared pool (held exclusively by nobody,
	// reserved CPUs included): what containers without exclusive CPUs run on.
	SharedCPUs int
	// GPUs is the number of GPUs close to this node only that a container holds.
	GPUs int
	// MemContainers is the number of containers whose cpuset.mems includes this node. Memory
	// is aligned, not sized: no byte counts are tracked.
	MemContainers int
}

// HeldByNUMA returns what containers hold on every NUMA node with CPUs, by ascending id, plus
// an entry with NUMA -1 when the node has GPUs whose NUMA affinity is unknown or spans nodes
// (present whether or not they are held, so that the entries depend on the node alone).
func (s *State) HeldByNUMA() []Held {
	out := make([]Held, len(s.numaIDs))
	for p, id := range s.numaIDs {
		h := Held{NUMA: id}
		m, _ := s.node.NUMA(id)
		for _, c := range m.CPUs {
			if s.owner[c] != "" {
				h.ExclusiveCPUs++
			} else {
				h.SharedCPUs++
			}
		}
		for g, gm := range s.gpuMask {
			if gm == 1<<p && s.gpuOwner[g] != "" {
				h.GPUs++
			}
		}
		out[p] = h
	}
	other, spread := Held{NUMA: -1}, false
	for g, gm := range s.gpuMask {
		if popcount(gm) != 1 {
			spread = true
			if s.gpuOwner[g] != "" {
				other.GPUs++
			}
		}
	}
	for _, e := range s.ctrs {
		for _, id := range e.p.Mems {
			if p, ok := s.numaPos[id]; ok {
				out[p].MemContainers++
			}
		}
	}
	if spread {
		out = append(out, other)
	}
	return out
}

// describeFree renders FreeByNUMA for messages: "node 0: 1 GPU, 30 CPUs; node 1: 0 GPUs, 12 CPUs".
// exclusive chooses which CPU count is shown (CPUs that can be given exclusively, or the pool).
func (s *State) describeFree(exclusive bool) string {
	var parts []string
	for _, f := range s.FreeByNUMA() {
		cpus := f.SharedCPUs
		if exclusive {
			cpus = f.ExclusiveCPUs
		}
		switch {
		case f.NUMA < 0:
			parts = append(parts, fmt.Sprintf("GPUs of unknown or several NUMA nodes: %s", countGPUs(f.GPUs)))
		case len(s.gpuOwner) == 0:
			parts = append(parts, fmt.Sprintf("node %d: %s", f.NUMA, plural(cpus, "CPU")))
		default:
			parts = append(parts, fmt.Sprintf("node %d: %s, %s", f.NUMA, countGPUs(f.GPUs), plural(cpus, "CPU")))
		}
	}
	return strings.Join(parts, "; ")
}

func countGPUs(g []int) string {
	if len(g) == 0 {
		return "0 GPUs"
	}
	return plural(len(g), "GPU") + " (" + topology.FormatIDList(g) + ")"
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return strconv.Itoa(n) + " " + what + "s"
}

func popcount(m uint64) int {
	c := 0
	for ; m != 0; m &= m - 1 {
		c++
	}
	return c
}

func cpuIDs(n *node.Node) []int {
	ids := make([]int, len(n.CPUs))
	for i, c := range n.CPUs {
		ids[i] = c.ID
	}
	return ids
}
