package registry

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-dev/berth/oci/checkpoint"
)

const testDigest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestParseRestoreFrom(t *testing.T) {
	ok := []struct {
		in   string
		want RestoreFrom
	}{
		{"ck1", RestoreFrom{Path: "ck1"}},
		{"cri-ck.tar", RestoreFrom{Path: "cri-ck.tar"}},
		{"/var/lib/berth/checkpoints/a", RestoreFrom{Path: "/var/lib/berth/checkpoints/a"}},
		{"dir/with:colon", RestoreFrom{Path: "dir/with:colon"}},
		{"dir/x://y", RestoreFrom{Path: "dir/x://y"}}, // "://" after a slash: a path
		{"oci://127.0.0.1:5000/berth/ck:v1", RestoreFrom{Registry: "127.0.0.1:5000", Repository: "berth/ck", Tag: "v1"}},
		{"oci://registry.example/a/b/c:latest", RestoreFrom{Registry: "registry.example", Repository: "a/b/c", Tag: "latest"}},
		{"oci://localhost:5000/ck@" + testDigest, RestoreFrom{Registry: "localhost:5000", Repository: "ck", Digest: testDigest}},
		{"oci://localhost:5000/ck:v1@" + testDigest, RestoreFrom{Registry: "localhost:5000", Repository: "ck", Digest: testDigest}},
		{"oci://[::1]:5000/ck:v1", RestoreFrom{Registry: "[::1]:5000", Repository: "ck", Tag: "v1"}},
	}
	for _, tt := range ok {
		got, err := ParseRestoreFrom(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("ParseRestoreFrom(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
			continue
		}
		if got.IsOCI() {
			if again, err := ParseRestoreFrom(got.String()); err != nil || again != got {
				t.Errorf("ParseRestoreFrom(%q) (String of %q) = %+v, %v", got.String(), tt.in, again, err)
			}
		}
	}
	if r, _ := ParseRestoreFrom("oci://127.0.0.1:5000/berth/ck:v1"); r.Ref() != "127.0.0.1:5000/berth/ck:v1" {
		t.Errorf("Ref() = %q", r.Ref())
	}

	bad := []struct{ in, want string }{
		{"", "empty"},
		{"oci://", "missing registry or repository"},
		{"oci://127.0.0.1:5000/berth/ck", "tag or digest is required"},
		{"oci://127.0.0.1:5000", "invalid reference"},
		{"oci://127.0.0.1:5000/Berth/ck:v1", "invalid"},
		{"oci://127.0.0.1:5000/berth/ck:v 1", "control character or space"},
		{"oci://127.0.0.1:5000/berth/ck:v1\x00", "control character"},
		{"oci://localhost/ck@sha256:abc", "invalid"},
		{"oci://localhost/ck@sha512:" + strings.Repeat("ab", 64), "sha256"},
		{"OCI://localhost/ck:v1", `scheme "OCI://" is not supported`},
		{"docker://localhost/ck:v1", `scheme "docker://" is not supported`},
		{"https://localhost/ck:v1", `scheme "https://" is not supported`},
	}
	for _, tt := range bad {
		got, err := ParseRestoreFrom(tt.in)
		if err == nil || !errors.Is(err, checkpoint.ErrInvalidRef) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseRestoreFrom(%q) = %+v, %v; want ErrInvalidRef containing %q", tt.in, got, err, tt.want)
		}
	}
}

// FuzzParseRestoreFrom fuzzes the berth.dev/restore-from annotation parser together with the
// path resolver the shim runs on the paths it returns: no panic; a reference re-parses to itself
// from its canonical form and names a registry without a slash; a path resolves, if at all,
// strictly inside the checkpoint root (which holds a checkpoint, an archive and symlinks leading
// out). Seed corpus: testdata/fuzz/FuzzParseRestoreFrom.
func FuzzParseRestoreFrom(f *testing.F) {
	for _, s := range []string{
		"ck", "ck.tar", "oci://127.0.0.1:5000/berth/ck:v1", "oci://localhost/ck@" + testDigest,
		"../etc", "ck/../../etc", "out/passwd", "/", "oci://a/b", "docker://x/y:z", "link",
	} {
		f.Add(s)
	}
	root := f.TempDir()
	must := func(err error) {
		if err != nil {
			f.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "ck", "checkpoint"), 0o700))
	must(os.WriteFile(filepath.Join(root, "ck.tar"), nil, 0o600))
	must(os.Symlink("/etc", filepath.Join(root, "out")))
	must(os.Symlink("ck", filepath.Join(root, "link")))
	realRoot, err := filepath.EvalSymlinks(root)
	must(err)

	f.Fuzz(func(t *testing.T, v string) {
		r, err := ParseRestoreFrom(v)
		if err != nil {
			if !errors.Is(err, checkpoint.ErrInvalidRef) {
				t.Fatalf("ParseRestoreFrom(%q): error %v is not ErrInvalidRef", v, err)
			}
			return
		}
		if r.IsOCI() {
			if r.Path != "" || strings.Contains(r.Registry, "/") || r.Repository == "" || (r.Tag == "") == (r.Digest == "") {
				t.Fatalf("ParseRestoreFrom(%q) = %+v", v, r)
			}
			again, err := ParseRestoreFrom(r.String())
			if err != nil || again != r {
				t.Fatalf("ParseRestoreFrom(%q) = %+v; its String %q parses to %+v, %v", v, r, r.String(), again, err)
			}
			return
		}
		if r.Path != v || strings.HasPrefix(v, RestoreFromScheme) {
			t.Fatalf("ParseRestoreFrom(%q) = path %q", v, r.Path)
		}
		p, err := checkpoint.ResolveRestoreFrom(root, r.Path)
		if err != nil {
			return
		}
		if !strings.HasPrefix(p, realRoot+string(filepath.Separator)) || p == realRoot {
			t.Fatalf("ResolveRestoreFrom(%q) = %q, outside %s", v, p, realRoot)
		}
	})
}
