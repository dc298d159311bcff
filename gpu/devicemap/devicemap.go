// Package devicemap chooses the GPUs of this node that a checkpoint's GPUs are restored onto (the
// device map, old UUID -> new UUID) and explains the choice. It is pure policy, like the NRI
// plugin's placement (gpu/topology's link ranks are the one measure of a link both use): no I/O,
// no clock, no state.
//
// What belongs here: the objective and its search. What does not: reading the inventory or the
// topology, the driver and CUDA version checks, rewriting the spec (the shim does those).
//
// # The objective
//
// Only GPUs of the checkpointed GPU's model with at least the free memory it recorded are
// candidates, each destination GPU used once. When every checkpointed GPU is on this node itself
// (the same UUID, the same model, enough free memory) the map is the identity: no remapping. Else
// Choose compares every assignment by these keys, in order:
//
//  1. Links kept: the number of pairs of checkpointed GPUs whose link on this node ranks below
//     the link they had on the source (topology.Link.Rank: NVLink peers that would no longer be
//     NVLink peers, or fewer NVLinks), fewer is better. Only when both links are known.
//  2. Idle: the number of chosen GPUs in use (any device memory used), fewer is better: a restore
//     prefers an idle GPU of the same model to one another container computes on.
//  3. Bandwidth: the rank of the slowest link between chosen GPUs, higher is better.
//  4. Load: the device memory already used on the chosen GPUs, in units of UsedUnit, less is better
//     (on NVML, which counts the driver's own reservation as used, every GPU is "in use" and this
//     key tells a loaded GPU from an idle one).
//  5. Determinism: the lexicographically smallest list of destination indices, in the checkpoint's
//     GPU order.
//
// The search is a depth-first branch and bound in key-5 order (every key only grows as GPUs are
// added), bounded by MaxSteps.
package devicemap

