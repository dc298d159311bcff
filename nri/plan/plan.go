// Package plan explains berth-nri's decisions to operators: what berth-nri would give a container
// on a given node (berthctl plan) and what the node model looks like (berthctl topology), as text
// for people and JSON for scripts.
//
// What belongs here: running one decision on a scratch allocation state, and rendering decisions
// and node models. What does not: the decision itself (nri/alloc), reading nodes (nri/node,
// nri/plugin.LoadNode), flags (cmd/berthctl).
//
// Units: CPU ids, NUMA node ids and GPU indices as in nri/node; memory in bytes (JSON) or GiB (text).
package plan

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
)

// Request is what to plan for.
type Request struct {
	// GPUs is the number of GPUs to choose; ExclusiveCPUs the number of exclusive CPUs (0: shared).
	GPUs, ExclusiveCPUs int
	// Policy is the NUMA policy.
	Policy alloc.Policy
	// OccupiedGPUs are GPU indices already taken; OccupiedCPUs CPU ids already held exclusively.
	OccupiedGPUs, OccupiedCPUs []int
	// ReservedCPUs are CPU ids never given exclusively.
	ReservedCPUs []int
}

// Result is a plan. JSON field names are stable for scripts.
type Result struct {
	GPUs        []int    `json:"gpus"`
	CPUs        []int    `json:"cpus"`
	Exclusive   bool     `json:"exclusive"`
	NUMANodes   []int    `json:"numaNodes"`
	Mems        []int    `json:"mems"`
	SlowestLink string   `json:"slowestLink,omitempty"`
	Policy      string   `json:"policy"`
	Aligned     bool     `json:"aligned"`
	Reason      string   `json:"reason"`
	Warnings    []string `json:"warnings,omitempty"`
}

// Plan decides r on node n from a scratch state holding only r's occupied resources. Errors wrap
// alloc's sentinel errors (ErrUnplaceable says why in terms of the node).
func Plan(n *node.Node, r Request) (Result, error) {
	s, err := alloc.New(n, r.ReservedCPUs)
	if err != nil {
		return Result{}, err
	}
	if len(r.OccupiedGPUs) > 0 || len(r.OccupiedCPUs) > 0 {
		occ := alloc.Placement{ID: "occupied", GPUs: r.OccupiedGPUs, CPUs: r.OccupiedCPUs, Exclusive: len(r.OccupiedCPUs) > 0}
		if err := s.Adopt(occ, false); err != nil {
			return Result{}, fmt.Errorf("occupied resources: %w", err)
		}
	}
	p, _, err := s.Allocate(alloc.Request{ID: "plan", Name: "the request", GPUs: r.GPUs, ExclusiveCPUs: r.ExclusiveCPUs, Policy: r.Policy})
	if err != nil {
		return Result{}, err
	}
	res := Result{GPUs: p.GPUs, CPUs: p.CPUs, Exclusive: p.Exclusive, NUMANodes: p.NUMANodes, Mems: p.Mems,
		Policy: string(p.Policy), Aligned: p.Aligned, Reason: p.Reason, Warnings: p.Warnings}
	if len(p.GPUs) > 1 {
		slow := topology.Self
		for i, a := range p.GPUs {
			for _, b := range p.GPUs[i+1:] {
				if l := n.GPUs.Link(a, b); l.Rank() < slow.Rank() {
					slow = l
				}
			}
		}
		res.SlowestLink = slow.String()
	}
	for _, f := range []*[]int{&res.GPUs, &res.CPUs, &res.NUMANodes, &res.Mems} {
		if *f == nil {
			*f = []int{}
		}
	}
	return res, nil
}

// WriteText prints res for people.
func (res Result) WriteText(w io.Writer) {
	gpus := "none"
	if len(res.GPUs) > 0 {
		gpus = topology.FormatIDList(res.GPUs)
		if res.SlowestLink != "" {
			gpus += " (slowest pair " + res.SlowestLink + ")"
		}
	}
	kind := "shared"
	if res.Exclusive {
		kind = "exclusive"
	}
	mems := "unchanged (all)"
	if len(res.Mems) > 0 {
		mems = topology.FormatIDList(res.Mems)
	}
	numa := "all (not aligned)"
	if res.Aligned {
		numa = "all (nothing to align: no GPUs, no exclusive CPUs)"
	}
	if len(res.NUMANodes) > 0 {
		numa = topology.FormatIDList(res.NUMANodes)
	}
	fmt.Fprintf(w, "GPUs:        %s\n", gpus)
	fmt.Fprintf(w, "CPUs:        %s (%s, %d)\n", topology.FormatIDList(res.CPUs), kind, len(res.CPUs))
	fmt.Fprintf(w, "NUMA nodes:  %s\n", numa)
	fmt.Fprintf(w, "cpuset.mems: %s\n", mems)
	fmt.Fprintf(w, "policy:      %s (aligned: %v)\n", res.Policy, res.Aligned)
	fmt.Fprintf(w, "why:         %s\n", res.Reason)
	for _, warn := range res.Warnings {
		fmt.Fprintf(w, "warning:     %s\n", warn)
	}
}

