// Package placement chooses which free GPUs of a node a container gets. It is pure policy:
// given the node's topology (gpu/topology) and the indices of the GPUs that are free, it returns
// the best set of the requested size and why, with no I/O, no clock, no state and no locking.
//
// What belongs here: the GPU-set objective, its exact search and the explanation of a choice.
// What does not: tracking which GPUs are free (the NRI plugin's allocation state), CPU and memory
// (cpuset) choice, NUMA policies such as single-numa-node, and reading the topology.
//
// # The objective
//
// Choose compares every set S of n free GPUs by these keys, in order, and returns the best:
//
//  1. Bandwidth: the topology.Link Rank of S's slowest pair, higher is better (any NV# above PIX
//     above PXB above PHB above NODE above SYS; more NVLinks above fewer). A single GPU has no
//     pair: for n == 1 every set ties here.
//  2. Locality: the number of locality domains S spans, fewer is better. A GPU's domains are its
//     NUMA nodes ("NUMA Affinity"); when those are unknown, its whole CPU affinity set counts as
//     one domain (GPUs with identical CPU affinity share it); when both are unknown, the GPU is a
//     domain of its own (unknown locality is never assumed to be shared).
//  3. Fragmentation: what S leaves for the next request. For each common request size k
//     (8, 4, 2 and 1 GPUs), largest first, take the best k-set among the GPUs that
//     would remain free, scored by keys 1 and 2 (slowest-pair rank, then fewer domains; no set
//     at all scores lowest); compare these per-size scores lexicographically, size 8 first, so
//     keeping a fast 8-set possible outweighs keeping a fast 4-set, and so on.
//  4. Stranding: for each GPU that would remain free, the rank of its best link to another
//     remaining free GPU (a GPU left alone scores lowest); these ranks, sorted ascending, are
//     compared lexicographically, higher is better. Key 3 only sees the best set of each size,
//     not how many there are: on a node of NVLink-bridged pairs with one GPU of a pair busy, key 4
//     makes a one-GPU request take the busy GPU's partner rather than break an intact pair.
//  5. Determinism: the lexicographically smallest list of GPU indices (ascending).
//
// The search is exact: it enumerates every subset of the free GPUs once with dynamic
// programming, O(2^m · m) time and memory for m free GPUs (about 25 µs for 8, about 15 ms
// for 16 on one core), and refuses
// more than MaxFree free GPUs with ErrTooManyGPUs rather than take unbounded time inside NRI's
// 2 s budget.
package placement

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-dev/berth/gpu/topology"
)

// MaxFree is the largest number of free GPUs Choose searches exactly (2^16 subsets).
const MaxFree = 16

// fragmentationSizes are the request sizes (GPUs) whose best remaining set key 3 of the
// objective compares, in order of importance.
var fragmentationSizes = [...]int{8, 4, 2, 1} // read-only

// Sentinel errors; Choose's errors wrap exactly one of them.
var (
	// ErrInvalidRequest: the request cannot mean anything (n <= 0, a free index that is not a
	// GPU of the topology or is listed twice, a nil or invalid topology).
	ErrInvalidRequest = errors.New("invalid GPU request")
	// ErrInsufficientGPUs: the request is valid but fewer GPUs are free than requested.
	ErrInsufficientGPUs = errors.New("not enough free GPUs")
	// ErrTooManyGPUs: more than MaxFree GPUs are free; the exact search would be too slow.
	ErrTooManyGPUs = errors.New("too many free GPUs for exact placement")
)

// Choice is a chosen GPU set and its explanation.
type Choice struct {
	// GPUs are the chosen GPU indices, ascending.
	GPUs []int
	// SlowestLink is the slowest link between two chosen GPUs; topology.Self when one GPU is chosen.
	SlowestLink topology.Link
	// NUMANodes are the NUMA node ids the chosen GPUs have affinity to, ascending; nil when
	// no chosen GPU's NUMA affinity is known.
	NUMANodes []int
	// Reason explains the choice in words, for logs, annotations and `berthctl plan`, e.g.
	// "GPUs 0,1,2,3: slowest pair NV18 (GPU0-GPU1); 1 NUMA node (0); leaves GPUs 4-7 free,
	// best next 4: 4-7 (slowest pair NV18, 1 NUMA node (1))".
	Reason string
}

