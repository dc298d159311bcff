package shim

import (
	"errors"
	"strings"
	"testing"
)

// TestCheckNamespace: a pod restores only checkpoints of its own Kubernetes namespace, unless
// namespace_mappings allows the pair; a checkpoint of a container outside Kubernetes restores into
// no pod unless ":namespace" allows it (it holds that container's memory); restores outside
// Kubernetes are not checked.
func TestCheckNamespace(t *testing.T) {
	for _, tc := range []struct {
		name, from, to string
		mappings       []string
		wantIn         string // "" allowed
	}{
		{name: "same namespace", from: "team-a", to: "team-a"},
		{name: "outside Kubernetes to outside", from: "", to: ""},
		{name: "pod checkpoint restored by ctr", from: "team-a", to: ""},
		{name: "other namespace", from: "team-a", to: "team-b", wantIn: `namespace_mappings = ["team-a:team-b"]`},
		{name: "other namespace mapped", from: "team-a", to: "team-b", mappings: []string{"team-a:team-b"}},
		{name: "host container into a pod", from: "", to: "team-b", wantIn: `outside Kubernetes and may not be restored into a pod of namespace "team-b"`},
		{name: "host container into a mapped namespace", from: "", to: "lab", mappings: []string{":lab"}},
		{name: "mapping for another namespace", from: "", to: "team-b", mappings: []string{":lab"}, wantIn: `namespace_mappings = [":team-b"]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &Service{cfg: Config{NamespaceMappings: tc.mappings}}
			err := s.checkNamespace("ck", tc.from, tc.to)
			if tc.wantIn == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrNamespaceRefused) || !strings.Contains(err.Error(), tc.wantIn) {
				t.Fatalf("checkNamespace(%q, %q) = %v, want ErrNamespaceRefused containing %q", tc.from, tc.to, err, tc.wantIn)
			}
		})
	}
}
