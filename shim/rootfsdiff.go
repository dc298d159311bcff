package shim

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/continuity/fs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// rootfsDiffSlack is what a rootfs diff's tar stream may hold beyond its files' contents (headers,
// padding, long names) before it counts as over its limit, in bytes.
const rootfsDiffSlack = 64 << 20

// scanRootfsDiff reads the rootfs diff at path (a tar, plain or compressed) up to its end without
// writing anything and returns its number of entries. It refuses (ErrRootfsDiffTooLarge) a diff
// whose regular files add up to more than max_rootfs_diff_bytes (as their headers declare them,
// so a decompression bomb is refused at its first header), with more than MaxArchiveEntries
// entries, or whose decompressed stream runs longer than that allows; a stream that is not a tar
// is refused as a bad archive.
func (s *Service) scanRootfsDiff(path string) (int, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	r, err := s.rootfsDiffStream(f)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	tr := tar.NewReader(r)
	var entries int
	var total int64
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return entries, nil
		}
		if err != nil {
			return entries, s.diffErr(err)
		}
		entries++
		if entries > MaxArchiveEntries {
			return entries, fmt.Errorf("more than %d entries: %w", MaxArchiveEntries, ErrRootfsDiffTooLarge)
		}
		if hdr.Typeflag == tar.TypeReg {
			total += hdr.Size
			if hdr.Size < 0 || total > s.cfg.MaxRootfsDiffBytes {
				return entries, fmt.Errorf("entry %s: its files add up to more than %d bytes (max_rootfs_diff_bytes of %s): %w",
					quote(hdr.Name), s.cfg.MaxRootfsDiffBytes, s.configName(), ErrRootfsDiffTooLarge)
			}
		}
	}
}

// applyDiff applies the rootfs diff at path to rootfs with containerd's archive.Apply (OCI
// whiteouts, no path leaves rootfs), reading at most what scanRootfsDiff allows.
func (s *Service) applyDiff(ctx context.Context, path, rootfs string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	r, err := s.rootfsDiffStream(f)
	if err != nil {
		return err
	}
	defer r.Close()
	if _, err := archive.Apply(ctx, rootfs, r); err != nil {
		return s.diffErr(err)
	}
	return nil
}

// rootfsDiffStream returns f's tar stream, gunzipped when f is gzip (containerd's own rw layer in
// a CRI archive is gzip; berth's is plain), cut off with ErrRootfsDiffTooLarge past what
// max_rootfs_diff_bytes allows. A zstd stream is refused as a bad archive: neither containerd nor
// berth writes one, and the standard library's gzip reader keeps the zstd decoder of containerd's
// archive/compression (about 0.4 MB of code) out of every container's shim.
func (s *Service) rootfsDiffStream(f *os.File) (io.ReadCloser, error) {
	br := bufio.NewReader(f)
	magic, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read rootfs diff: %w", err)
	}
	var r io.Reader = br
	var c io.Closer = io.NopCloser(nil) // the caller closes f
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("read rootfs diff: %w: %w", err, ErrBadArchive)
		}
		r, c = zr, zr
	case bytes.Equal(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		return nil, fmt.Errorf("read rootfs diff: zstd-compressed, want a plain or gzip tar: %w", ErrBadArchive)
	}
	return &boundedReader{r: r, c: c, left: s.cfg.MaxRootfsDiffBytes + rootfsDiffSlack}, nil
}

// diffErr classifies an error met while reading a rootfs diff: over the limit stays as it is,
// anything else is a bad archive.
func (s *Service) diffErr(err error) error {
	if errors.Is(err, ErrRootfsDiffTooLarge) {
		return err
	}
	return mark(err, ErrBadArchive)
}

// boundedReader reads from r until left bytes were read, then fails with ErrRootfsDiffTooLarge.
type boundedReader struct {
	r    io.Reader
	c    io.Closer
	left int64
}

func (b *boundedReader) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, fmt.Errorf("decompressed stream longer than its limit: %w", ErrRootfsDiffTooLarge)
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.r.Read(p)
	b.left -= int64(n)
	return n, err
}

func (b *boundedReader) Close() error { return b.c.Close() }

// writeRootfsDiff writes the changes in the writable layer of a container whose root filesystem
// is mounts (as Create received them) to path as a tar (uncompressed, OCI whiteouts), the way
// containerd's overlay differ does: the overlay's upper directory walked against a read-only
// mount of its lower directories (continuity's DiffDirChanges, containerd's ChangeWriter). It
// returns false without writing anything for a root filesystem that is not a single overlay mount
// with an upper directory.
func writeRootfsDiff(ctx context.Context, mounts []mount.Mount, path string) (_ bool, retErr error) {
	upper, lower, ok := overlayLayers(mounts)
	if !ok {
		return false, nil
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return false, err
	}
	defer func() {
		if err := f.Close(); err != nil && retErr == nil {
			retErr = err
		}
		if retErr != nil {
			os.Remove(path)
		}
	}()
	err = mount.WithTempMount(ctx, []mount.Mount{lower}, func(lowerRoot string) error {
		cw := archive.NewChangeWriter(f, upper)
		if err := fs.DiffDirChanges(ctx, lowerRoot, upper, fs.DiffSourceOverlayFS, cw.HandleChange); err != nil {
			return err
		}
		return cw.Close()
	})
	if err != nil {
		return false, err
	}
	log.G(ctx).WithField("path", path).Debug("rootfs diff written from the overlay's upper directory")
	return true, nil
}

// overlayLayers returns, for a root filesystem that is one overlay mount with an upper directory,
// that directory and a read-only mount of its lower directories (an overlay of them, or a bind
// mount of the only one).
func overlayLayers(mounts []mount.Mount) (upper string, lower mount.Mount, ok bool) {
	if len(mounts) != 1 || mounts[0].Type != "overlay" {
		return "", mount.Mount{}, false
	}
	var lowers []string
	var opts []string
	for _, o := range mounts[0].Options {
		switch {
		case strings.HasPrefix(o, "upperdir="):
			upper = strings.TrimPrefix(o, "upperdir=")
		case strings.HasPrefix(o, "lowerdir="):
			lowers = strings.Split(strings.TrimPrefix(o, "lowerdir="), ":")
		case strings.HasPrefix(o, "workdir="), o == "rw", o == "ro", o == "volatile", o == "fsync=volatile",
			strings.HasPrefix(o, "uidmap="), strings.HasPrefix(o, "gidmap="):
		default:
			opts = append(opts, o)
		}
	}
	switch {
	case upper == "" || len(lowers) == 0:
		return "", mount.Mount{}, false
	case len(lowers) == 1:
		return upper, mount.Mount{Type: "bind", Source: lowers[0], Options: []string{"ro", "rbind"}}, true
	default:
		return upper, mount.Mount{Type: "overlay", Source: "overlay",
			Options: append(opts, "ro", "lowerdir="+strings.Join(lowers, ":"))}, true
	}
}
