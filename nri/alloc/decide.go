package alloc

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/placement"
)

// decide chooses a placement for r without changing s.
func (s *State) decide(r Request) (Placement, error) {
	name := r.Name
	if name == "" {
		name = "container " + r.ID
	}
	assigned, err := s.validate(r, name)
	if err != nil {
		return Placement{}, err
	}
	p := Placement{ID: r.ID, Policy: r.Policy, Exclusive: r.ExclusiveCPUs > 0, Aligned: true}
	if w := s.adjacencyWarning(assigned); w != "" {
		p.Warnings = append(p.Warnings, w)
		p.Misaligned = append(p.Misaligned, MisalignedLinks)
	}
	if numa := s.gpuNUMA(assigned); len(numa) > 1 {
		p.Warnings = append(p.Warnings, fmt.Sprintf("GPUs %s hang off NUMA nodes %s: their CPUs and memory cannot all be local",
			topology.FormatIDList(assigned), topology.FormatIDList(numa)))
		p.Misaligned = append(p.Misaligned, MisalignedNUMA)
	}
	aligned := r.Policy != PolicyNone && (r.ExclusiveCPUs > 0 || r.GPUs > 0 || len(assigned) > 0)
	if !aligned {
		return s.decideUnaligned(r, name, assigned, p)
	}
	return s.decideAligned(r, name, assigned, p)
}

// validate checks r against the node and returns its assigned GPUs, sorted and deduplicated.
func (s *State) validate(r Request, name string) ([]int, error) {
	if r.ID == "" {
		return nil, fmt.Errorf("%w: no container id", ErrInvalidRequest)
	}
	if _, dup := s.ctrs[r.ID]; dup {
		return nil, fmt.Errorf("place %s: %w: container %s is already placed", name, ErrConflict, r.ID)
	}
	if _, err := ParsePolicy(string(r.Policy)); err != nil {
		return nil, fmt.Errorf("place %s: %w", name, err)
	}
	if r.GPUs < 0 {
		return nil, fmt.Errorf("place %s: %w: %d GPUs requested", name, ErrInvalidRequest, r.GPUs)
	}
	if r.ExclusiveCPUs < 0 {
		return nil, fmt.Errorf("place %s: %w: %d exclusive CPUs requested", name, ErrInvalidRequest, r.ExclusiveCPUs)
	}
	assigned := slices.Compact(slices.Sorted(slices.Values(r.AssignedGPUs)))
	if r.GPUs > 0 && len(assigned) > 0 {
		return nil, fmt.Errorf("place %s: %w: it already has GPUs %s and asks berth for %d more",
			name, ErrInvalidRequest, topology.FormatIDList(assigned), r.GPUs)
	}
	for _, g := range assigned {
		if g < 0 || g >= len(s.gpuOwner) {
			return nil, fmt.Errorf("place %s: %w: it has GPU %d, but this node has %s",
				name, ErrInvalidRequest, g, plural(len(s.gpuOwner), "GPU"))
		}
		if o := s.gpuOwner[g]; o != "" {
			return nil, fmt.Errorf("place %s: %w: GPU %d, which it was given, is held by container %s", name, ErrConflict, g, o)
		}
	}
	if r.GPUs > len(s.gpuOwner) {
		return nil, fmt.Errorf("%w %s: it asks for %s; this node has %s",
			ErrUnplaceable, name, plural(r.GPUs, "GPU"), plural(len(s.gpuOwner), "GPU"))
	}
	if limit := s.exclusiveCapacity(); r.ExclusiveCPUs > limit {
		kept := ""
		if s.nReserved == 0 {
			kept = ", 1 always kept shared"
		}
		return nil, fmt.Errorf("%w %s: it asks for %d exclusive CPUs; this node can give at most %d (%d online, %d reserved%s)",
			ErrUnplaceable, name, r.ExclusiveCPUs, limit, len(s.node.CPUs), s.nReserved, kept)
	}
	return assigned, nil
}

// exclusiveCapacity is the most CPUs the empty node could give exclusively.
func (s *State) exclusiveCapacity() int {
	c := len(s.node.CPUs) - s.nReserved
	if s.nReserved == 0 {
		c--
	}
	return max(c, 0)
}

// exclusiveLimit is the most CPUs that can be given exclusively now, node-wide.
func (s *State) exclusiveLimit() int {
	if s.nReserved == 0 {
		return s.pool - 1
	}
	return math.MaxInt
}

func (s *State) freeGPUs() []int {
	var free []int
	for g, o := range s.gpuOwner {
		if o == "" {
			free = append(free, g)
		}
	}
	return free
}

func (s *State) decideUnaligned(r Request, name string, assigned []int, p Placement) (Placement, error) {
	p.Aligned = r.Policy != PolicyNone || (r.ExclusiveCPUs == 0 && r.GPUs == 0 && len(assigned) == 0)
	p.GPUs = assigned
	if r.GPUs > 0 {
		free := s.freeGPUs()
		if len(free) < r.GPUs {
			return Placement{}, fmt.Errorf("%w %s under policy %s: it asks for %s, %s free; free now: %s",
				ErrUnplaceable, name, r.Policy, plural(r.GPUs, "GPU"), isAre(len(free)), s.describeFree(r.ExclusiveCPUs > 0))
		}
		c, err := placement.Choose(s.node.GPUs, free, r.GPUs)
		if err != nil {
			return Placement{}, fmt.Errorf("%w %s: %w", ErrUnplaceable, name, err)
		}
		p.GPUs, p.ChosenGPUs = c.GPUs, true
		p.Reason = c.Reason
	}
	if r.ExclusiveCPUs > 0 {
		all := uint64(1)<<len(s.numaIDs) - 1
		if s.freeExclusive(all) < r.ExclusiveCPUs || r.ExclusiveCPUs > s.exclusiveLimit() {
			return Placement{}, fmt.Errorf("%w %s under policy %s: it asks for %d exclusive CPUs, %d can be given now; free now: %s",
				ErrUnplaceable, name, r.Policy, r.ExclusiveCPUs, min(s.freeExclusive(all), s.exclusiveLimit()), s.describeFree(true))
		}
		p.CPUs = s.pickCPUs(all, r.ExclusiveCPUs, nil, 0)
	} else {
		p.CPUs = s.sharedCPUs(nil)
	}
	p.Reason = joinReason("policy "+string(r.Policy)+": not aligned", p.Reason, cpuReason(p))
	return p, nil
}

func isAre(n int) string {
	if n == 1 {
		return "1 is"
	}
	return fmt.Sprintf("%d are", n)
}

// candidate is one NUMA node set under evaluation.
type candidate struct {
	mask   uint64
	choice placement.Choice
	key    [6]int // compared lexicographically, lower is better
}