// Choose picks n GPUs for one container from free (GPU indices of t, in any order) by the
// objective in the package documentation. It does not modify its arguments.
//
// Errors: ErrInvalidRequest when t is nil or fails Validate, n <= 0, or free holds an index
// outside [0, len(t.GPUs)) or the same index twice; ErrInsufficientGPUs when n > len(free);
// ErrTooManyGPUs when len(free) > MaxFree. Messages name the values, for example
// "requested 3 GPUs, but only 2 are free: 4,6".
func Choose(t *topology.Topology, free []int, n int) (Choice, error) {
	if t == nil {
		return Choice{}, fmt.Errorf("choose GPUs: %w: no topology", ErrInvalidRequest)
	}
	if err := t.Validate(); err != nil {
		return Choice{}, fmt.Errorf("choose GPUs: %w: %w", ErrInvalidRequest, err)
	}
	if n <= 0 {
		return Choice{}, fmt.Errorf("choose GPUs: %w: requested %d GPUs, want at least 1", ErrInvalidRequest, n)
	}
	idx := slices.Clone(free)
	slices.Sort(idx)
	for i, g := range idx {
		if g < 0 || g >= len(t.GPUs) {
			return Choice{}, fmt.Errorf("choose GPUs: %w: free GPU index %d is not a GPU of this node (it has GPUs 0-%d)",
				ErrInvalidRequest, g, len(t.GPUs)-1)
		}
		if i > 0 && idx[i-1] == g {
			return Choice{}, fmt.Errorf("choose GPUs: %w: free GPU index %d is listed twice", ErrInvalidRequest, g)
		}
	}
	if n > len(idx) {
		return Choice{}, fmt.Errorf("choose GPUs: %w: requested %d GPUs, but only %d are free: %s",
			ErrInsufficientGPUs, n, len(idx), orNone(joinInts(idx)))
	}
	if len(idx) > MaxFree {
		return Choice{}, fmt.Errorf("choose GPUs: %w: %d GPUs are free, at most %d are searched", ErrTooManyGPUs, len(idx), MaxFree)
	}
	s := newSearch(t, idx)
	best := s.best(n)
	return s.choice(best), nil
}

// search holds the per-call tables over subsets of the free GPUs. Bit p of a mask is the GPU
// idx[p].
type search struct {
	t     *topology.Topology
	idx   []int
	slow  []int32     // slow[mask]: rank of the slowest pair in mask (Self's rank for < 2 GPUs)
	ndom  []uint8     // ndom[mask]: number of locality domains mask spans
	bestK [][]int64   // bestK[s][mask]: best value of a fragmentationSizes[s]-subset of mask, 0 if none
	domOf []domainSet // domOf[p]: the locality domains of GPU idx[p]
}

// domainSet is a set of locality domains, as bits numbered in order of first appearance.
type domainSet [maxDomains / 64]uint64

// maxDomains bounds distinct locality domains among the free GPUs; beyond it the excess domains
// share the last bit (only key 2 gets coarser, never wrong by more than that).
const maxDomains = 256

func (d *domainSet) add(i int) { d[i/64] |= 1 << (i % 64) }

func (d domainSet) or(e domainSet) domainSet {
	for i := range d {
		d[i] |= e[i]
	}
	return d
}

func (d domainSet) count() int {
	c := 0
	for _, w := range d {
		c += bits.OnesCount64(w)
	}
	return c
}

// value packs keys 1 and 2 for one set: higher is better; 0 is reserved for "no set".
func value(slow int32, ndom uint8) int64 { return int64(slow)<<9 | int64(511-int(ndom)) }

