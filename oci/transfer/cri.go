package transfer

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"strings"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// LayoutCRI is the header's layout of a CRI checkpoint archive (the kubelet checkpoint API's,
// or `crictl checkpoint --export`'s): an uncompressed tar sent byte for byte as the node wrote
// it, whose only berth manifest is the shim's checkpoint/berth.json (with checkpoint/berth.sig),
// covering the CRIU images. The receiver extracts it into a directory of the same layout, which
// the shim restores from like the archive (its restore-from annotation names the directory).
const LayoutCRI = "cri"

// criManifestPath is where a CRI archive holds the shim's manifest.
var criManifestPath = path.Join(checkpoint.ImagesDir, checkpoint.ManifestFile)

// SendCRIArchive sends the CRI checkpoint archive at archivePath to the receiver at the other
// end of conn, under name, as it is (no re-packing: the stream is the file), and waits for the
// receiver's verdict; the receiver stores it as the directory Root/<name> (see LayoutCRI). The
// header carries the archive's checkpoint/berth.json, so the receiver refuses a stream whose
// manifest differs, verifies every CRIU image against it and checks its signature (Verify) before
// the directory is renamed into place. Files outside checkpoint/ (containerd's rootfs-diff.tar,
// spec.dump, config.dump) are covered by no signature, as in the archive; the shim decides what
// to do with them at restore. conn, ctx and progress are as for Send.
//
// Errors: ErrInvalidName (nothing is sent); ErrNotCRIArchive (wrapped, naming the file) for a
// file that is not an uncompressed tar holding checkpoint/berth.json, and the file's open or read
// errors (nothing is sent); then Send's errors.
func SendCRIArchive(ctx context.Context, conn net.Conn, archivePath, name string, progress func(sent, total int64)) (Result, error) {
	if err := ValidName(name); err != nil {
		return Result{}, fmt.Errorf("send: %w", err)
	}
	f, err := os.Open(archivePath)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	if !fi.Mode().IsRegular() {
		return Result{}, fmt.Errorf("send %s: %w: %s is not a regular file", name, ErrNotCRIArchive, archivePath)
	}
	raw, err := criManifest(f, archivePath)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	if _, err := checkpoint.ParseManifest(raw); err != nil {
		return Result{}, fmt.Errorf("send %s: %s: %s: %w", name, archivePath, criManifestPath, err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	hdr := header{Magic: Magic, Name: name, TotalBytes: fi.Size(), Manifest: raw, Layout: LayoutCRI}
	return sendStream(ctx, conn, hdr, fileStream{f, fi.Size()}, progress)
}

// ErrNotCRIArchive: the file to send is not a CRI checkpoint archive of the berth runtime.
var ErrNotCRIArchive = errors.New("not a CRI checkpoint archive of the berth runtime")

// criManifest returns the content of the archive's checkpoint/berth.json, reading only tar
// headers (seeking past contents) up to it.
func criManifest(f io.ReadSeeker, name string) ([]byte, error) {
	magic := make([]byte, 2)
	if n, _ := io.ReadFull(f, magic); n == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		return nil, fmt.Errorf("%w: %s is gzip-compressed", ErrNotCRIArchive, name)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: %s holds no %s (was it taken with the berth runtime handler?)", ErrNotCRIArchive, name, criManifestPath)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrNotCRIArchive, name, err)
		}
		if path.Clean(strings.TrimPrefix(h.Name, "./")) != criManifestPath {
			continue
		}
		if h.Typeflag != tar.TypeReg || h.Size > checkpoint.MaxManifestBytes {
			return nil, fmt.Errorf("%w: %s: %s is not a regular file of at most %d bytes", ErrNotCRIArchive, name, criManifestPath, checkpoint.MaxManifestBytes)
		}
		var b bytes.Buffer
		if _, err := io.Copy(&b, tr); err != nil {
			return nil, fmt.Errorf("%s: %s: %w", name, criManifestPath, err)
		}
		return b.Bytes(), nil
	}
}

// fileStream writes the first size bytes of f.
type fileStream struct {
	f    *os.File
	size int64
}

// WriteTo copies the file 1 MiB at a time; a file that shrank is an error (the announced length
// would not be met).
func (s fileStream) WriteTo(w io.Writer) (int64, error) {
	buf := make([]byte, 1<<20)
	n, err := io.CopyBuffer(w, io.LimitReader(onlyReader{s.f}, s.size), buf)
	if err == nil && n != s.size {
		err = fmt.Errorf("%s: %w: %d of %d bytes", s.f.Name(), io.ErrUnexpectedEOF, n, s.size)
	}
	return n, err
}

// onlyReader hides the file's WriteTo and ReadFrom, so that CopyBuffer uses the buffer.
type onlyReader struct{ r io.Reader }

func (o onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }
