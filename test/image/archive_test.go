package image

import (
	"archive/tar"
	"bytes"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

func TestParseRef(t *testing.T) {
	tests := []struct {
		ref, tag string
		ok       bool
	}{
		{"localhost/berth/pause:3.10", "3.10", true},
		{"localhost/berth/infer:test", "test", true},
		{"localhost:5000/a/b:v1", "v1", true},
		{"localhost/berth/pause", "", false},   // no tag
		{"berth/pause:3.10", "", false},        // not fully qualified
		{"pause:3.10", "", false},              // not fully qualified
		{"localhost/Berth/pause:1", "", false}, // upper case repository
		{"localhost/berth/pause:3.10@sha256:" + strings.Repeat("a", 64), "", false},
		{"", "", false},
	}
	for _, tt := range tests {
		tag, err := ParseRef(tt.ref)
		if (err == nil) != tt.ok || tag != tt.tag {
			t.Errorf("ParseRef(%q) = %q, %v; want %q, ok=%v", tt.ref, tag, err, tt.tag, tt.ok)
		}
	}
}

// testRootfs makes a directory with one file of every kind the layer writer handles.
func testRootfs(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	long := strings.Repeat("d", 60) + "/" + strings.Repeat("f", 80) // > 100 bytes: PAX header
	for _, d := range []string{"a", "bin", "empty", filepath.Dir(long)} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	files := []struct {
		name, data string
		mode       os.FileMode
	}{
		{"a/hello", "hello\n", 0o644},
		{"bin/tool", "#!/bin/sh\necho tool\n", 0o755},
		{"bin/suid", "x", os.ModeSetuid | 0o755},
		{"zero", "", 0o600},
		{long, "long", 0o644},
	}
	for _, f := range files {
		p := filepath.Join(root, f.name)
		if err := os.WriteFile(p, []byte(f.data), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, f.mode); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		mode os.FileMode
		name string
	}{{0o750, "a"}, {os.ModeSticky | 0o777, "empty"}} {
		if err := os.Chmod(filepath.Join(root, c.name), c.mode); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("a/hello", filepath.Join(root, "rel-link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/a/hello", filepath.Join(root, "abs-link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(root, "a/hello"), filepath.Join(root, "hard")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(root, "fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	return root
}

func TestWriteArchiveLayout(t *testing.T) {
	root := testRootfs(t)
	const ref = "localhost/berth/test:v1"
	cfg := Config{Entrypoint: []string{"/bin/tool"}, Cmd: []string{"arg"}, Env: []string{"A=b"}, WorkingDir: "/a"}
	var buf bytes.Buffer
	md, err := WriteArchive(&buf, ref, root, cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := readArchive(t, buf.Bytes())

	wantOuter := []string{"oci-layout", "index.json", "blobs/", "blobs/sha256/",
		"blobs/sha256/" + p.manifest.Layers[0].Digest.Encoded(),
		"blobs/sha256/" + p.manifest.Config.Digest.Encoded(),
		"blobs/sha256/" + p.index.Manifests[0].Digest.Encoded()}
	if !slices.Equal(p.names, wantOuter) {
		t.Errorf("outer entries %q, want %q", p.names, wantOuter)
	}
	desc := p.index.Manifests[0]
	if desc.Digest.String() != md {
		t.Errorf("WriteArchive returned %s, index has %s", md, desc.Digest)
	}
	if desc.Platform == nil || desc.Platform.OS != "linux" || desc.Platform.Architecture != runtime.GOARCH {
		t.Errorf("index platform %+v", desc.Platform)
	}
	if desc.Annotations[AnnotationImageName] != ref || desc.Annotations[v1.AnnotationRefName] != "v1" {
		t.Errorf("index annotations %v", desc.Annotations)
	}
	c := p.config
	if c.OS != "linux" || c.Architecture != runtime.GOARCH || c.RootFS.Type != "layers" {
		t.Errorf("config platform/rootfs %+v", c)
	}
	if !slices.Equal(c.Config.Entrypoint, cfg.Entrypoint) || !slices.Equal(c.Config.Cmd, cfg.Cmd) ||
		!slices.Equal(c.Config.Env, []string{DefaultPath, "A=b"}) || c.Config.WorkingDir != "/a" {
		t.Errorf("config %+v", c.Config)
	}
	if got, err := ManifestDigest(root, cfg); err != nil || got != md {
		t.Errorf("ManifestDigest = %s, %v; want %s", got, err, md)
	}

	// Layer: every entry root-owned at time 0, in walk order, with the expected type and mode.
	var names []string
	for _, e := range p.entries {
		h := e.hdr
		names = append(names, h.Name)
		if h.Uid != 0 || h.Gid != 0 || h.Uname != "" || h.Gname != "" || !h.ModTime.Equal(epoch) {
			t.Errorf("layer %s: owner %d:%d %q:%q mtime %v", h.Name, h.Uid, h.Gid, h.Uname, h.Gname, h.ModTime)
		}
		if strings.HasPrefix(h.Name, "/") || strings.HasPrefix(h.Name, ".") {
			t.Errorf("layer %s: not a relative name", h.Name)
		}
	}
	if !slices.IsSortedFunc(names[:3], strings.Compare) || names[0] != "a/" {
		t.Errorf("layer entries not sorted: %q", names)
	}
	tests := []struct {
		name     string
		typ      byte
		mode     int64
		linkname string
		data     string
	}{
		{"a", tar.TypeDir, 0o750, "", ""},
		{"a/hello", tar.TypeReg, 0o644, "", "hello\n"},
		{"bin/tool", tar.TypeReg, 0o755, "", "#!/bin/sh\necho tool\n"},
		{"bin/suid", tar.TypeReg, 0o4755, "", "x"},
		{"empty", tar.TypeDir, 0o1777, "", ""},
		{"zero", tar.TypeReg, 0o600, "", ""},
		{"rel-link", tar.TypeSymlink, 0o777, "a/hello", ""},
		{"abs-link", tar.TypeSymlink, 0o777, "/a/hello", ""},
		{"hard", tar.TypeLink, 0o644, "a/hello", ""},
		{"fifo", tar.TypeFifo, 0o600, "", ""},
		{strings.Repeat("d", 60) + "/" + strings.Repeat("f", 80), tar.TypeReg, 0o644, "", "long"},
	}
	for _, tt := range tests {
		e, ok := p.files[tt.name]
		if !ok {
			t.Errorf("layer has no %s; has %q", tt.name, names)
			continue
		}
		if e.hdr.Typeflag != tt.typ || e.hdr.Mode != tt.mode || e.hdr.Linkname != tt.linkname || string(e.data) != tt.data {
			t.Errorf("layer %s: type %c mode %o link %q data %q; want %c %o %q %q",
				tt.name, e.hdr.Typeflag, e.hdr.Mode, e.hdr.Linkname, e.data, tt.typ, tt.mode, tt.linkname, tt.data)
		}
	}
	if len(p.entries) != len(tests)+2 { // + bin/ and dddd.../
		t.Errorf("layer has %d entries: %q", len(p.entries), names)
	}
}

func TestWriteArchiveDeterministic(t *testing.T) {
	root := testRootfs(t)
	const ref = "localhost/berth/test:v1"
	write := func() (string, []byte) {
		t.Helper()
		var buf bytes.Buffer
		md, err := WriteArchive(&buf, ref, root, Config{})
		if err != nil {
			t.Fatal(err)
		}
		return md, buf.Bytes()
	}
	md1, b1 := write()
	md2, b2 := write()
	if md1 != md2 || !bytes.Equal(b1, b2) {
		t.Fatalf("two writes differ: %s %s", md1, md2)
	}
	// Timestamps are not part of the image.
	old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	if err := os.Chtimes(filepath.Join(root, "a/hello"), old, old); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(filepath.Join(root, "a"), old, old); err != nil {
		t.Fatal(err)
	}
	if md3, b3 := write(); md3 != md1 || !bytes.Equal(b3, b1) {
		t.Errorf("archive changed with mtimes: %s, was %s", md3, md1)
	}
	// Contents and modes are.
	if err := os.Chmod(filepath.Join(root, "bin/tool"), 0o700); err != nil {
		t.Fatal(err)
	}
	if md4, _ := write(); md4 == md1 {
		t.Errorf("archive did not change with a mode")
	}
}

func TestWriteArchiveErrors(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	withSocket := t.TempDir()
	sock := filepath.Join(withSocket, "sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	tests := []struct {
		name, ref, rootfs, want string
	}{
		{"bad ref", "pause:3.10", dir, `"pause:3.10"`},
		{"missing rootfs", "localhost/berth/x:1", filepath.Join(dir, "missing"), filepath.Join(dir, "missing")},
		{"rootfs is a file", "localhost/berth/x:1", file, file},
		{"socket", "localhost/berth/x:1", withSocket, sock},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := WriteArchive(&bytes.Buffer{}, tt.ref, tt.rootfs, Config{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("WriteArchive error %v, want one naming %s", err, tt.want)
			}
		})
	}
}

func TestWriteArchiveFile(t *testing.T) {
	root := testRootfs(t)
	out := filepath.Join(t.TempDir(), "sub", "img.tar")
	md, err := WriteArchiveFile(out, "localhost/berth/test:v1", root, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if p := readArchiveFile(t, out); p.index.Manifests[0].Digest.String() != md {
		t.Errorf("digest %s, archive has %s", md, p.index.Manifests[0].Digest)
	}
	// A failed write leaves neither the archive nor a temporary file.
	bad := filepath.Join(filepath.Dir(out), "bad.tar")
	if _, err := WriteArchiveFile(bad, "localhost/berth/test:v1", filepath.Join(root, "missing"), Config{}); err == nil {
		t.Fatal("no error for a missing rootfs")
	}
	ents, err := os.ReadDir(filepath.Dir(out))
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "img.tar" {
		t.Errorf("directory holds %v, want only img.tar", ents)
	}
}
