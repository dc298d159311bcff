package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// manifested returns a checkpoint dir with sampleTree and its berth.json, and the manifest.
func manifested(t *testing.T) (string, *Manifest) {
	t.Helper()
	dir := t.TempDir()
	writeTree(t, dir, sampleTree())
	m := &Manifest{}
	if err := WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	return dir, m
}

func TestVerify(t *testing.T) {
	const victim = "checkpoint/pages-1.img"
	cases := []struct {
		name    string
		damage  func(t *testing.T, dir string)
		wantErr error
		inErr   []string
	}{
		{"intact", func(*testing.T, string) {}, nil, nil},
		{"empty dir ignored", func(t *testing.T, dir string) {
			if err := os.Mkdir(filepath.Join(dir, "new-empty"), 0o700); err != nil {
				t.Fatal(err)
			}
		}, nil, nil},
		{"flipped byte", func(t *testing.T, dir string) {
			p := filepath.Join(dir, filepath.FromSlash(victim))
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			b := make([]byte, 1)
			if _, err := f.ReadAt(b, 1<<20); err != nil {
				t.Fatal(err)
			}
			b[0] ^= 0xff
			if _, err := f.WriteAt(b, 1<<20); err != nil {
				t.Fatal(err)
			}
		}, ErrDigestMismatch, []string{victim + ": digest mismatch: manifest sha256:", " file sha256:"}},
		{"missing", func(t *testing.T, dir string) {
			if err := os.Remove(filepath.Join(dir, filepath.FromSlash(victim))); err != nil {
				t.Fatal(err)
			}
		}, ErrMissingFile, []string{victim}},
		{"extra", func(t *testing.T, dir string) {
			writeTree(t, dir, map[string][]byte{"checkpoint/zz-extra.img": []byte("surprise")})
		}, ErrExtraFile, []string{"checkpoint/zz-extra.img", "8 bytes"}},
		{"truncated", func(t *testing.T, dir string) {
			if err := os.Truncate(filepath.Join(dir, filepath.FromSlash(victim)), 100); err != nil {
				t.Fatal(err)
			}
		}, ErrTruncated, []string{victim, "file 100 bytes"}},
		{"grown", func(t *testing.T, dir string) {
			f, err := os.OpenFile(filepath.Join(dir, filepath.FromSlash(victim)), os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.Write([]byte("more")); err != nil {
				t.Fatal(err)
			}
		}, ErrSizeMismatch, []string{victim}},
		{"symlink added", func(t *testing.T, dir string) {
			if err := os.Symlink("/etc/shadow", filepath.Join(dir, "checkpoint", "link")); err != nil {
				t.Fatal(err)
			}
		}, ErrUnsupportedFile, []string{"checkpoint/link", "symlink"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir, m := manifested(t)
			tc.damage(t, dir)
			err := Verify(dir, m)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
			for _, s := range tc.inErr {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not contain %q", err, s)
				}
			}
		})
	}
}

func TestVerifyRejectsInvalidManifest(t *testing.T) {
	dir, m := manifested(t)
	m.Files[0].Path = "../../etc/passwd"
	if err := Verify(dir, m); !errors.Is(err, ErrInvalidManifest) {
		t.Fatalf("got %v, want ErrInvalidManifest", err)
	}
}

func BenchmarkDigestDir(b *testing.B) {
	dir := b.TempDir()
	const n, size = 8, 32 << 20
	tree := map[string][]byte{}
	for i := range n {
		tree[filepath.Join("checkpoint", "pages-"+string(rune('a'+i))+".img")] = randomBytes(size, uint64(i))
	}
	writeTree(b, dir, tree)
	b.SetBytes(n * size)
	for b.Loop() {
		if _, _, err := DigestDir(dir); err != nil {
			b.Fatal(err)
		}
	}
}
