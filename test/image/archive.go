package image

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"
)

const (
	// DefaultPath is the PATH environment entry that an image config gets when Config.Env has
	// no "PATH=" entry of its own.
	DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

	// AnnotationImageName is the index.json manifest annotation from which containerd takes
	// the name of an imported image (containerd's images.AnnotationImageName).
	AnnotationImageName = "io.containerd.image.name"

	// createdBy is recorded in the image config history.
	createdBy = "berth test/image"
)

// epoch is the modification time of every entry in the archives written here.
var epoch = time.Unix(0, 0)

// Config is the runtime configuration recorded in an image's config blob.
type Config struct {
	// Entrypoint and Cmd are the image's ENTRYPOINT and CMD in exec form (absolute paths
	// inside the image are recommended; no shell is involved).
	Entrypoint []string
	Cmd        []string
	// Env holds "NAME=value" entries. DefaultPath is prepended unless one starts with "PATH=".
	Env []string
	// WorkingDir is the absolute working directory inside the image; "" means "/".
	WorkingDir string
	// User is the user (name or uid[:gid]) the process runs as; "" means root.
	User string
}

// imageConfig returns the OCI image config for cfg with the given uncompressed layer digest.
func (c Config) imageConfig(layer digest.Digest) v1.Image {
	env := append([]string(nil), c.Env...)
	hasPath := false
	for _, e := range env {
		if strings.HasPrefix(e, "PATH=") {
			hasPath = true
		}
	}
	if !hasPath {
		env = append([]string{DefaultPath}, env...)
	}
	wd := c.WorkingDir
	if wd == "" {
		wd = "/"
	}
	return v1.Image{
		Platform: v1.Platform{Architecture: runtime.GOARCH, OS: "linux"},
		Config: v1.ImageConfig{
			User:       c.User,
			Env:        env,
			Entrypoint: c.Entrypoint,
			Cmd:        c.Cmd,
			WorkingDir: wd,
		},
		RootFS:  v1.RootFS{Type: "layers", DiffIDs: []digest.Digest{layer}},
		History: []v1.History{{CreatedBy: createdBy}},
	}
}

// ParseRef checks that ref is a fully qualified, tagged image reference without a digest, such
// as "localhost/berth/pause:3.10", and returns its tag ("3.10"). The reference must be
// canonical: one that containerd would not rewrite (so "berth/pause:3.10", which it would
// expand to a name on the default registry, is rejected). Errors name the reference.
func ParseRef(ref string) (tag string, err error) {
	named, err := reference.ParseNamed(ref)
	if err != nil {
		return "", fmt.Errorf("image reference %q: %w", ref, err)
	}
	if _, ok := named.(reference.Digested); ok {
		return "", fmt.Errorf("image reference %q: a digest is not allowed, only a tag", ref)
	}
	tagged, ok := named.(reference.Tagged)
	if !ok {
		return "", fmt.Errorf("image reference %q: no tag", ref)
	}
	return tagged.Tag(), nil
}

// blobs holds the serialized config and manifest of a single-layer image.
type blobs struct {
	layer    v1.Descriptor
	config   []byte
	manifest []byte
}

func (b blobs) configDesc() v1.Descriptor {
	return v1.Descriptor{MediaType: v1.MediaTypeImageConfig, Digest: digest.FromBytes(b.config), Size: int64(len(b.config))}
}

func (b blobs) manifestDesc() v1.Descriptor {
	return v1.Descriptor{MediaType: v1.MediaTypeImageManifest, Digest: digest.FromBytes(b.manifest), Size: int64(len(b.manifest))}
}

// makeBlobs serializes the config and manifest for a layer of the given digest and size.
func makeBlobs(layerDigest digest.Digest, layerSize int64, cfg Config) (blobs, error) {
	b := blobs{layer: v1.Descriptor{MediaType: v1.MediaTypeImageLayer, Digest: layerDigest, Size: layerSize}}
	var err error
	if b.config, err = json.Marshal(cfg.imageConfig(layerDigest)); err != nil {
		return blobs{}, fmt.Errorf("marshal image config: %w", err)
	}
	m := v1.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: v1.MediaTypeImageManifest,
		Config:    b.configDesc(),
		Layers:    []v1.Descriptor{b.layer},
	}
	if b.manifest, err = json.Marshal(m); err != nil {
		return blobs{}, fmt.Errorf("marshal image manifest: %w", err)
	}
	return b, nil
}

// countWriter counts the bytes written through it.
type countWriter struct{ n int64 }

