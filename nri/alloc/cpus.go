package alloc

import (
	"slices"
)

// core is one core's CPUs that could be given exclusively, for pickCPUs.
type core struct {
	free    []int // free, unreserved CPU ids of the core, ascending
	whole   bool  // every thread of the core is free and unreserved
	aff     int   // how many of free are in the preferred CPU set
	farNUMA bool  // the core's NUMA node is not one of the preferred nodes
	first   int   // the core's lowest CPU id
}

// pickCPUs chooses k free, unreserved CPUs inside the NUMA node set m (see the package doc):
// whole cores first, then single threads, preferring CPUs in prefer (by CPU id; may be nil),
// then cores on the NUMA nodes of preferNUMA (a mask; 0: no preference), then lower ids. The
// caller has checked that m holds at least k such CPUs. The result is ascending.
func (s *State) pickCPUs(m uint64, k int, prefer []bool, preferNUMA uint64) []int {
	var cores []core
	buf := make([]int, 0, len(s.node.CPUs)) // every core's free list is a window of buf
	for r := m; r != 0; r &= r - 1 {
		pos := trailing(r)
		node, _ := s.node.NUMA(s.numaIDs[pos])
		for _, id := range node.CPUs {
			cpu, _ := s.node.CPU(id)
			if cpu.Siblings[0] != id {
				continue // visit each core once, from its first thread
			}
			c := core{first: id, farNUMA: preferNUMA != 0 && preferNUMA&(1<<pos) == 0}
			start := len(buf)
			for _, t := range cpu.Siblings {
				if s.owner[t] == "" && !s.reserved[t] {
					buf = append(buf, t)
					if prefer != nil && prefer[t] {
						c.aff++
					}
				}
			}
			c.free = buf[start:len(buf):len(buf)]
			if len(c.free) == 0 {
				continue
			}
			c.whole = len(c.free) == len(cpu.Siblings)
			cores = append(cores, c)
		}
	}
	byPreference := func(a, b core) int {
		if a.aff != b.aff {
			return b.aff - a.aff
		}
		if a.farNUMA != b.farNUMA {
			if a.farNUMA {
				return 1
			}
			return -1
		}
		return a.first - b.first
	}
	slices.SortFunc(cores, byPreference)
	out := make([]int, 0, k)
	taken := make([]bool, len(cores))
	// Whole cores while at least a whole core is still needed.
	for i, c := range cores {
		if c.whole && len(c.free) <= k-len(out) {
			out = append(out, c.free...)
			taken[i] = true
		}
	}
	if len(out) < k {
		// The remainder: threads of partly taken cores first, then of whole cores.
		var rest []core
		for i, c := range cores {
			if !taken[i] {
				rest = append(rest, c)
			}
		}
		slices.SortStableFunc(rest, func(a, b core) int {
			if a.whole != b.whole {
				if a.whole {
					return 1
				}
				return -1
			}
			return byPreference(a, b)
		})
		for _, c := range rest {
			for _, t := range c.free {
				if len(out) == k {
					break
				}
				out = append(out, t)
			}
		}
	}
	slices.Sort(out)
	return out
}
