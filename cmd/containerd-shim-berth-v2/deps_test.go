package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoRegistryClient: the shim links no oras-go. Its reference grammar compiles regular
// expressions at package init (time and heap in every container's shim) and its client is
// berth-shim-helper's work (package shim/helper). The facts come from `go list -deps`.
func TestNoRegistryClient(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	var found []string
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "oras.land/") {
			found = append(found, p)
		}
	}
	if len(found) > 0 {
		t.Errorf("containerd-shim-berth-v2 links %v: parse and talk to registries in berth-shim-helper (shim/helper)", found)
	}
}