func (c *countWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

// hashLayer computes the digest and size of the layer tar of rootfs without storing it.
func hashLayer(rootfs string) (digest.Digest, int64, error) {
	d := digest.Canonical.Digester()
	var c countWriter
	if err := writeLayer(io.MultiWriter(d.Hash(), &c), rootfs); err != nil {
		return "", 0, err
	}
	return d.Digest(), c.n, nil
}

// ManifestDigest returns the manifest digest ("sha256:<hex>") that WriteArchive would return
// for rootfs and cfg, reading rootfs once and writing nothing. The reference is not part of
// the manifest, so it is not an input. Errors name the rootfs path that could not be read.
func ManifestDigest(rootfs string, cfg Config) (string, error) {
	ld, ls, err := hashLayer(rootfs)
	if err != nil {
		return "", err
	}
	b, err := makeBlobs(ld, ls, cfg)
	if err != nil {
		return "", err
	}
	return b.manifestDesc().Digest.String(), nil
}

// WriteArchive writes to w an OCI image-layout tar of a single-layer image named ref whose
// layer holds the contents of the directory rootfs (not the directory entry itself) and whose
// config is cfg, for platform linux/runtime.GOARCH. The tar holds, in this order: oci-layout,
// index.json (one manifest descriptor with the platform and the annotations
// io.containerd.image.name=ref and org.opencontainers.image.ref.name=<tag of ref>), and under
// blobs/sha256/ the uncompressed layer tar, the config and the manifest, each named by the hex
// of its sha256 digest.
//
// The layer is deterministic: entries in lexical order per directory, uid/gid 0 with no owner
// names, modification time 0; directories, symlinks (targets kept verbatim), hard links,
// FIFOs, device nodes and permission bits including setuid/setgid/sticky are preserved.
// Sockets are an error. Writing the same rootfs contents and cfg twice gives identical bytes.
//
// rootfs is read twice (once to digest the layer, once to copy it); if it changes in between,
// an error is returned after part of the archive may have been written to w.
//
// It returns the manifest digest "sha256:<hex>", which is also what containerd reports as the
// image's digest after import. Errors wrap the cause and name ref or the path involved.
func WriteArchive(w io.Writer, ref string, rootfs string, cfg Config) (manifestDigest string, err error) {
	tag, err := ParseRef(ref)
	if err != nil {
		return "", err
	}
	ld, ls, err := hashLayer(rootfs)
	if err != nil {
		return "", err
	}
	b, err := makeBlobs(ld, ls, cfg)
	if err != nil {
		return "", err
	}
	md := b.manifestDesc()
	md.Platform = &v1.Platform{Architecture: runtime.GOARCH, OS: "linux"}
	md.Annotations = map[string]string{
		AnnotationImageName:  ref,
		v1.AnnotationRefName: tag,
	}
	index, err := json.Marshal(v1.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: v1.MediaTypeImageIndex,
		Manifests: []v1.Descriptor{md},
	})
	if err != nil {
		return "", fmt.Errorf("marshal image index for %q: %w", ref, err)
	}
	layout, err := json.Marshal(v1.ImageLayout{Version: v1.ImageLayoutVersion})
	if err != nil {
		return "", fmt.Errorf("marshal oci-layout for %q: %w", ref, err)
	}

	tw := tar.NewWriter(w)
	file := func(name string, data []byte) error {
		h := &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: epoch}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: epoch})
	}
	blobName := func(d digest.Digest) string {
		return v1.ImageBlobsDir + "/" + d.Algorithm().String() + "/" + d.Encoded()
	}
	wrap := func(err error) error { return fmt.Errorf("write image archive for %q: %w", ref, err) }

	if err := file(v1.ImageLayoutFile, layout); err != nil {
		return "", wrap(err)
	}
	if err := file(v1.ImageIndexFile, index); err != nil {
		return "", wrap(err)
	}
	if err := dir(v1.ImageBlobsDir + "/"); err != nil {
		return "", wrap(err)
	}
	if err := dir(v1.ImageBlobsDir + "/" + digest.Canonical.String() + "/"); err != nil {
		return "", wrap(err)
	}
	h := &tar.Header{Typeflag: tar.TypeReg, Name: blobName(ld), Mode: 0o644, Size: ls, ModTime: epoch}
	if err := tw.WriteHeader(h); err != nil {
		return "", wrap(err)
	}
	d := digest.Canonical.Digester()
	if err := writeLayer(io.MultiWriter(tw, d.Hash()), rootfs); err != nil {
		return "", fmt.Errorf("write image archive for %q: %w (did %s change while it was archived?)", ref, err, rootfs)
	}
	if d.Digest() != ld {
		return "", fmt.Errorf("write image archive for %q: layer of %s changed while it was archived (%s, then %s)", ref, rootfs, ld, d.Digest())
	}
	if err := file(blobName(b.configDesc().Digest), b.config); err != nil {
		return "", wrap(err)
	}
	if err := file(blobName(md.Digest), b.manifest); err != nil {
		return "", wrap(err)
	}
	if err := tw.Close(); err != nil {
		return "", wrap(err)
	}
	return md.Digest.String(), nil
}

