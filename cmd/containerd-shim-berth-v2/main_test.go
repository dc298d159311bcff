package main

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestNotLinked: packages whose work berth-shim-helper does, or whose package initialisation
// would cost every container's shim memory, stay out of the shim's import graph.
func TestNotLinked(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	for _, p := range []string{
		"oras.land/oras-go/v2/registry",                 // its reference grammar, compiled at start (package oci/registry/reference has a lazy copy)
		"oras.land/oras-go/v2/registry/remote",          // the registry client (berth-shim-helper pulls)
		"github.com/checkpoint-restore/go-criu/v7/crit", // CRIU image bindings (berth-shim-helper reads credentials)
	} {
		if slices.Contains(deps, p) {
			t.Errorf("containerd-shim-berth-v2 links %s", p)
		}
	}
}