func newSearch(t *topology.Topology, idx []int) *search {
	m := len(idx)
	s := &search{t: t, idx: idx, domOf: make([]domainSet, m)}
	ids := map[string]int{}
	for p, g := range idx {
		for _, k := range domainKeys(t.GPUs[g]) {
			id, ok := ids[k]
			if !ok {
				id = min(len(ids), maxDomains-1)
				ids[k] = id
			}
			s.domOf[p].add(id)
		}
	}
	size := 1 << m
	s.slow = make([]int32, size)
	s.ndom = make([]uint8, size)
	doms := make([]domainSet, size)
	selfRank := int32(topology.Self.Rank())
	s.slow[0] = selfRank
	for mask := 1; mask < size; mask++ {
		p := bits.TrailingZeros(uint(mask))
		rest := mask &^ (1 << p)
		sl := s.slow[rest]
		for r := rest; r != 0; r &= r - 1 {
			q := bits.TrailingZeros(uint(r))
			if rk := int32(t.Link(idx[p], idx[q]).Rank()); rk < sl {
				sl = rk
			}
		}
		s.slow[mask] = sl
		doms[mask] = doms[rest].or(s.domOf[p])
		s.ndom[mask] = uint8(min(doms[mask].count(), 255))
	}
	s.bestK = make([][]int64, len(fragmentationSizes))
	for si, k := range fragmentationSizes {
		if k > m {
			continue // no remaining set can have k GPUs: every candidate scores 0 here
		}
		b := make([]int64, size)
		for mask := 1; mask < size; mask++ {
			c := bits.OnesCount(uint(mask))
			switch {
			case c < k:
			case c == k:
				b[mask] = value(s.slow[mask], s.ndom[mask])
			default:
				for r := mask; r != 0; r &= r - 1 {
					b[mask] = max(b[mask], b[mask&^(r&-r)])
				}
			}
		}
		s.bestK[si] = b
	}
	return s
}

// domainKeys returns a GPU's locality domains as documented on the package (key 2).
func domainKeys(g topology.GPU) []string {
	switch {
	case g.NUMA != nil:
		keys := make([]string, len(g.NUMA))
		for i, n := range g.NUMA {
			keys[i] = "numa " + strconv.Itoa(n)
		}
		return keys
	case g.CPUs != nil:
		return []string{"cpus " + topology.FormatIDList(g.CPUs)}
	default:
		return []string{"gpu " + strconv.Itoa(g.Index)}
	}
}

// better reports whether candidate a beats candidate b (both n-subsets) under the objective.
func (s *search) better(a, b int) bool {
	if s.slow[a] != s.slow[b] {
		return s.slow[a] > s.slow[b]
	}
	if s.ndom[a] != s.ndom[b] {
		return s.ndom[a] < s.ndom[b]
	}
	all := len(s.slow) - 1
	for _, bk := range s.bestK {
		if bk == nil {
			continue
		}
		if va, vb := bk[all&^a], bk[all&^b]; va != vb {
			return va > vb
		}
	}
	if c := s.compareStranding(all&^a, all&^b); c != 0 {
		return c > 0
	}
	d := a ^ b
	return a&(d&-d) != 0 // the lowest differing GPU is in a: a's index list is smaller
}

// stranding returns, for each GPU of the remaining set rest, the rank of its best link to another
// GPU of rest (0 if it is alone), sorted ascending (key 4).
func (s *search) stranding(rest int, buf *[MaxFree]int32) []int32 {
	v := buf[:0]
	for r := rest; r != 0; r &= r - 1 {
		p := bits.TrailingZeros(uint(r))
		best := int32(0)
		for o := rest &^ (1 << p); o != 0; o &= o - 1 {
			q := bits.TrailingZeros(uint(o))
			best = max(best, int32(s.t.Link(s.idx[p], s.idx[q]).Rank()))
		}
		v = append(v, best)
	}
	slices.Sort(v)
	return v
}

// compareStranding compares key 4 of two remaining sets of equal size: > 0 if ra is better.
func (s *search) compareStranding(ra, rb int) int {
	var ba, bb [MaxFree]int32
	return slices.Compare(s.stranding(ra, &ba), s.stranding(rb, &bb))
}

func (s *search) best(n int) int {
	best := -1
	for mask := range len(s.slow) {
		if bits.OnesCount(uint(mask)) == n && (best < 0 || s.better(mask, best)) {
			best = mask
		}
	}
	return best
}