// WriteArchiveFile is WriteArchive into the file path: it creates path's parent directories,
// writes to a temporary file beside path and renames it over path (mode 0644) only on success,
// so path never holds a partial archive. It returns the manifest digest "sha256:<hex>".
// Errors name path.
func WriteArchiveFile(path, ref, rootfs string, cfg Config) (manifestDigest string, err error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("create directory for image archive %s: %w", path, err)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("create image archive %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	manifestDigest, err = WriteArchive(f, ref, rootfs, cfg)
	if err != nil {
		return "", fmt.Errorf("image archive %s: %w", path, err)
	}
	if err = f.Chmod(0o644); err != nil {
		return "", fmt.Errorf("image archive %s: %w", path, err)
	}
	if err = f.Close(); err != nil {
		return "", fmt.Errorf("image archive %s: %w", path, err)
	}
	if err = os.Rename(f.Name(), path); err != nil {
		return "", fmt.Errorf("image archive %s: %w", path, err)
	}
	return manifestDigest, nil
}

// writeLayer writes the deterministic tar of the contents of root to w.
func writeLayer(w io.Writer, root string) error {
	fi, err := os.Stat(root)
	if err != nil {
		return fmt.Errorf("rootfs %s: %w", root, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("rootfs %s: not a directory", root)
	}
	links := map[devIno]string{}
	tw := tar.NewWriter(w)
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err // already a *fs.PathError naming p
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		if err := writeEntry(tw, p, filepath.ToSlash(rel), d, links); err != nil {
			var pe *fs.PathError
			if errors.As(err, &pe) {
				return err
			}
			return fmt.Errorf("%s: %w", p, err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("archive rootfs %s: %w", root, err)
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("archive rootfs %s: %w", root, err)
	}
	return nil
}

// devIno identifies a file for hard link detection.
type devIno struct{ dev, ino uint64 }

// writeEntry writes the tar entry name for the file p; links maps files with more than one
// link to the name of their first entry.
func writeEntry(tw *tar.Writer, p, name string, d fs.DirEntry, links map[devIno]string) error {
	info, err := d.Info()
	if err != nil {
		return err
	}
	mode := info.Mode()
	h := &tar.Header{Name: name, Mode: int64(mode.Perm()), ModTime: epoch}
	if mode&fs.ModeSetuid != 0 {
		h.Mode |= 0o4000
	}
	if mode&fs.ModeSetgid != 0 {
		h.Mode |= 0o2000
	}
	if mode&fs.ModeSticky != 0 {
		h.Mode |= 0o1000
	}
	st, _ := info.Sys().(*syscall.Stat_t)
	switch {
	case mode.IsDir():
		h.Typeflag = tar.TypeDir
		h.Name += "/"
	case mode&fs.ModeSymlink != 0:
		h.Typeflag = tar.TypeSymlink
		if h.Linkname, err = os.Readlink(p); err != nil {
			return err
		}
	case mode.IsRegular():
		if st != nil && st.Nlink > 1 {
			key := devIno{uint64(st.Dev), st.Ino}
			if first, ok := links[key]; ok {
				h.Typeflag = tar.TypeLink
				h.Linkname = first
				return tw.WriteHeader(h)
			}
			links[key] = name
		}
		h.Typeflag = tar.TypeReg
		h.Size = info.Size()
	case mode&fs.ModeNamedPipe != 0:
		h.Typeflag = tar.TypeFifo
	case mode&fs.ModeDevice != 0:
		if st == nil {
			return errors.New("device node without stat information")
		}
		h.Typeflag = tar.TypeBlock
		if mode&fs.ModeCharDevice != 0 {
			h.Typeflag = tar.TypeChar
		}
		h.Devmajor = int64(unix.Major(uint64(st.Rdev)))
		h.Devminor = int64(unix.Minor(uint64(st.Rdev)))
	default:
		return fmt.Errorf("unsupported file type %s", mode.Type())
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	if h.Typeflag != tar.TypeReg || h.Size == 0 {
		return nil
	}
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(tw, io.LimitReader(f, h.Size))
	if err != nil {
		return err
	}
	if n != h.Size {
		return fmt.Errorf("file shrank from %d to %d bytes while archived", h.Size, n)
	}
	return nil
}
