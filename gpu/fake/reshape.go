package fake

import (
	"fmt"
	"os"
	"path/filepath"
)

// SetGPUs replaces the node's GPUs and the links between them (NodeSpec.GPUs and Links) from
// now on, in the node's files, as a node whose GPUs were changed: shims started afterwards see
// the new inventory. A GPU that is dropped loses its directory (its device memory files
// included); GPUs kept keep theirs.
func (n *Node) SetGPUs(gpus []GPUSpec, links [][]string) error {
	spec := n.Spec()
	old := spec.GPUs
	spec.GPUs, spec.Links = gpus, links
	if _, err := Setup(n.root, spec); err != nil {
		return err
	}
	kept := map[string]bool{}
	for _, g := range gpus {
		kept[g.UUID] = true
	}
	for _, g := range old {
		if !kept[g.UUID] {
			if err := os.RemoveAll(filepath.Join(n.root, g.UUID)); err != nil {
				return fmt.Errorf("fake GPU %s: %w", g.UUID, err)
			}
		}
	}
	n.spec = spec
	return nil
}