import (
	"errors"
	"fmt"
	"strings"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// UsedUnit is the granularity of key 4, in bytes.
const UsedUnit = 256 << 20

// MaxSteps bounds the search (assignments tried); the best found so far is returned past it.
const MaxSteps = 1 << 21

// ErrNoFit: no assignment gives every checkpointed GPU a GPU of its model with enough free memory.
var ErrNoFit = errors.New("no GPUs of this node fit the checkpoint")

// Source is one GPU of the checkpoint, in the container's device order.
type Source struct {
	UUID       string
	Name       string
	MemoryUsed uint64 // what the container held on it: a destination needs this much free
}

// Request is what Choose maps.
type Request struct {
	// GPUs are the checkpoint's GPUs in the container's order.
	GPUs []Source
	// Links[i][j] is the link the source node had between GPUs i and j; nil when not recorded.
	Links [][]topology.Link
	// Devices are this node's GPUs (inventory order); Topology the links between them, indexed
	// like Devices (nil when unknown).
	Devices  []gpu.Device
	Topology *topology.Topology
}

// ForCheckpoint is the request that maps the GPUs a checkpoint's manifest records (st: each
// GPU's UUID, model and the device memory the container held on it; the links between them,
// as nvidia-smi names them, where recorded) onto a node's GPUs devs with links topo (nil:
// unknown). Links that are not recorded for every pair, or do not parse, are not compared.
func ForCheckpoint(st *checkpoint.GPUState, devs []gpu.Device, topo *topology.Topology) Request {
	r := Request{Devices: devs, Topology: topo}
	for _, d := range st.Devices {
		r.GPUs = append(r.GPUs, Source{UUID: d.UUID, Name: d.Name, MemoryUsed: d.MemoryUsed})
	}
	if len(st.Links) == len(st.Devices) {
		r.Links = make([][]topology.Link, len(st.Links))
		for i, row := range st.Links {
			if len(row) != len(st.Devices) {
				r.Links = nil
				break
			}
			r.Links[i] = make([]topology.Link, len(row))
			for j, c := range row {
				r.Links[i][j], _ = topology.ParseLink(c) // unknown: not compared
			}
		}
	}
	return r
}

// Choice is a device map and why.
type Choice struct {
	Pairs []gpu.UUIDPair
	// Reason explains it, e.g. "GPU-a -> GPU-y (idle), GPU-b -> GPU-z (idle); links kept: 0-1
	// NV4; passed over: GPU-x (in use, 8388608 bytes used)".
	Reason string
}

type score struct {
	degraded, inUse, negSlow int
	used                     uint64
}

func (a score) less(b score) bool {
	switch {
	case a.degraded != b.degraded:
		return a.degraded < b.degraded
	case a.inUse != b.inUse:
		return a.inUse < b.inUse
	case a.negSlow != b.negSlow:
		return a.negSlow < b.negSlow
	}
	return a.used < b.used
}

// Choose returns the device map for r by the objective in the package documentation. The error
// wraps ErrNoFit and names the first checkpointed GPU that has no candidate, or the count.
func Choose(r Request) (Choice, error) {
	n := len(r.GPUs)
	if n == 0 {
		return Choice{}, nil
	}
	if pairs, ok := identity(r); ok {
		return Choice{Pairs: pairs, Reason: "the checkpoint's own GPUs (same UUIDs): " + joinPairs(pairs, r, nil)}, nil
	}
	topo := r.Topology
	if topo != nil && len(topo.GPUs) != len(r.Devices) {
		topo = nil
	}
	srcLinks := r.Links
	if len(srcLinks) != n {
		srcLinks = nil
	}
	cands := make([][]int, n)
	for i, s := range r.GPUs {
		for j, d := range r.Devices {
			if d.Name == s.Name && d.MemoryFree() >= s.MemoryUsed {
				cands[i] = append(cands[i], j)
			}
		}
		if len(cands[i]) == 0 {
			return Choice{}, fmt.Errorf("%w: no GPU of model %q with %d bytes free for checkpointed GPU %d (%s)", ErrNoFit, s.Name, s.MemoryUsed, i, s.UUID)
		}
	}
	var (
		best      []int
		bestScore score
		cur       = make([]int, 0, n)
		taken     = make([]bool, len(r.Devices))
		steps     int
	)
	var dfs func(sc score, slow int)
	dfs = func(sc score, slow int) {
		if best != nil && !sc.less(bestScore) {
			return // every key only grows: nothing below beats the best, and later lists sort after it
		}
		i := len(cur)
		if i == n {
			best, bestScore = append([]int(nil), cur...), sc
			return
		}
		for _, j := range cands[i] {
			if taken[j] || steps >= MaxSteps {
				continue
			}
			steps++
			next, nslow := sc, slow
			d := r.Devices[j]
			if d.MemoryUsed > 0 {
				next.inUse++
			}
			next.used += d.MemoryUsed / UsedUnit
			if topo != nil {
				for k, jk := range cur {
					l := topo.Link(jk, j)
					if srcLinks != nil && srcLinks[k][i].Valid() && l.Rank() < srcLinks[k][i].Rank() {
						next.degraded++
					}
					if l.Rank() < nslow {
						nslow = l.Rank()
					}
				}
				next.negSlow = -nslow
			}
			taken[j] = true
			cur = append(cur, j)
			dfs(next, nslow)
			cur = cur[:len(cur)-1]
			taken[j] = false
		}
	}
	dfs(score{negSlow: -topology.Self.Rank()}, topology.Self.Rank())
	if best == nil {
		return Choice{}, fmt.Errorf("%w: %d GPUs checkpointed, fewer distinct GPUs of their models with enough free memory here", ErrNoFit, n)
	}
	pairs := make([]gpu.UUIDPair, n)
	for i, j := range best {
		pairs[i] = gpu.UUIDPair{Old: r.GPUs[i].UUID, New: r.Devices[j].UUID}
	}
	return Choice{Pairs: pairs, Reason: explain(r, topo, srcLinks, best, pairs)}, nil
}

// identity maps every checkpointed GPU onto itself when all are here with enough free memory.
func identity(r Request) ([]gpu.UUIDPair, bool) {
	var pairs []gpu.UUIDPair
	for _, s := range r.GPUs {
		ok := false
		for _, d := range r.Devices {
			if d.UUID == s.UUID && d.Name == s.Name && d.MemoryFree() >= s.MemoryUsed {
				ok = true
			}
		}
		if !ok {
			return nil, false
		}
		pairs = append(pairs, gpu.UUIDPair{Old: s.UUID, New: s.UUID})
	}
	return pairs, true
}

func explain(r Request, topo *topology.Topology, srcLinks [][]topology.Link, best []int, pairs []gpu.UUIDPair) string {
	var b strings.Builder
	b.WriteString(joinPairs(pairs, r, best))
	if topo != nil && len(best) > 1 {
		var kept, lost []string
		for a := range best {
			for c := a + 1; c < len(best); c++ {
				l := topo.Link(best[a], best[c])
				s := fmt.Sprintf("%d-%d %s", a, c, l)
				if srcLinks != nil && srcLinks[a][c].Valid() {
					if l.Rank() < srcLinks[a][c].Rank() {
						lost = append(lost, fmt.Sprintf("%d-%d %s (was %s)", a, c, l, srcLinks[a][c]))
						continue
					}
					s = fmt.Sprintf("%d-%d %s (was %s)", a, c, l, srcLinks[a][c])
				}
				kept = append(kept, s)
			}
		}
		if len(kept) > 0 {
			b.WriteString("; links kept: " + strings.Join(kept, ", "))
		}
		if len(lost) > 0 {
			b.WriteString("; links slower than on the source (no set of this node keeps them): " + strings.Join(lost, ", "))
		}
	}
	chosen := map[int]bool{}
	for _, j := range best {
		chosen[j] = true
	}
	var over []string
	for j, d := range r.Devices {
		if chosen[j] {
			continue
		}
		for _, s := range r.GPUs {
			if d.Name == s.Name {
				over = append(over, fmt.Sprintf("%s (%s)", d.UUID, state(d)))
				break
			}
		}
	}
	if len(over) > 0 {
		b.WriteString("; passed over: " + strings.Join(over, ", "))
	}
	return b.String()
}

func joinPairs(pairs []gpu.UUIDPair, r Request, best []int) string {
	var parts []string
	for i, p := range pairs {
		st := ""
		if best != nil {
			st = " (" + state(r.Devices[best[i]]) + ")"
		}
		parts = append(parts, p.Old+" -> "+p.New+st)
	}
	return strings.Join(parts, ", ")
}

func state(d gpu.Device) string {
	if d.MemoryUsed == 0 {
		return "idle"
	}
	return fmt.Sprintf("in use, %d bytes used", d.MemoryUsed)
}
