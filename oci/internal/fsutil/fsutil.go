// Package fsutil holds the small file-system helpers berth's checkpoint packages (oci,
// oci/archive, oci/transfer, oci/registry) share: durable directory updates, renames that never
// replace, and buffer-preserving io wrappers.
// Nothing here knows about the checkpoint format.
package fsutil

import (
	"io"
	"io/fs"
	"os"
)

// SyncDir fsyncs the directory dir, making the creation, removal and renaming of its entries
// durable. Errors: the *fs.PathError of the open or the fsync.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	if err := d.Sync(); err != nil {
		_ = d.Close()
		return err
	}
	return d.Close()
}

// ReaderOnly exposes only Read, hiding WriterTo (for example (*os.File).WriteTo), so that
// io.CopyBuffer uses the caller's buffer.
type ReaderOnly struct{ R io.Reader }

// Read reads from R.
func (r ReaderOnly) Read(p []byte) (int, error) { return r.R.Read(p) }

// WriterOnly exposes only Write, hiding ReaderFrom (for example (*os.File).ReadFrom or
// (*tar.Writer).ReadFrom), so that io.CopyBuffer uses the caller's buffer.
type WriterOnly struct{ W io.Writer }

// Write writes to W.
func (w WriterOnly) Write(p []byte) (int, error) { return w.W.Write(p) }

// TypeName names a file type for error messages ("symlink", "named pipe", "regular file", ...).
func TypeName(m fs.FileMode) string {
	switch {
	case m&fs.ModeSymlink != 0:
		return "symlink"
	case m&fs.ModeCharDevice != 0:
		return "character device"
	case m&fs.ModeDevice != 0:
		return "block device"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m.IsDir():
		return "directory"
	case m.IsRegular():
		return "regular file"
	default:
		return "irregular file"
	}
}
