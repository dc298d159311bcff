package checkpoint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// writeTree creates files (slash path -> content) under dir.
func writeTree(t testing.TB, dir string, files map[string][]byte) {
	t.Helper()
	for p, data := range files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func sha(data []byte) string {
	s := sha256.Sum256(data)
	return DigestAlgorithm + hex.EncodeToString(s[:])
}

func randomBytes(n int, seed uint64) []byte {
	var key [32]byte
	key[0] = byte(seed)
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

func sampleTree() map[string][]byte {
	return map[string][]byte{
		"checkpoint/pages-1.img":     randomBytes(3<<20+17, 1),
		"checkpoint/core-1.img":      []byte("core"),
		"checkpoint/berth.json":      []byte(`{"version":1}`),
		"checkpoint/empty.img":       {},
		"spec.dump":                  []byte(`{"ociVersion":"1.2.0"}`),
		"a-b":                        []byte("sorts before a/b"),
		"a/b":                        []byte("nested"),
		"deep/er/still/deeper/x.img": randomBytes(4096, 2),
	}
}

func TestDigestDir(t *testing.T) {
	dir := t.TempDir()
	tree := sampleTree()
	writeTree(t, dir, tree)
	// The top-level manifest is not digested; an empty directory contributes nothing.
	writeTree(t, dir, map[string][]byte{ManifestFile: []byte("{}")})
	if err := os.Mkdir(filepath.Join(dir, "emptydir"), 0o700); err != nil {
		t.Fatal(err)
	}

	files, total, err := DigestDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != len(tree) {
		t.Fatalf("got %d files, want %d: %+v", len(files), len(tree), files)
	}
	var want int64
	for i, f := range files {
		data, ok := tree[f.Path]
		if !ok {
			t.Fatalf("unexpected file %q", f.Path)
		}
		if f.Size != int64(len(data)) || f.Digest != sha(data) {
			t.Errorf("%s: got size %d digest %s, want %d %s", f.Path, f.Size, f.Digest, len(data), sha(data))
		}
		if i > 0 && files[i-1].Path >= f.Path {
			t.Errorf("not sorted: %q before %q", files[i-1].Path, f.Path)
		}
		want += int64(len(data))
	}
	if total != want {
		t.Errorf("total %d bytes, want %d", total, want)
	}
	if files[0].Path != "a-b" || files[1].Path != "a/b" {
		t.Errorf("want byte-wise path order (a-b before a/b), got %q, %q", files[0].Path, files[1].Path)
	}

	empty, total, err := DigestDir(t.TempDir())
	if err != nil || empty == nil || len(empty) != 0 || total != 0 {
		t.Errorf("empty dir: got %v, %d, %v; want empty non-nil slice", empty, total, err)
	}
}

func TestDigestDirRejectsSpecialFiles(t *testing.T) {
	cases := map[string]func(t *testing.T, path string){
		"symlink": func(t *testing.T, path string) {
			if err := os.Symlink("/etc/passwd", path); err != nil {
				t.Fatal(err)
			}
		},
		"fifo": func(t *testing.T, path string) {
			if err := syscall.Mkfifo(path, 0o600); err != nil {
				t.Skip("mkfifo:", err)
			}
		},
		"socket": func(t *testing.T, path string) {
			ln, err := net.Listen("unix", path)
			if err != nil {
				t.Skip("unix socket:", err)
			}
			t.Cleanup(func() { ln.Close() })
		},
	}
	for name, mk := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			writeTree(t, dir, map[string][]byte{"checkpoint/core-1.img": []byte("x")})
			mk(t, filepath.Join(dir, "checkpoint", "odd"))
			done := make(chan struct{})
			var err error
			go func() { _, _, err = DigestDir(dir); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("DigestDir blocked (opened a fifo?)")
			}
			if !errors.Is(err, ErrUnsupportedFile) || !strings.Contains(err.Error(), "checkpoint/odd") {
				t.Fatalf("got %v, want ErrUnsupportedFile naming checkpoint/odd", err)
			}
			if err := Verify(dir, &Manifest{Files: []File{}}); !errors.Is(err, ErrUnsupportedFile) {
				t.Fatalf("Verify: got %v, want ErrUnsupportedFile", err)
			}
		})
	}
	t.Run("symlinked manifest", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Symlink("/etc/hostname", filepath.Join(dir, ManifestFile)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := DigestDir(dir); !errors.Is(err, ErrUnsupportedFile) {
			t.Errorf("DigestDir: got %v, want ErrUnsupportedFile", err)
		}
		if _, err := ReadManifest(dir); !errors.Is(err, ErrUnsupportedFile) {
			t.Errorf("ReadManifest: got %v, want ErrUnsupportedFile", err)
		}
	})
}

