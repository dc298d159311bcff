package checkpoint

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestResolveRestoreFrom(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "root")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{
		filepath.Join(root, "ckpt"),
		filepath.Join(root, "nested", "ckpt"),
		filepath.Join(outside, "ckpt"),
	} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	writeTree(t, root, map[string][]byte{"move.tar": []byte("tar"), "notes.txt": []byte("txt")})
	// Symlinks: inside -> inside (fine), inside -> outside dir, parent dir -> outside.
	mustSymlink(t, filepath.Join(root, "ckpt"), filepath.Join(root, "alias"))
	mustSymlink(t, filepath.Join(outside, "ckpt"), filepath.Join(root, "escape"))
	mustSymlink(t, "../outside/ckpt", filepath.Join(root, "escape-rel"))
	mustSymlink(t, outside, filepath.Join(root, "linkdir"))
	mustSymlink(t, root, filepath.Join(root, "self"))
	// The root may itself be reached through a symlink.
	rootLink := filepath.Join(base, "root-link")
	mustSymlink(t, root, rootLink)

	realRoot, err := filepath.EvalSymlinks(root)
	if err != nil {
		t.Fatal(err)
	}
	realOf := func(p string) string { return filepath.Join(realRoot, p) }

	cases := []struct {
		name    string
		root    string
		ref     string
		want    string
		wantErr error
	}{
		{"relative", root, "ckpt", realOf("ckpt"), nil},
		{"relative nested", root, "nested/ckpt", realOf("nested/ckpt"), nil},
		{"relative with dot and slash", root, "./nested//ckpt/", realOf("nested/ckpt"), nil},
		{"absolute", root, filepath.Join(root, "ckpt"), realOf("ckpt"), nil},
		{"archive", root, "move.tar", realOf("move.tar"), nil},
		{"symlink inside root", root, "alias", realOf("ckpt"), nil},
		{"root through symlink", rootLink, "ckpt", realOf("ckpt"), nil},
		{"absolute under real root", rootLink, filepath.Join(realRoot, "ckpt"), realOf("ckpt"), nil},
		{"empty", root, "", "", ErrInvalidRef},
		{"dotdot", root, "..", "", ErrInvalidRef},
		{"dotdot escape", root, "../outside/ckpt", "", ErrInvalidRef},
		{"dotdot inside", root, "a/../ckpt", "", ErrInvalidRef},
		{"absolute dotdot", root, filepath.Join(root, "nested") + "/../ckpt", "", ErrInvalidRef},
		{"nul", root, "ckpt\x00", "", ErrInvalidRef},
		{"root itself", root, ".", "", ErrInvalidRef},
		{"root itself absolute", root, root + "/", "", ErrInvalidRef},
		{"symlink to root", root, "self", "", ErrInvalidRef},
		{"plain file", root, "notes.txt", "", ErrInvalidRef},
		{"outside absolute", root, filepath.Join(outside, "ckpt"), "", ErrOutsideRoot},
		{"prefix sibling", root, root + "-other/ckpt", "", ErrOutsideRoot},
		{"symlink escape", root, "escape", "", ErrOutsideRoot},
		{"relative symlink escape", root, "escape-rel", "", ErrOutsideRoot},
		{"symlinked parent dir", root, "linkdir/ckpt", "", ErrOutsideRoot},
		{"missing", root, "nope", "", fs.ErrNotExist},
		{"missing nested", root, "nested/nope/x", "", fs.ErrNotExist},
		{"root not absolute", "relative/root", "ckpt", "", ErrInvalidRoot},
		{"root missing", filepath.Join(base, "absent"), "ckpt", "", ErrInvalidRoot},
		{"root is a file", filepath.Join(root, "notes.txt"), "ckpt", "", ErrInvalidRoot},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ResolveRestoreFrom(tc.root, tc.ref)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("got %q, %v; want %v", got, err, tc.wantErr)
				}
				if got != "" {
					t.Errorf("got path %q with an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}

	_, err = ResolveRestoreFrom(root, "nope")
	if err == nil || !strings.Contains(err.Error(), filepath.Join(root, "nope")) {
		t.Errorf("missing: error %v does not name the path", err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}