func (s *State) decideAligned(r Request, name string, assigned []int, p Placement) (Placement, error) {
	var assignedMask uint64
	for _, g := range assigned {
		assignedMask |= s.gpuMask[g]
	}
	var freeG, allG uint64
	for g, o := range s.gpuOwner {
		allG |= 1 << g
		if o == "" {
			freeG |= 1 << g
		}
	}
	limit := s.exclusiveLimit()
	minSize := 0
	var admissible []uint64
	for _, m := range s.masks {
		if assignedMask&^m != 0 {
			continue
		}
		size := popcount(m)
		if minSize == 0 && popcount(s.fitting(m, allG)) >= r.GPUs && s.capacityExclusive(m) >= r.ExclusiveCPUs {
			minSize = size
		}
		if popcount(s.fitting(m, freeG)) < r.GPUs || s.freeExclusive(m) < r.ExclusiveCPUs || r.ExclusiveCPUs > limit {
			continue
		}
		switch r.Policy {
		case PolicyRestricted:
			if size != minSize {
				continue
			}
		case PolicySingleNUMANode:
			if size != 1 || minSize != 1 {
				continue
			}
		}
		admissible = append(admissible, m)
	}
	if len(admissible) == 0 {
		return Placement{}, s.unplaceable(r, name, assigned, minSize)
	}

	memo := map[uint64]placement.Choice{}
	var best *candidate
	for _, m := range admissible {
		c := candidate{mask: m}
		fit := s.fitting(m, freeG)
		rank := 0
		if r.GPUs > 0 {
			ch, ok := memo[fit]
			if !ok {
				var err error
				ch, err = placement.Choose(s.node.GPUs, maskBits(fit), r.GPUs)
				if err != nil {
					return Placement{}, fmt.Errorf("%w %s: %w", ErrUnplaceable, name, err)
				}
				memo[fit] = ch
			}
			c.choice = ch
			rank = ch.SlowestLink.Rank()
		}
		c.key = [6]int{-rank, popcount(m), s.distanceSum(m), popcount(fit) - r.GPUs, s.freeExclusive(m), 0}
		if best == nil || less(c, *best) {
			cc := c
			best = &cc
		}
	}

	numa := s.maskIDs(best.mask)
	p.NUMANodes, p.Mems = numa, numa
	p.Aligned = popcount(best.mask) == minSize
	if r.GPUs > 0 {
		p.GPUs, p.ChosenGPUs = best.choice.GPUs, true
	} else {
		p.GPUs = assigned
	}
	if r.ExclusiveCPUs > 0 {
		prefer := make([]bool, len(s.owner))
		var preferNUMA uint64
		for _, g := range p.GPUs {
			for _, c := range s.node.GPUs.GPUs[g].CPUs {
				if c < len(prefer) {
					prefer[c] = true
				}
			}
			preferNUMA |= s.gpuMask[g]
		}
		p.CPUs = s.pickCPUs(best.mask, r.ExclusiveCPUs, prefer, preferNUMA)
	} else {
		p.CPUs = s.sharedCPUs(numa)
	}
	where := fmt.Sprintf("policy %s: NUMA %s %s", r.Policy, pluralWord(len(numa), "node"), topology.FormatIDList(numa))
	if p.Aligned {
		where += " (preferred)"
	} else {
		w := fmt.Sprintf("policy %s: placed on NUMA nodes %s; on an empty node %s would do, but none has room now",
			r.Policy, topology.FormatIDList(numa), pluralWord(minSize, "NUMA node"))
		p.Warnings = append(p.Warnings, w)
	}
	p.Reason = joinReason(where, best.choice.Reason, cpuReason(p))
	return p, nil
}

func less(a, b candidate) bool {
	if c := slices.Compare(a.key[:], b.key[:]); c != 0 {
		return c < 0
	}
	return a.mask < b.mask
}

// fitting returns the GPUs of set (a bitmask of GPU indices) whose NUMA affinity lies in m.
func (s *State) fitting(m, set uint64) uint64 {
	var out uint64
	for r := set; r != 0; r &= r - 1 {
		g := trailing(r)
		if s.gpuMask[g]&^m == 0 {
			out |= 1 << g
		}
	}
	return out
}

func (s *State) freeExclusive(m uint64) int {
	n := 0
	for r := m; r != 0; r &= r - 1 {
		node, _ := s.node.NUMA(s.numaIDs[trailing(r)])
		for _, c := range node.CPUs {
			if s.owner[c] == "" && !s.reserved[c] {
				n++
			}
		}
	}
	return n
}

func (s *State) capacityExclusive(m uint64) int {
	n := 0
	for r := m; r != 0; r &= r - 1 {
		node, _ := s.node.NUMA(s.numaIDs[trailing(r)])
		for _, c := range node.CPUs {
			if !s.reserved[c] {
				n++
			}
		}
	}
	return n
}

func (s *State) distanceSum(m uint64) int {
	ids := s.maskIDs(m)
	sum := 0
	for i, a := range ids {
		for _, b := range ids[i+1:] {
			sum += s.node.Distance(a, b) + s.node.Distance(b, a)
		}
	}
	return sum
}

func (s *State) maskIDs(m uint64) []int {
	var ids []int
	for r := m; r != 0; r &= r - 1 {
		ids = append(ids, s.numaIDs[trailing(r)])
	}
	return ids
}

