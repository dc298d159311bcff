package alloc_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/node/nodetest"
)

// fixturesDir holds the real-machine `nvidia-smi topo -m` fixtures (gpu/topology's corpus).
const fixturesDir = "../../gpu/topology/testdata/topologies"

// bruteNodes are every topology the allocator is checked on: the real-machine fixtures (as
// berthctl plan models them) and synthetic sysfs trees with synthetic GPU topologies. Every
// fixture table must parse; only the truncated one (PARTIAL in its name) is left out, by name.
func bruteNodes(t *testing.T) map[string]*node.Node {
	out := map[string]*node.Node{"dgx-h100-sysfs": dgx(t)}
	paths, _ := filepath.Glob(filepath.Join(fixturesDir, "*.tsv"))
	more, _ := filepath.Glob("../../gpu/topology/testdata/*.tsv")
	if len(paths) < 5 || len(more) < 2 {
		t.Fatalf("fixtures missing: %d in %s, %d in gpu/topology/testdata", len(paths), fixturesDir, len(more))
	}
	for _, p := range append(paths, more...) {
		if strings.Contains(filepath.Base(p), "PARTIAL") {
			continue // truncated in its source: gpu/topology's tests check its error
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		top, err := topology.Parse(f)
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		n, err := node.FromTopology(top)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		out["fixture/"+filepath.Base(p)] = n
	}
	pcie := func(i, j int) topology.Link {
		switch {
		case i/2 == j/2:
			return topology.PIX
		case i/4 == j/4:
			return topology.PXB
		}
		return topology.SYS
	}
	smt := nodetest.Spec{Sockets: 1, NUMAPerSocket: 1, CoresPerNUMA: 4, Threads: 2, MemPerNUMA: 1 << 20}
	out["one-socket-smt/pcie-tree"] = nodetest.Build(t, smt, nodetest.Topology(smt, 4, pcie))
	two := nodetest.Spec{Sockets: 2, NUMAPerSocket: 1, CoresPerNUMA: 4, Threads: 2, MemPerNUMA: 1 << 20}
	out["two-socket/node-sys"] = nodetest.Build(t, two, nodetest.Topology(two, 2, func(i, j int) topology.Link {
		if i/2 == j/2 {
			return topology.NODE
		}
		return topology.SYS
	}))
	eight := nodetest.Spec{Sockets: 2, NUMAPerSocket: 4, CoresPerNUMA: 2, Threads: 2, SiblingsAdjacent: true, MemPerNUMA: 1 << 20}
	out["eight-numa/nvlink-pairs"] = nodetest.Build(t, eight, nodetest.Topology(eight, 1, func(i, j int) topology.Link {
		switch {
		case i/2 == j/2:
			return topology.NV(4)
		case i/4 == j/4:
			return topology.NODE
		}
		return topology.SYS
	}))
	if len(out) < 11 {
		t.Fatalf("only %d nodes", len(out))
	}
	return out
}

// occupancy is a starting state: GPUs held by one container, and how many CPUs of the first
// NUMA node another container holds exclusively (all but that node's last CPU when -1).
type occupancy struct {
	gpus    []int
	cpusOn0 int
}

var bruteOccupancies = []occupancy{{}, {gpus: []int{0}}, {gpus: []int{1, 2}, cpusOn0: 2}, {gpus: []int{0, 3, 5}}, {cpusOn0: -1}, {gpus: []int{2, 3, 4, 5}, cpusOn0: 1}}

// TestAllocateAgainstBruteForce checks, on every node, occupancy, policy, GPU count and CPU count,
// that Allocate places exactly when an exhaustive search over (NUMA node set, GPU set) pairs
// finds an admissible one, with the fastest slowest GPU pair and then the fewest NUMA nodes that
// search finds, and that what it gives is free, inside the chosen NUMA nodes and of the right size.
func TestAllocateAgainstBruteForce(t *testing.T) {
	cases := 0
	for name, n := range bruteNodes(t) {
		numa := n.NUMAIDs()
		for _, occ := range bruteOccupancies {
			if slices.ContainsFunc(occ.gpus, func(g int) bool { return g >= n.NumGPUs() }) {
				continue
			}
			for _, pol := range []alloc.Policy{alloc.PolicyBestEffort, alloc.PolicyRestricted, alloc.PolicySingleNUMANode} {
				for ng := 0; ng <= n.NumGPUs(); ng++ {
					for _, k := range []int{0, 1, 2, 5} {
						if ng == 0 && k == 0 {
							continue
						}
						s := newState(t, n)
						held := occupy(t, s, n, occ)
						r := alloc.Request{ID: "x", GPUs: ng, ExclusiveCPUs: k, Policy: pol}
						rank, size, ok := brute(n, numa, held, occ.gpus, r)
						p, _, err := s.Allocate(r)
						label := fmt.Sprintf("%s occ=%+v %s gpus=%d cpus=%d", name, occ, pol, ng, k)
						cases++
						if !ok {
							if !errors.Is(err, alloc.ErrUnplaceable) {
								t.Fatalf("%s: brute force finds no placement, Allocate = %+v, %v", label, p, err)
							}
							continue
						}
						if err != nil {
							t.Fatalf("%s: brute force places (rank %d, %d NUMA nodes), Allocate: %v", label, rank, size, err)
						}
						checkPlacement(t, label, n, s, p, held, occ.gpus, r)
						if got := slowest(n, p.GPUs); got != rank || len(p.NUMANodes) != size {
							t.Fatalf("%s: Allocate = GPUs %v (rank %d) on NUMA %v; brute force: rank %d on %d NUMA nodes (%s)",
								label, p.GPUs, got, p.NUMANodes, rank, size, p.Reason)
						}
					}
				}
			}
		}
	}
	t.Logf("%d cases", cases)
}

// occupy books occ in s and returns the CPUs held exclusively.
func occupy(t *testing.T, s *alloc.State, n *node.Node, occ occupancy) map[int]bool {
	held := map[int]bool{}
	if len(occ.gpus) > 0 {
		if err := s.Adopt(alloc.Placement{ID: "gpus", GPUs: occ.gpus}, false); err != nil {
			t.Fatal(err)
		}
	}
	m, _ := n.NUMA(n.NUMAIDs()[0])
	c := occ.cpusOn0
	if c < 0 {
		c = len(m.CPUs) - 1
	}
	if c > 0 {
		cpus := m.CPUs[:c]
		for _, id := range cpus {
			held[id] = true
		}
		if err := s.Adopt(alloc.Placement{ID: "cpus", CPUs: cpus, Exclusive: true}, false); err != nil {
			t.Fatal(err)
		}
	}
	return held
}

func slowest(n *node.Node, gpus []int) int {
	r := topology.Self.Rank()
	for i, a := range gpus {
		for _, b := range gpus[i+1:] {
			r = min(r, n.GPUs.Link(a, b).Rank())
		}
	}
	return r
}

func fitsIn(n *node.Node, g int, m []int) bool {
	for _, id := range n.GPUNUMA(g) {
		if !slices.Contains(m, id) {
			return false
		}
	}
	return true
}

// brute searches every NUMA node set and GPU set for r; it returns the best slowest-pair rank,
// the fewest NUMA nodes with that rank, and whether any placement is admissible.
func brute(n *node.Node, numa []int, held map[int]bool, busy []int, r alloc.Request) (rank, size int, ok bool) {
	var free []int
	for g := range n.NumGPUs() {
		if !slices.Contains(busy, g) {
			free = append(free, g)
		}
	}
	pool := len(n.CPUs) - len(held)
	var sets [][]int
	for mask := 1; mask < 1<<len(numa); mask++ {
		var m []int
		for i, id := range numa {
			if mask&(1<<i) != 0 {
				m = append(m, id)
			}
		}
		sets = append(sets, m)
	}
	slices.SortStableFunc(sets, func(a, b []int) int { return len(a) - len(b) })
	capFits := func(m []int) bool {
		c, g := 0, 0
		for _, id := range m {
			nm, _ := n.NUMA(id)
			c += len(nm.CPUs)
		}
		for i := range n.NumGPUs() {
			if fitsIn(n, i, m) {
				g++
			}
		}
		return c >= r.ExclusiveCPUs && g >= r.GPUs
	}
	minSize := 0
	for _, m := range sets {
		if capFits(m) {
			minSize = len(m)
			break
		}
	}
	rank, size = -1, 0
	for _, m := range sets {
		switch r.Policy {
		case alloc.PolicyRestricted:
			if len(m) != minSize {
				continue
			}
		case alloc.PolicySingleNUMANode:
			if len(m) != 1 || minSize != 1 {
				continue
			}
		}
		freeCPUs := 0
		for _, id := range m {
			nm, _ := n.NUMA(id)
			for _, c := range nm.CPUs {
				if !held[c] {
					freeCPUs++
				}
			}
		}
		if freeCPUs < r.ExclusiveCPUs || r.ExclusiveCPUs > pool-1 {
			continue
		}
		var in []int
		for _, g := range free {
			if fitsIn(n, g, m) {
				in = append(in, g)
			}
		}
		subsets(in, r.GPUs, func(set []int) {
			rk := slowest(n, set)
			if rk > rank || (rk == rank && len(m) < size) {
				rank, size = rk, len(m)
			}
		})
	}
	return rank, size, rank >= 0
}

func subsets(s []int, k int, f func([]int)) {
	var rec func(start int, cur []int)
	rec = func(start int, cur []int) {
		if len(cur) == k {
			f(cur)
			return
		}
		for i := start; i < len(s); i++ {
			rec(i+1, append(cur, s[i]))
		}
	}
	rec(0, nil)
}

func checkPlacement(t *testing.T, label string, n *node.Node, s *alloc.State, p alloc.Placement, held map[int]bool, busy []int, r alloc.Request) {
	t.Helper()
	if len(p.GPUs) != r.GPUs {
		t.Fatalf("%s: %d GPUs, want %d", label, len(p.GPUs), r.GPUs)
	}
	for _, g := range p.GPUs {
		if slices.Contains(busy, g) || !fitsIn(n, g, p.NUMANodes) || s.GPUOwner(g) != "x" {
			t.Fatalf("%s: GPU %d busy, outside NUMA %v or not booked", label, g, p.NUMANodes)
		}
	}
	if r.ExclusiveCPUs > 0 && len(p.CPUs) != r.ExclusiveCPUs {
		t.Fatalf("%s: %d CPUs, want %d", label, len(p.CPUs), r.ExclusiveCPUs)
	}
	for _, c := range p.CPUs {
		cpu, _ := n.CPU(c)
		if held[c] || !slices.Contains(p.NUMANodes, cpu.NUMA) {
			t.Fatalf("%s: CPU %d held or outside NUMA %v", label, c, p.NUMANodes)
		}
	}
	if !slices.Equal(p.Mems, p.NUMANodes) {
		t.Fatalf("%s: mems %v, NUMA %v", label, p.Mems, p.NUMANodes)
	}
	if r.Policy == alloc.PolicySingleNUMANode && len(p.NUMANodes) != 1 {
		t.Fatalf("%s: single-numa-node on %v", label, p.NUMANodes)
	}
}
