package fake

import (
	"fmt"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

var _ gpu.Topologist = (*Node)(nil)

// Topology returns the links between the node's GPUs (NodeSpec.Links), indexed like Devices;
// nil when the node lists none.
func (n *Node) Topology() (*topology.Topology, error) { return linksTopology(n.spec) }

// linksTopology builds the topology of spec's Links (nil for none) and checks it: a square
// matrix over the GPUs, symmetric, "X" exactly on the diagonal.
func linksTopology(spec NodeSpec) (*topology.Topology, error) {
	if len(spec.Links) == 0 {
		return nil, nil
	}
	n := len(spec.GPUs)
	if len(spec.Links) != n {
		return nil, fmt.Errorf("links: %d rows for %d GPUs", len(spec.Links), n)
	}
	t := &topology.Topology{GPUs: make([]topology.GPU, n), Links: make([][]topology.Link, n)}
	for i, row := range spec.Links {
		if len(row) != n {
			return nil, fmt.Errorf("links row %d: %d cells for %d GPUs", i, len(row), n)
		}
		t.GPUs[i] = topology.GPU{Index: i, GPUNUMA: -1}
		t.Links[i] = make([]topology.Link, n)
		for j, cell := range row {
			l, err := topology.ParseLink(cell)
			if err != nil {
				return nil, fmt.Errorf("links[%d][%d]: %w", i, j, err)
			}
			t.Links[i][j] = l
		}
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("links: %w", err)
	}
	return t, nil
}
