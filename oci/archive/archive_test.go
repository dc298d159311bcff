package archive

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/berth-dev/berth/oci/checkpoint"
)

func writeTree(t testing.TB, dir string, files map[string]string) {
	t.Helper()
	for p, data := range files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

var longName = strings.Repeat("long-directory-name/", 8) + strings.Repeat("x", 120) + ".img"

func sampleDir(t *testing.T) (string, map[string]string) {
	t.Helper()
	dir := t.TempDir()
	files := map[string]string{
		"checkpoint/pages-1.img": strings.Repeat("page", 5000),
		"checkpoint/core-1.img":  "core",
		"checkpoint/berth.json":  "{}",
		"checkpoint/empty.img":   "",
		"spec.dump":              "{}",
		"a-b":                    "x",
		"a/b":                    "y",
		longName:                 "long",
	}
	writeTree(t, dir, files)
	if err := os.Mkdir(filepath.Join(dir, "emptydir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, "a-b"), 0o777); err != nil {
		t.Fatal(err)
	}
	m := &checkpoint.Manifest{}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	files[checkpoint.ManifestFile] = string(data)
	return dir, files
}

func TestWriteExtractRoundTrip(t *testing.T) {
	dir, files := sampleDir(t)
	a, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	n, err := a.WriteTo(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(buf.Len()) || n != a.Size() {
		t.Fatalf("WriteTo returned %d, wrote %d, Size %d: must all agree", n, buf.Len(), a.Size())
	}

	// Deterministic: a second Write gives the same bytes.
	var again bytes.Buffer
	if err := Write(&again, dir); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf.Bytes(), again.Bytes()) {
		t.Error("two writes of the same directory differ")
	}

	// Headers: berth.json first, parents before children, root-owned, masked modes.
	tr := tar.NewReader(bytes.NewReader(buf.Bytes()))
	seen := map[string]bool{}
	for i := 0; ; i++ {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 && hdr.Name != checkpoint.ManifestFile {
			t.Errorf("first entry %q, want %s", hdr.Name, checkpoint.ManifestFile)
		}
		if parent := filepath.Dir(strings.TrimSuffix(hdr.Name, "/")); parent != "." && !seen[parent+"/"] {
			t.Errorf("%s comes before its directory", hdr.Name)
		}
		seen[hdr.Name] = true
		if hdr.Uid != 0 || hdr.Gid != 0 || hdr.Uname != "" || hdr.Gname != "" {
			t.Errorf("%s: owner %d:%d %q:%q, want 0:0", hdr.Name, hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname)
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if hdr.Mode&^0o755 != 0 {
				t.Errorf("%s: dir mode %o exceeds 0755", hdr.Name, hdr.Mode)
			}
		case tar.TypeReg:
			if hdr.Mode&^0o644 != 0 {
				t.Errorf("%s: file mode %o exceeds 0644", hdr.Name, hdr.Mode)
			}
		default:
			t.Errorf("%s: type %q", hdr.Name, hdr.Typeflag)
		}
	}
	if !seen["emptydir/"] || !seen[longName] {
		t.Errorf("missing entries: %v", seen)
	}

	dest := filepath.Join(t.TempDir(), "out")
	if err := Extract(bytes.NewReader(buf.Bytes()), dest, Limits{}); err != nil {
		t.Fatal(err)
	}
	for p, want := range files {
		got, err := os.ReadFile(filepath.Join(dest, filepath.FromSlash(p)))
		if err != nil || string(got) != want {
			t.Errorf("%s: got %q, %v", p, got, err)
		}
	}
	checkModes(t, dest)
	m, err := checkpoint.ReadManifest(dest)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.Verify(dest, m); err != nil {
		t.Errorf("extracted checkpoint does not verify: %v", err)
	}
}

// checkModes asserts files are 0600 and directories 0700 under dest (dest included), and that
// nothing else exists.
func checkModes(t testing.TB, dest string) {
	t.Helper()
	err := filepath.WalkDir(dest, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case info.IsDir():
			if info.Mode().Perm() != 0o700 {
				t.Errorf("%s: dir mode %v, want 0700", p, info.Mode().Perm())
			}
		case info.Mode().IsRegular():
			if info.Mode().Perm() != 0o600 {
				t.Errorf("%s: file mode %v, want 0600", p, info.Mode().Perm())
			}
		default:
			t.Errorf("%s: unexpected %v", p, info.Mode())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// tarEntry describes one entry of a hand-made archive.
type tarEntry struct {
	hdr  tar.Header
	body string
}

func reg(name, body string) tarEntry {
	return tarEntry{tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}, body}
}

func makeTar(t testing.TB, entries ...tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.body)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestExtractRejects(t *testing.T) {
	ok := reg("berth.json", "{}")
	cases := []struct {
		name    string
		tar     []byte
		lim     Limits
		wantErr error
		inErr   string
	}{
		{"absolute", makeTar(t, ok, reg("/etc/cron.d/evil", "x")), Limits{}, ErrUnsafePath, "/etc/cron.d/evil"},
		{"dotdot", makeTar(t, ok, reg("../evil", "x")), Limits{}, ErrUnsafePath, "../evil"},
		{"nested dotdot", makeTar(t, ok, reg("a/../../evil", "x")), Limits{}, ErrUnsafePath, "a/../../evil"},
		{"dotdot inside", makeTar(t, ok, reg("a/../b", "x")), Limits{}, ErrUnsafePath, "a/../b"},
		{"dir dotdot", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "../up/", Typeflag: tar.TypeDir, Mode: 0o755}}), Limits{}, ErrUnsafePath, "../up/"},
		{"dir dotdot to root", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "a/..", Typeflag: tar.TypeDir, Mode: 0o755}}), Limits{}, ErrUnsafePath, "a/.."},
		{"empty element", makeTar(t, ok, reg("a//b", "x")), Limits{}, ErrUnsafePath, "a//b"},
		{"symlink", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "link", Typeflag: tar.TypeSymlink, Linkname: "/etc/shadow"}}), Limits{}, ErrLink, "/etc/shadow"},
		{"hard link", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "hl", Typeflag: tar.TypeLink, Linkname: "berth.json"}}), Limits{}, ErrLink, "hl"},
		{"char device", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "null", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 3}}), Limits{}, ErrSpecialFile, "character device"},
		{"block device", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "sda", Typeflag: tar.TypeBlock, Devmajor: 8}}), Limits{}, ErrSpecialFile, "sda"},
		{"fifo", makeTar(t, ok, tarEntry{hdr: tar.Header{Name: "pipe", Typeflag: tar.TypeFifo}}), Limits{}, ErrSpecialFile, "fifo"},
		{"file too large", makeTar(t, ok, reg("big", strings.Repeat("x", 101))), Limits{MaxFileBytes: 100}, ErrFileTooLarge, "big"},
		{"total too large", makeTar(t, ok, reg("a", strings.Repeat("x", 60)), reg("b", strings.Repeat("x", 60))), Limits{MaxTotalBytes: 100}, ErrTotalTooLarge, `"b"`},
		{"too many entries", makeTar(t, ok, reg("a", ""), reg("b", ""), reg("c", "")), Limits{MaxEntries: 3}, ErrTooManyEntries, `"c"`},
		{"duplicate file", makeTar(t, ok, reg("a", "1"), reg("a", "2")), Limits{}, ErrDuplicateEntry, `"a"`},
		{"file over dir", makeTar(t, ok, reg("d/x", "1"), reg("d", "2")), Limits{}, ErrDuplicateEntry, `"d"`},
		{"dir over file", makeTar(t, ok, reg("d", "1"), tarEntry{hdr: tar.Header{Name: "d/", Typeflag: tar.TypeDir}}), Limits{}, ErrDuplicateEntry, `"d/"`},
		{"truncated", makeTar(t, ok, reg("a", strings.Repeat("x", 4096)))[:1024+512+100], Limits{}, io.ErrUnexpectedEOF, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			dest := filepath.Join(base, "deep", "out")
			if err := os.Mkdir(filepath.Dir(dest), 0o700); err != nil {
				t.Fatal(err)
			}
			err := Extract(bytes.NewReader(tc.tar), dest, tc.lim)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.inErr) {
				t.Errorf("error %q does not contain %q", err, tc.inErr)
			}
			if _, err := os.Lstat(dest); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("dest left behind: %v", err)
			}
			// Nothing escaped: base holds only the (empty) parent of dest.
			var found []string
			_ = filepath.WalkDir(base, func(p string, d fs.DirEntry, err error) error {
				if p != base && p != filepath.Dir(dest) {
					found = append(found, p)
				}
				return nil
			})
			if len(found) != 0 {
				t.Errorf("left behind: %v", found)
			}
		})
	}
}