func maskBits(m uint64) []int {
	var out []int
	for r := m; r != 0; r &= r - 1 {
		out = append(out, trailing(r))
	}
	return out
}

func trailing(m uint64) int {
	n := 0
	for m&1 == 0 {
		m >>= 1
		n++
	}
	return n
}

// unplaceable explains why no NUMA node set is admissible.
func (s *State) unplaceable(r Request, name string, assigned []int, minSize int) error {
	var need []string
	if r.GPUs > 0 {
		need = append(need, plural(r.GPUs, "free GPU"))
	}
	if len(assigned) > 0 {
		need = append(need, "its GPUs "+topology.FormatIDList(assigned))
	}
	if r.ExclusiveCPUs > 0 {
		need = append(need, plural(r.ExclusiveCPUs, "free CPU"))
	}
	what := strings.Join(need, " and ")
	if len(need) > 1 {
		what += " together"
	}
	free := s.describeFree(r.ExclusiveCPUs > 0)
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w %s under policy %s: %s; free now: %s", ErrUnplaceable, name, r.Policy, fmt.Sprintf(format, args...), free)
	}
	if r.ExclusiveCPUs > s.exclusiveLimit() {
		return fail("%d CPUs can be given exclusively now, %d requested", max(s.exclusiveLimit(), 0), r.ExclusiveCPUs)
	}
	switch {
	case r.Policy == PolicySingleNUMANode && minSize != 1:
		return fail("no single NUMA node can hold %s even when empty", what)
	case r.Policy == PolicyBestEffort || minSize == 0:
		return fail("the node does not have %s", what)
	case minSize == 1:
		return fail("no NUMA node has %s", what)
	default:
		return fail("no set of %d NUMA nodes has %s (on an empty node %d would)", minSize, what, minSize)
	}
}

// adjacencyWarning says when GPUs someone else chose are not the best-connected set of their
// size on this node.
func (s *State) adjacencyWarning(gpus []int) string {
	if len(gpus) < 2 || s.node.GPUs == nil {
		return ""
	}
	t := s.node.GPUs
	slow, pair := topology.Self, [2]int{}
	for i, a := range gpus {
		for _, b := range gpus[i+1:] {
			if l := t.Link(a, b); l.Rank() < slow.Rank() {
				slow, pair = l, [2]int{a, b}
			}
		}
	}
	best, ok := s.bestRank[len(gpus)]
	if !ok {
		all := make([]int, len(t.GPUs))
		for i := range all {
			all[i] = i
		}
		c, err := placement.Choose(t, all, len(gpus))
		if err != nil {
			return ""
		}
		best = c.SlowestLink.Rank()
		s.bestRank[len(gpus)] = best
	}
	if slow.Rank() >= best {
		return ""
	}
	return fmt.Sprintf("GPUs %s are not link-adjacent: slowest pair %s (GPU%d-GPU%d), while this node has %d-GPU sets whose slowest pair is faster",
		topology.FormatIDList(gpus), slow, pair[0], pair[1], len(gpus))
}

// gpuNUMA returns the NUMA nodes that GPUs gpus hang off (those of known affinity), ascending.
func (s *State) gpuNUMA(gpus []int) []int {
	var m uint64
	for _, g := range gpus {
		if g >= 0 && g < len(s.gpuMask) {
			m |= s.gpuMask[g]
		}
	}
	return s.maskIDs(m)
}

func pluralWord(n int, what string) string {
	if n == 1 {
		return what
	}
	return what + "s"
}

func cpuReason(p Placement) string {
	if p.Exclusive {
		return fmt.Sprintf("%s %s", plural(len(p.CPUs), "exclusive CPU"), topology.FormatIDList(p.CPUs))
	}
	return "shared CPUs " + topology.FormatIDList(p.CPUs)
}

func joinReason(parts ...string) string {
	var out []string
	for _, p := range parts {
		if p != "" {
			out = append(out, p)
		}
	}
	return strings.Join(out, "; ")
}