func TestWriteReadManifest(t *testing.T) {
	dir := t.TempDir()
	writeTree(t, dir, sampleTree())
	m := &Manifest{
		Created:   time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC),
		Container: ContainerInfo{ID: "c1", Namespace: "k8s.io"},
		Phases:    []Phase{{Name: "criu-dump", Ms: 12.5}},
	}
	if err := WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	if m.Version != ManifestVersion || len(m.Files) != len(sampleTree()) || m.ImageSize == 0 {
		t.Fatalf("manifest not completed: version %d, %d files, %d bytes", m.Version, len(m.Files), m.ImageSize)
	}
	info, err := os.Stat(filepath.Join(dir, ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o600 {
		t.Errorf("berth.json mode %v, want 0600", info.Mode().Perm())
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".tmp") {
			t.Errorf("temporary file left: %s", e.Name())
		}
	}

	got, err := ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got.Container != m.Container || !got.Created.Equal(m.Created) || got.ImageSize != m.ImageSize ||
		len(got.Files) != len(m.Files) || got.Files[3] != m.Files[3] || len(got.Phases) != 1 {
		t.Errorf("round trip differs:\n got %+v\nwant %+v", got, m)
	}
	if err := Verify(dir, got); err != nil {
		t.Errorf("Verify after WriteManifest: %v", err)
	}

	// Rewriting keeps the given Files and replaces berth.json.
	got.Container.ID = "c2"
	if err := WriteManifest(dir, got); err != nil {
		t.Fatal(err)
	}
	again, err := ReadManifest(dir)
	if err != nil || again.Container.ID != "c2" {
		t.Fatalf("rewrite: %v, %+v", err, again)
	}
}

func TestWriteManifestRejects(t *testing.T) {
	dir := t.TempDir()
	if err := WriteManifest(dir, &Manifest{Version: 2}); !errors.Is(err, ErrUnsupportedVersion) {
		t.Errorf("version 2: got %v", err)
	}
	bad := &Manifest{Files: []File{{Path: "../x", Size: 1, Digest: sha([]byte("x"))}}}
	if err := WriteManifest(dir, bad); !errors.Is(err, ErrInvalidManifest) {
		t.Errorf("bad path: got %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, ManifestFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a rejected manifest was written: %v", err)
	}
	// Files given without ImageSize: computed.
	ok := &Manifest{Files: []File{{Path: "x", Size: 1, Digest: sha([]byte("x"))}}}
	if err := WriteManifest(dir, ok); err != nil || ok.ImageSize != 1 {
		t.Errorf("given files: %v, imageSize %d", err, ok.ImageSize)
	}
}

