package placement

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
)

// allocator picks n GPUs from free on topology t.
type allocator struct {
	name string
	pick func(t *topology.Topology, free []int, n int) []int
}

var allocators = []allocator{
	{"berth", func(t *topology.Topology, free []int, n int) []int {
		c, err := Choose(t, free, n)
		if err != nil {
			panic(err)
		}
		return c.GPUs
	}},
	// The lowest free indices, as a device plugin without topology awareness does.
	{"lowest-index", func(_ *topology.Topology, free []int, n int) []int {
		return slices.Sorted(slices.Values(free))[:n]
	}},
	// The set with the highest sum of pairwise link scores, the objective of the pairwise-score
	// allocators in NVIDIA's device plugin (go-gpuallocator); ties to the lowest indices.
	{"pairwise-sum", func(t *topology.Topology, free []int, n int) []int {
		var best []int
		bestScore := -1
		subsets(slices.Sorted(slices.Values(free)), n, func(set []int) {
			s := 0
			for i, a := range set {
				for _, b := range set[i+1:] {
					s += t.Link(a, b).Rank()
				}
			}
			if s > bestScore {
				best, bestScore = set, s
			}
		})
		return best
	}},
}

// quality is one allocator's result on one topology.
type quality struct {
	requests, optimal int
	stranded          float64 // mean free GPUs that lost their fastest partner, per step
	fastPair          float64 // share of steps after which a best-class pair is still free
}

// TestPlacementQuality runs the same random stream of requests (1, 2, 4 or 8 GPUs) and releases
// through each allocator on every topology and prints, per allocator: the share of requests
// placed optimally (the chosen set's slowest pair is the best the free GPUs allow), the GPUs
// stranded (free but cut off from their fastest partner), and how often a best-class pair is
// still free for the next 2-GPU request. berth must be optimal on every request.
func TestPlacementQuality(t *testing.T) {
	all := synthetic()
	for name, top := range fixtures(t) {
		all[name] = top
	}
	names := make([]string, 0, len(all))
	for n := range all {
		names = append(names, n)
	}
	sort.Strings(names)
	var table strings.Builder
	fmt.Fprintf(&table, "%-44s %-13s %9s %9s %9s\n", "topology", "allocator", "optimal", "stranded", "fast pair")
	for _, name := range names {
		top := all[name]
		if len(top.GPUs) > MaxFree {
			continue
		}
		results := make([]quality, len(allocators))
		for ai, a := range allocators {
			results[ai] = runStream(top, a, 500)
			fmt.Fprintf(&table, "%-44s %-13s %8.1f%% %9.2f %8.1f%%\n", name, a.name,
				100*float64(results[ai].optimal)/float64(results[ai].requests), results[ai].stranded, 100*results[ai].fastPair)
		}
		if results[0].optimal != results[0].requests {
			t.Errorf("%s: berth placed %d of %d requests optimally", name, results[0].optimal, results[0].requests)
		}
	}
	t.Log("\n" + table.String())
}

func runStream(top *topology.Topology, a allocator, steps int) quality {
	rng := rand.New(rand.NewPCG(42, uint64(len(top.GPUs))))
	n := len(top.GPUs)
	busy := make([]bool, n)
	var live [][]int
	var q quality
	bestPair := bestRank(top, allGPUs(n), 2)
	// each GPU's fastest partner on the empty node
	fastest := make([]int, n)
	for g := range n {
		for o := range n {
			if o != g {
				fastest[g] = max(fastest[g], top.Link(g, o).Rank())
			}
		}
	}
	sizes := []int{1, 1, 2, 2, 4, 8}
	for range steps {
		var free []int
		for g, b := range busy {
			if !b {
				free = append(free, g)
			}
		}
		k := sizes[rng.IntN(len(sizes))]
		if len(live) > 0 && (rng.IntN(100) < 35 || k > len(free)) {
			i := rng.IntN(len(live))
			for _, g := range live[i] {
				busy[g] = false
			}
			live = slices.Delete(live, i, i+1)
			continue
		}
		if k > len(free) {
			continue
		}
		set := a.pick(top, free, k)
		q.requests++
		if slowestRank(top, set) == bestRank(top, free, k) {
			q.optimal++
		}
		for _, g := range set {
			busy[g] = true
		}
		live = append(live, set)
		free = free[:0]
		for g, b := range busy {
			if !b {
				free = append(free, g)
			}
		}
		for _, g := range free {
			best := 0
			for _, o := range free {
				if o != g {
					best = max(best, top.Link(g, o).Rank())
				}
			}
			if best < fastest[g] {
				q.stranded++
			}
		}
		if len(free) >= 2 && bestRank(top, free, 2) == bestPair {
			q.fastPair++
		}
	}
	q.stranded /= float64(max(q.requests, 1))
	q.fastPair /= float64(max(q.requests, 1))
	return q
}

func allGPUs(n int) []int {
	g := make([]int, n)
	for i := range g {
		g[i] = i
	}
	return g
}

func slowestRank(t *topology.Topology, set []int) int {
	r := topology.Self.Rank()
	for i, a := range set {
		for _, b := range set[i+1:] {
			r = min(r, t.Link(a, b).Rank())
		}
	}
	return r
}

func bestRank(t *topology.Topology, free []int, k int) int {
	best := -1
	subsets(slices.Sorted(slices.Values(free)), k, func(set []int) { best = max(best, slowestRank(t, set)) })
	return best
}