func TestExtractAccepts(t *testing.T) {
	data := makeTar(t,
		tarEntry{hdr: tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o755}},
		reg("./berth.json", "{}"),
		tarEntry{hdr: tar.Header{Name: "pax-global", Typeflag: tar.TypeXGlobalHeader, PAXRecords: map[string]string{"comment": "hi"}}},
		reg("deep/er/file", "implicit parents"),
		tarEntry{hdr: tar.Header{Name: "deep/", Typeflag: tar.TypeDir, Mode: 0o777}},
		tarEntry{hdr: tar.Header{Name: "deep/", Typeflag: tar.TypeDir, Mode: 0o777}},
		tarEntry{hdr: tar.Header{Name: "setuid", Typeflag: tar.TypeReg, Mode: 0o4777, Size: 1}, body: "s"},
	)
	dest := filepath.Join(t.TempDir(), "out")
	if err := Extract(bytes.NewReader(data), dest, Limits{MaxEntries: 7}); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(dest, "deep", "er", "file")); err != nil || string(got) != "implicit parents" {
		t.Errorf("got %q, %v", got, err)
	}
	checkModes(t, dest)
}

func TestExtractDestMustNotExist(t *testing.T) {
	dest := t.TempDir()
	writeTree(t, dest, map[string]string{"keep": "me"})
	err := Extract(bytes.NewReader(makeTar(t, reg("a", "x"))), dest, Limits{})
	if !errors.Is(err, fs.ErrExist) {
		t.Fatalf("got %v, want fs.ErrExist", err)
	}
	if _, err := os.Stat(filepath.Join(dest, "keep")); err != nil {
		t.Errorf("existing dest was touched: %v", err)
	}
}

func TestWriteRejectsSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	writeTree(t, dir, map[string]string{"berth.json": "{}"})
	if err := syscall.Mkfifo(filepath.Join(dir, "pipe"), 0o600); err != nil {
		t.Skip(err)
	}
	err := Write(io.Discard, dir)
	if !errors.Is(err, checkpoint.ErrUnsupportedFile) || !strings.Contains(err.Error(), "pipe") {
		t.Fatalf("got %v, want ErrUnsupportedFile naming pipe", err)
	}
	if err := os.Remove(filepath.Join(dir, "pipe")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("berth.json", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := Write(io.Discard, dir); !errors.Is(err, checkpoint.ErrUnsupportedFile) {
		t.Fatalf("symlink: got %v", err)
	}
}

func TestWriteToDetectsChange(t *testing.T) {
	dir, _ := sampleDir(t)
	a, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "spec.dump"), []byte("grown"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = a.WriteTo(io.Discard)
	if !errors.Is(err, ErrChanged) || !strings.Contains(err.Error(), "spec.dump") {
		t.Fatalf("got %v, want ErrChanged naming spec.dump", err)
	}
}

func TestSizeLargeFileHeader(t *testing.T) {
	// A sparse file above the USTAR size field (8 GiB) needs a PAX size record; Size must count
	// it. The file is sparse, so this costs no disk, and only the header is encoded.
	dir := t.TempDir()
	f, err := os.Create(filepath.Join(dir, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(9 << 30); err != nil {
		f.Close()
		t.Skip("sparse file:", err)
	}
	f.Close()
	a, err := New(dir)
	if err != nil {
		t.Fatal(err)
	}
	var c countingWriter
	h := a.entries[0].header()
	tw := tar.NewWriter(&c)
	if err := tw.WriteHeader(h); err != nil {
		t.Fatal(err)
	}
	if want := c.n + roundUp(9<<30, blockSize) + 2*blockSize; a.Size() != want || c.n <= blockSize {
		t.Errorf("Size %d, want %d (header %d bytes, expected a PAX header)", a.Size(), want, c.n)
	}
}