func TestParseManifest(t *testing.T) {
	d := sha([]byte("x"))
	hexPart := strings.TrimPrefix(d, DigestAlgorithm)
	cases := []struct {
		name    string
		json    string
		wantErr error
		inErr   string
	}{
		{"minimal", `{"version":1,"files":[],"imageSize":0}`, nil, ""},
		{"no files key", `{"version":1}`, nil, ""},
		{"unknown field ignored", `{"version":1,"futureField":{"a":1}}`, nil, ""},
		{"newer version", `{"version":2,"files":"a new shape"}`, ErrUnsupportedVersion, "version 2"},
		{"version 0", `{"version":0}`, ErrUnsupportedVersion, "version 0"},
		{"no version", `{"files":[]}`, ErrUnsupportedVersion, "no version"},
		{"not json", `berth`, ErrInvalidManifest, ""},
		{"trailing data", `{"version":1} {}`, ErrInvalidManifest, ""},
		{"wrong type", `{"version":1,"imageSize":"big"}`, ErrInvalidManifest, ""},
		{"dotdot path", `{"version":1,"imageSize":1,"files":[{"path":"a/../b","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "a/../b"},
		{"absolute path", `{"version":1,"imageSize":1,"files":[{"path":"/etc/shadow","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "/etc/shadow"},
		{"manifest listed", `{"version":1,"imageSize":1,"files":[{"path":"berth.json","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "berth.json"},
		{"bad digest", `{"version":1,"imageSize":1,"files":[{"path":"a","size":1,"digest":"md5:00"}]}`, ErrInvalidManifest, "md5:00"},
		{"upper hex", `{"version":1,"imageSize":1,"files":[{"path":"a","size":1,"digest":"` + strings.ToUpper(d) + `"}]}`, ErrInvalidManifest, ""},
		{"negative size", `{"version":1,"imageSize":-1,"files":[{"path":"a","size":-1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "negative"},
		{"unsorted", `{"version":1,"imageSize":2,"files":[{"path":"b","size":1,"digest":"` + d + `"},{"path":"a","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "sorted"},
		{"duplicate", `{"version":1,"imageSize":2,"files":[{"path":"a","size":1,"digest":"` + d + `"},{"path":"a","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "duplicate"},
		{"image size", `{"version":1,"imageSize":5,"files":[{"path":"a","size":1,"digest":"` + d + `"}]}`, ErrInvalidManifest, "imageSize 5"},
		{"page stream blake3", `{"version":1,"pageStream":{"digest":"blake3:` + hexPart + `","size":4}}`, nil, ""},
		{"page stream sha256", `{"version":1,"pageStream":{"digest":"` + d + `","size":4}}`, nil, ""},
		{"page stream unknown algorithm", `{"version":1,"pageStream":{"digest":"md5:` + hexPart + `","size":4}}`, ErrPageDigestAlgorithm, `"md5"`},
		{"page stream unknown algorithm is invalid", `{"version":1,"pageStream":{"digest":"k12:` + hexPart + `","size":4}}`, ErrInvalidManifest, "blake3"},
		{"page stream no algorithm", `{"version":1,"pageStream":{"digest":"` + hexPart + `","size":4}}`, ErrInvalidManifest, "<algorithm>:<hex>"},
		{"page stream empty algorithm", `{"version":1,"pageStream":{"digest":":` + hexPart + `","size":4}}`, ErrInvalidManifest, "<algorithm>:<hex>"},
		{"page stream short digest", `{"version":1,"pageStream":{"digest":"blake3:00","size":4}}`, ErrInvalidManifest, "blake3:00"},
		{"page stream negative size", `{"version":1,"pageStream":{"digest":"blake3:` + hexPart + `","size":-4}}`, ErrInvalidManifest, "negative"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseManifest([]byte(tc.json))
			if tc.wantErr == nil {
				if err != nil || m == nil || m.Files == nil {
					t.Fatalf("got %v, %+v", err, m)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.inErr) {
				t.Fatalf("got %v, want %v containing %q", err, tc.wantErr, tc.inErr)
			}
		})
	}
	if _, err := ParseManifest(bytes.Repeat([]byte(" "), MaxManifestBytes+1)); !errors.Is(err, ErrInvalidManifest) {
		t.Errorf("oversized: got %v", err)
	}
}

func TestReadManifestErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := ReadManifest(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing: got %v", err)
	}
	writeTree(t, dir, map[string][]byte{ManifestFile: []byte(`{"version":7}`)})
	_, err := ReadManifest(dir)
	if !errors.Is(err, ErrUnsupportedVersion) || !strings.Contains(err.Error(), "version 7") {
		t.Errorf("newer: got %v", err)
	}
}

// TestNewPageDigest: each known page digest algorithm hashes as its library does (BLAKE3's
// published test vector for the empty input), "" is SHA-256 (senders that named none), and any
// other name is refused.
func TestNewPageDigest(t *testing.T) {
	for _, tc := range []struct{ alg, want string }{
		{"blake3", "blake3:af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"},
		{"sha256", "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
		{"", "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
	} {
		h, err := NewPageDigest(tc.alg)
		if err != nil {
			t.Fatalf("%q: %v", tc.alg, err)
		}
		if got := PageDigest(tc.alg, h); got != tc.want {
			t.Errorf("%q of nothing = %s, want %s", tc.alg, got, tc.want)
		}
		if alg, err := PageDigestAlgorithm(tc.want); err != nil || alg != strings.Split(tc.want, ":")[0] {
			t.Errorf("PageDigestAlgorithm(%s) = %q, %v", tc.want, alg, err)
		}
	}
	for _, alg := range []string{"md5", "BLAKE3", "sha512", "blake3:"} {
		if _, err := NewPageDigest(alg); !errors.Is(err, ErrPageDigestAlgorithm) || !strings.Contains(err.Error(), "blake3") {
			t.Errorf("NewPageDigest(%q) = %v, want ErrPageDigestAlgorithm naming the known ones", alg, err)
		}
	}
}
