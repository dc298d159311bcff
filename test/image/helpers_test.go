package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/opencontainers/go-digest"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

// layerEntry is one entry of a parsed layer tar.
type layerEntry struct {
	hdr  *tar.Header
	data []byte
}

// parsedImage is an image archive read back and checked by readArchive.
type parsedImage struct {
	names    []string // entries of the outer tar, in order
	index    v1.Index
	manifest v1.Manifest
	config   v1.Image
	layer    []byte
	entries  []layerEntry          // layer entries, in order
	files    map[string]layerEntry // layer entries by name (without trailing "/")
}

// readArchive parses an image-layout tar, checking that every blob is named by its digest
// and that index -> manifest -> config/layer descriptors match the blobs they point to.
func readArchive(t *testing.T, archive []byte) *parsedImage {
	t.Helper()
	p := &parsedImage{files: map[string]layerEntry{}}
	blobs := map[string][]byte{}
	var layout, index []byte
	tr := tar.NewReader(bytes.NewReader(archive))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("outer tar: %v", err)
		}
		p.names = append(p.names, h.Name)
		if !h.ModTime.Equal(epoch) || h.Uid != 0 || h.Gid != 0 {
			t.Errorf("outer entry %s: mtime %v uid %d gid %d, want epoch 0 0", h.Name, h.ModTime, h.Uid, h.Gid)
		}
		if h.Typeflag == tar.TypeDir {
			continue
		}
		if h.Typeflag != tar.TypeReg {
			t.Fatalf("outer entry %s: type %c", h.Name, h.Typeflag)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("outer entry %s: %v", h.Name, err)
		}
		switch {
		case h.Name == "oci-layout":
			layout = b
		case h.Name == "index.json":
			index = b
		case strings.HasPrefix(h.Name, "blobs/sha256/"):
			d := digest.NewDigestFromEncoded(digest.SHA256, strings.TrimPrefix(h.Name, "blobs/sha256/"))
			if err := d.Validate(); err != nil {
				t.Fatalf("blob %s: %v", h.Name, err)
			}
			if got := digest.FromBytes(b); got != d {
				t.Errorf("blob %s has digest %s", h.Name, got)
			}
			blobs[d.String()] = b
		default:
			t.Errorf("unexpected outer entry %s", h.Name)
		}
	}
	var l v1.ImageLayout
	if err := json.Unmarshal(layout, &l); err != nil || l.Version != v1.ImageLayoutVersion {
		t.Fatalf("oci-layout %q: %v", layout, err)
	}
	blob := func(what string, d v1.Descriptor, mediaType string) []byte {
		t.Helper()
		if d.MediaType != mediaType {
			t.Errorf("%s media type %q, want %q", what, d.MediaType, mediaType)
		}
		b, ok := blobs[d.Digest.String()]
		if !ok {
			t.Fatalf("%s blob %s missing", what, d.Digest)
		}
		if int64(len(b)) != d.Size {
			t.Errorf("%s size %d, descriptor says %d", what, len(b), d.Size)
		}
		return b
	}
	if err := json.Unmarshal(index, &p.index); err != nil {
		t.Fatalf("index.json: %v", err)
	}
	if p.index.SchemaVersion != 2 || p.index.MediaType != v1.MediaTypeImageIndex || len(p.index.Manifests) != 1 {
		t.Fatalf("index.json: %s", index)
	}
	md := p.index.Manifests[0]
	if err := json.Unmarshal(blob("manifest", md, v1.MediaTypeImageManifest), &p.manifest); err != nil {
		t.Fatalf("manifest: %v", err)
	}
	if p.manifest.SchemaVersion != 2 || p.manifest.MediaType != v1.MediaTypeImageManifest || len(p.manifest.Layers) != 1 {
		t.Fatalf("manifest: %+v", p.manifest)
	}
	if err := json.Unmarshal(blob("config", p.manifest.Config, v1.MediaTypeImageConfig), &p.config); err != nil {
		t.Fatalf("config: %v", err)
	}
	p.layer = blob("layer", p.manifest.Layers[0], v1.MediaTypeImageLayer)
	if len(p.config.RootFS.DiffIDs) != 1 || p.config.RootFS.DiffIDs[0] != p.manifest.Layers[0].Digest {
		t.Errorf("config diff_ids %v, layer %s", p.config.RootFS.DiffIDs, p.manifest.Layers[0].Digest)
	}
	if len(blobs) != 3 {
		t.Errorf("%d blobs, want 3", len(blobs))
	}
	lr := tar.NewReader(bytes.NewReader(p.layer))
	for {
		h, err := lr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("layer tar: %v", err)
		}
		b, err := io.ReadAll(lr)
		if err != nil {
			t.Fatalf("layer entry %s: %v", h.Name, err)
		}
		e := layerEntry{h, b}
		p.entries = append(p.entries, e)
		p.files[strings.TrimSuffix(h.Name, "/")] = e
	}
	return p
}

// readArchiveFile is readArchive of the file at path.
func readArchiveFile(t *testing.T, path string) *parsedImage {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return readArchive(t, b)
}

// extractLayer writes the layer's directories, regular files, symlinks and hard links to dir.
func extractLayer(t *testing.T, p *parsedImage, dir string) {
	t.Helper()
	for _, e := range p.entries {
		dst := filepath.Join(dir, filepath.FromSlash(e.hdr.Name))
		var err error
		switch e.hdr.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(dst, 0o755)
		case tar.TypeReg:
			err = os.WriteFile(dst, e.data, 0o600)
		case tar.TypeSymlink:
			err = os.Symlink(e.hdr.Linkname, dst)
		case tar.TypeLink:
			err = os.Link(filepath.Join(dir, filepath.FromSlash(e.hdr.Linkname)), dst)
		default:
			t.Fatalf("extract %s: type %c", e.hdr.Name, e.hdr.Typeflag)
		}
		if err == nil && e.hdr.Typeflag != tar.TypeSymlink && e.hdr.Typeflag != tar.TypeLink {
			err = os.Chmod(dst, e.hdr.FileInfo().Mode())
		}
		if err != nil {
			t.Fatalf("extract %s: %v", e.hdr.Name, err)
		}
	}
}

// needRoot skips the test unless it runs as root (for chroot).
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("CI is set but not root: cannot chroot")
		}
		t.Skip("needs root to chroot")
	}
}

// needFile skips the test when the host file p does not exist.
func needFile(t *testing.T, p string) {
	t.Helper()
	if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
		t.Skipf("%s not installed", p)
	}
}

// chrootCommand returns a command running argv chrooted into dir.
func chrootCommand(dir string, argv ...string) *exec.Cmd {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: dir}
	cmd.Dir = "/"
	cmd.Env = []string{DefaultPath}
	return cmd
}
