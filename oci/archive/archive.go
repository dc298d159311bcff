// Package archive turns a berth checkpoint directory into a tar stream and back: Write (and
// Archive, which also knows the stream's exact length in bytes beforehand) on the source node,
// Extract on the receiving one.
//
// The stream is a plain tar that standard tools read. Only regular files and directories are
// written, berth.json first (so a reader can check the manifest before the bulk arrives), then
// every other entry in byte-wise path order; owners are 0:0, modification times are the Unix
// epoch, and modes are masked to at most 0644 (files) and 0755 (directories), so the same
// directory always yields the same bytes.
//
// Extract treats its input as hostile: it refuses names that leave the destination, links,
// devices, FIFOs, oversized entries and archives, and too many entries, before writing anything
// for the offending entry, and removes everything it created when it fails.
//
// What belongs here: the tar form of a checkpoint. What does not: the manifest and its digests
// (package oci/checkpoint; Extract does not verify digests, its caller runs checkpoint.Verify), and moving bytes
// between nodes (oci/transfer).
package archive

import (
	"archive/tar"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/fsutil"
)

// copyBufferSize is the buffer used to copy file contents into and out of the tar stream, in
// bytes.
const copyBufferSize = 1 << 20

// ErrChanged is returned (wrapped, naming the file) by Archive.WriteTo when a file's type or size
// differs from when New listed the directory. The checkpoint must not change while it is
// archived.
var ErrChanged = errors.New("checkpoint changed while being archived")

// epoch is the modification time of every entry Write produces.
var epoch = time.Unix(0, 0)

// Archive is a checkpoint directory listed for archiving. Its Size is the exact length of the
// stream WriteTo produces, so a sender can announce it (and a progress display can show it)
// before sending.
type Archive struct {
	dir     string
	entries []entry
	size    int64
}

// entry is one file or directory of an Archive.
type entry struct {
	// name is the tar entry name: slash-separated, relative; directories end in "/".
	name string
	// rel is the path relative to the directory, slash-separated, without a trailing slash.
	rel  string
	dir  bool
	size int64 // bytes; 0 for directories
	mode int64 // permission bits written to the tar header
}

// New lists dir for archiving: every directory and regular file under it (dir itself excluded),
// the top-level berth.json first, then the others in byte-wise path order (a directory always
// precedes its contents). berth.json need not exist; a checkpoint without one archives fine but
// will not pass a receiver's verification.
//
// Errors: checkpoint.ErrUnsupportedFile (wrapped, naming the path and type) for a symlink, device,
// FIFO or socket under dir; the *fs.PathError of a failed directory read or stat.
func New(dir string) (*Archive, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	defer root.Close()

	var entries []entry
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch m := info.Mode(); {
		case m.IsDir():
			entries = append(entries, entry{name: p + "/", rel: p, dir: true, mode: int64(m.Perm() & 0o755)})
		case m.IsRegular():
			entries = append(entries, entry{name: p, rel: p, size: info.Size(), mode: int64(m.Perm() & 0o644)})
		default:
			return fmt.Errorf("%s: %w (%s)", p, checkpoint.ErrUnsupportedFile, fsutil.TypeName(m))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("archive %s: %w", dir, err)
	}
	slices.SortFunc(entries, func(a, b entry) int {
		// berth.json first; then byte-wise by path, which puts every directory before its
		// contents (a prefix sorts first).
		if (a.rel == checkpoint.ManifestFile) != (b.rel == checkpoint.ManifestFile) {
			if a.rel == checkpoint.ManifestFile {
				return -1
			}
			return 1
		}
		return cmp.Compare(a.rel, b.rel)
	})

	a := &Archive{dir: dir, entries: entries}
	// The stream's length: each entry's header blocks (measured by encoding the header, as
	// WriteTo will), its content padded to whole blocks, and the two-block end marker.
	for _, e := range entries {
		var c countingWriter
		if err := tar.NewWriter(&c).WriteHeader(e.header()); err != nil {
			return nil, fmt.Errorf("archive %s: %s: %w", dir, e.rel, err)
		}
		a.size += c.n + roundUp(e.size, blockSize)
	}
	a.size += 2 * blockSize
	return a, nil
}

// Size returns the exact length of the stream WriteTo writes, in bytes (tar headers, contents,
// padding and end marker).
func (a *Archive) Size() int64 { return a.size }

// WriteTo writes the checkpoint as a tar stream to w and returns the number of bytes written,
// which is Size on success. It reads each file through a 1 MiB buffer.
//
// Errors: ErrChanged (wrapped, naming the file) when a file was replaced or changed size since
// New; the *fs.PathError of a failed open or read; w's write error (wrapped).
func (a *Archive) WriteTo(w io.Writer) (int64, error) {
	cw := &countingWriter{w: w}
	err := a.write(cw)
	if err != nil {
		return cw.n, fmt.Errorf("archive %s: %w", a.dir, err)
	}
	return cw.n, nil
}

func (a *Archive) write(w io.Writer) error {
	root, err := os.OpenRoot(a.dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tw := tar.NewWriter(w)
	buf := make([]byte, copyBufferSize)
	for _, e := range a.entries {
		if e.dir {
			if err := tw.WriteHeader(e.header()); err != nil {
				return err
			}
			continue
		}
		if err := writeFile(root, tw, e, buf); err != nil {
			return err
		}
	}
	return tw.Close()
}

// writeFile writes one regular file's header and content.
func writeFile(root *os.Root, tw *tar.Writer, e entry, buf []byte) error {
	f, err := root.Open(e.rel)
	if err != nil {
		return err
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return err
	}
	if !info.Mode().IsRegular() || info.Size() != e.size {
		return fmt.Errorf("%s: %w: listed as a %d-byte regular file, now a %d-byte %s",
			e.rel, ErrChanged, e.size, info.Size(), fsutil.TypeName(info.Mode()))
	}
	if err := tw.WriteHeader(e.header()); err != nil {
		return err
	}
	// WriterOnly and ReaderOnly keep io.CopyBuffer on buf instead of tar's and os's 32 KiB ones.
	n, err := io.CopyBuffer(fsutil.WriterOnly{W: tw}, fsutil.ReaderOnly{R: io.LimitReader(f, e.size)}, buf)
	if err != nil {
		return fmt.Errorf("%s: %w", e.rel, err)
	}
	if n != e.size {
		return fmt.Errorf("%s: %w: shrank from %d to %d bytes while being read", e.rel, ErrChanged, e.size, n)
	}
	return nil
}

// Write writes the checkpoint directory dir to w as a tar stream: New(dir) then WriteTo(w).
// See the package documentation for the stream's form.
//
// Errors: those of New and WriteTo.
func Write(w io.Writer, dir string) error {
	a, err := New(dir)
	if err != nil {
		return err
	}
	_, err = a.WriteTo(w)
	return err
}

// header is the tar header of e.
func (e entry) header() *tar.Header {
	h := &tar.Header{Name: e.name, Mode: e.mode, ModTime: epoch, Typeflag: tar.TypeReg, Size: e.size}
	if e.dir {
		h.Typeflag, h.Size = tar.TypeDir, 0
	}
	return h
}

const blockSize = 512

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

// countingWriter counts the bytes written through it; with a nil w it discards them.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	if c.w == nil {
		c.n += int64(len(p))
		return len(p), nil
	}
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
