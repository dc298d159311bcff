package reference

import (
	"errors"
	"strings"
	"testing"

	"oras.land/oras-go/v2/errdef"
	orasreg "oras.land/oras-go/v2/registry"
)

// refs are references of every form oras-go's grammar takes or refuses: digest (with and
// without a tag before it), tag, neither, and bad registries, repositories, tags and digests.
var refs = []string{
	"localhost:5000/berth/ckpt:v1",
	"registry.example/a/b/c:latest",
	"registry.example/repo@sha256:" + strings.Repeat("a", 64),
	"registry.example/repo:tag@sha256:" + strings.Repeat("b", 64),
	"registry.example/repo:bad tag@sha256:" + strings.Repeat("c", 64),
	"registry.example/repo",
	"registry.example/repo:",
	"registry.example/repo@",
	"registry.example/repo@sha256:short",
	"registry.example/repo@md5:" + strings.Repeat("d", 32),
	"registry.example/Repo:v1",
	"registry.example/re__po/x-y.z:v1",
	"registry.example/re___po:v1",
	"registry.example/repo:" + strings.Repeat("t", 128),
	"registry.example/repo:" + strings.Repeat("t", 129),
	"registry.example/repo:.tag",
	"registry.example/repo:ta+g",
	"[::1]:5000/repo:v1",
	"host:port/repo:v1",
	"host/",
	"/repo:v1",
	"noslash",
	"",
	"a b/repo:v1",
	"registry.example//repo:v1",
	"registry.example/repo/:v1",
}

// TestParseMatchesOras: parseReference, which the shim uses without linking oras-go's registry
// package, gives oras-go's registry.ParseReference's result and error, word for word.
func TestParseMatchesOras(t *testing.T) {
	for _, ref := range refs {
		t.Run(ref, func(t *testing.T) { sameAsOras(t, ref) })
	}
}

// FuzzParseMatchesOras holds parseReference to oras-go's registry.ParseReference on any input.
func FuzzParseMatchesOras(f *testing.F) {
	for _, ref := range refs {
		f.Add(ref)
	}
	f.Fuzz(sameAsOras)
}

func sameAsOras(t *testing.T, ref string) {
	got, err := parseReference(ref)
	want, wantErr := orasreg.ParseReference(ref)
	if (err == nil) != (wantErr == nil) || (err != nil && err.Error() != wantErr.Error()) {
		t.Fatalf("parseReference(%q): error %v, oras-go's %v", ref, err, wantErr)
	}
	if err != nil && !errors.Is(err, errdef.ErrInvalidReference) {
		t.Fatalf("parseReference(%q): error %v does not wrap errdef.ErrInvalidReference", ref, err)
	}
	if got != (Reference{Registry: want.Registry, Repository: want.Repository, Reference: want.Reference}) {
		t.Fatalf("parseReference(%q) = %+v, oras-go's %+v", ref, got, want)
	}
}
