package fake

import (
	"os"
	"path/filepath"
	"testing"
)

// TestSetGPUs: a node reshaped to four linked GPUs opens as such (its topology included), and
// reshaped back it loses the directories of the GPUs it dropped.
func TestSetGPUs(t *testing.T) {
	root := t.TempDir()
	g := func(u string) GPUSpec { return GPUSpec{UUID: u, Name: "Fake H200", MemoryBytes: 1 << 30} }
	n, err := Setup(root, NodeSpec{Driver: "580.65.06", CUDA: "12.8", GPUs: []GPUSpec{g("GPU-a"), g("GPU-b")}})
	if err != nil {
		t.Fatal(err)
	}
	orig := n.Spec()
	links := [][]string{{"X", "NV4", "SYS", "SYS"}, {"NV4", "X", "SYS", "SYS"}, {"SYS", "SYS", "X", "NV4"}, {"SYS", "SYS", "NV4", "X"}}
	if err := n.SetGPUs([]GPUSpec{g("GPU-a"), g("GPU-b"), g("GPU-c"), g("GPU-d")}, links); err != nil {
		t.Fatal(err)
	}
	o, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	topo, err := o.Topology()
	if err != nil || topo == nil || len(topo.Links) != 4 {
		t.Fatalf("topology of the reshaped node: %+v %v", topo, err)
	}
	if _, err := n.Dir("GPU-d"); err != nil {
		t.Errorf("the node's own view: %v", err)
	}
	if err := n.SetGPUs(orig.GPUs, orig.Links); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "GPU-c")); !os.IsNotExist(err) {
		t.Errorf("dropped GPU's directory: %v", err)
	}
	if o, err := Open(root); err != nil || len(o.Spec().GPUs) != 2 {
		t.Errorf("reshaped back: %v", err)
	}
}