// Model is a node model for display (berthctl topology -o json).
type Model struct {
	Source    string          `json:"source"`
	CPUs      int             `json:"cpus"`
	Sockets   []int           `json:"sockets"`
	SMT       bool            `json:"smt"`
	NUMANodes []node.NUMANode `json:"numaNodes"`
	GPUs      []GPU           `json:"gpus"`
	// Links is the GPU link matrix as nvidia-smi codes ("X", "NV18", "SYS"), by GPU index.
	Links [][]string `json:"links"`
}

// GPU is one GPU of a Model.
type GPU struct {
	Index       int      `json:"index"`
	UUID        string   `json:"uuid,omitempty"`
	NUMA        []int    `json:"numa"`
	CPUs        []int    `json:"cpus"`
	DevicePaths []string `json:"devicePaths"`
}

// Describe returns n as a Model.
func Describe(n *node.Node) Model {
	m := Model{Source: n.Source, CPUs: len(n.CPUs), NUMANodes: n.NUMANodes, GPUs: []GPU{}, Links: [][]string{}}
	for _, c := range n.CPUs {
		if !slices.Contains(m.Sockets, c.Socket) {
			m.Sockets = append(m.Sockets, c.Socket)
		}
		m.SMT = m.SMT || len(c.Siblings) > 1
	}
	slices.Sort(m.Sockets)
	for g := range n.NumGPUs() {
		m.GPUs = append(m.GPUs, GPU{Index: g, UUID: n.GPUUUID(g), NUMA: orEmpty(n.GPUNUMA(g)), CPUs: orEmpty(n.GPUs.GPUs[g].CPUs),
			DevicePaths: n.GPUDevicePaths(g)})
		row := make([]string, n.NumGPUs())
		for j := range row {
			row[j] = n.GPUs.Link(g, j).String()
		}
		m.Links = append(m.Links, row)
	}
	return m
}

func orEmpty(v []int) []int {
	if v == nil {
		return []int{}
	}
	return v
}

// WriteText prints m for people.
func (m Model) WriteText(w io.Writer) {
	smt := "no SMT"
	if m.SMT {
		smt = "SMT"
	}
	fmt.Fprintf(w, "source:  %s\n", m.Source)
	fmt.Fprintf(w, "CPUs:    %d online, %d socket(s), %s\n", m.CPUs, len(m.Sockets), smt)
	for _, nn := range m.NUMANodes {
		var dist []string
		for _, o := range m.NUMANodes {
			dist = append(dist, fmt.Sprintf("%d", nn.Distance[o.ID]))
		}
		mem := "memory unknown"
		if nn.MemTotal > 0 {
			mem = fmt.Sprintf("%.1f GiB", float64(nn.MemTotal)/(1<<30))
		}
		fmt.Fprintf(w, "NUMA %d:  CPUs %s, %s, distances [%s]\n", nn.ID, orDash(topology.FormatIDList(nn.CPUs)), mem, strings.Join(dist, " "))
	}
	if len(m.GPUs) == 0 {
		fmt.Fprintln(w, "GPUs:    none")
		return
	}
	fmt.Fprintf(w, "GPUs:    %d\n", len(m.GPUs))
	var b strings.Builder
	for i := range m.GPUs {
		fmt.Fprintf(&b, "\tGPU%d", i)
	}
	fmt.Fprintf(w, "%s\tNUMA\tCPU affinity\tUUID\n", b.String())
	for i, g := range m.GPUs {
		fmt.Fprintf(w, "GPU%d\t%s\t%s\t%s\t%s\n", i, strings.Join(m.Links[i], "\t"), orDash(topology.FormatIDList(g.NUMA)),
			orDash(topology.FormatIDList(g.CPUs)), orDash(g.UUID))
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