func (s *search) gpus(mask int) []int {
	var g []int
	for r := mask; r != 0; r &= r - 1 {
		g = append(g, s.idx[bits.TrailingZeros(uint(r))])
	}
	return g
}

func (s *search) choice(mask int) Choice {
	gpus := s.gpus(mask)
	c := Choice{GPUs: gpus, SlowestLink: topology.Self}
	var slowPair [2]int
	for i, a := range gpus {
		for _, b := range gpus[i+1:] {
			if l := s.t.Link(a, b); l.Rank() < c.SlowestLink.Rank() {
				c.SlowestLink, slowPair = l, [2]int{a, b}
			}
		}
	}
	for _, g := range gpus {
		c.NUMANodes = append(c.NUMANodes, s.t.GPUs[g].NUMA...)
	}
	if c.NUMANodes != nil {
		slices.Sort(c.NUMANodes)
		c.NUMANodes = slices.Compact(c.NUMANodes)
	}

	var r strings.Builder
	fmt.Fprintf(&r, "%s: ", plural(len(gpus), "GPU ", "GPUs ")+joinInts(gpus))
	if len(gpus) == 1 {
		r.WriteString("a single GPU, no pair")
	} else {
		fmt.Fprintf(&r, "slowest pair %s (GPU%d-GPU%d)", c.SlowestLink, slowPair[0], slowPair[1])
	}
	r.WriteString("; " + s.locality(mask))

	all := len(s.slow) - 1
	rest := all &^ mask
	left := s.gpus(rest)
	switch {
	case len(left) == 0:
		r.WriteString("; leaves no GPU free")
	case len(left) == 1:
		fmt.Fprintf(&r, "; leaves GPU %d free", left[0])
	default:
		fmt.Fprintf(&r, "; leaves GPUs %s free", topology.FormatIDList(left))
		for si, k := range fragmentationSizes {
			if k < 2 || k > len(left) {
				continue
			}
			want := s.bestK[si][rest]
			for sub := rest; sub != 0; sub = (sub - 1) & rest { // find the best k-set for the text
				if bits.OnesCount(uint(sub)) == k && value(s.slow[sub], s.ndom[sub]) == want {
					fmt.Fprintf(&r, ", best next %d: %s (slowest pair %s, %s)", k, topology.FormatIDList(s.gpus(sub)),
						s.t.Link(s.slowestPair(sub)), s.locality(sub))
					break
				}
			}
			break
		}
	}
	c.Reason = r.String()
	return c
}

// slowestPair returns a slowest pair of the (at least two-GPU) set mask, as GPU indices.
func (s *search) slowestPair(mask int) (int, int) {
	g := s.gpus(mask)
	a, b := g[0], g[1]
	for i := range g {
		for _, y := range g[i+1:] {
			if s.t.Link(g[i], y).Rank() < s.t.Link(a, b).Rank() {
				a, b = g[i], y
			}
		}
	}
	return a, b
}

// locality describes the domains of mask: NUMA nodes when known, otherwise the proxy used.
func (s *search) locality(mask int) string {
	var numa, unknown []int
	cpuProxy := true
	for _, g := range s.gpus(mask) {
		gpu := s.t.GPUs[g]
		if gpu.NUMA == nil {
			unknown = append(unknown, g)
			cpuProxy = cpuProxy && gpu.CPUs != nil
		}
		numa = append(numa, gpu.NUMA...)
	}
	slices.Sort(numa)
	numa = slices.Compact(numa)
	d := int(s.ndom[mask])
	switch {
	case len(unknown) == 0:
		return plural(len(numa), "1 NUMA node", strconv.Itoa(len(numa))+" NUMA nodes") + " (" + joinInts(numa) + ")"
	case len(numa) == 0 && cpuProxy:
		return plural(d, "1 CPU affinity group", strconv.Itoa(d)+" CPU affinity groups") + " (NUMA affinity unknown)"
	default:
		return plural(d, "1 locality domain", strconv.Itoa(d)+" locality domains") +
			" (NUMA affinity unknown for " + plural(len(unknown), "GPU ", "GPUs ") + joinInts(unknown) + ")"
	}
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}
