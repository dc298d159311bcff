package archive

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"

	"github.com/berth-dev/berth/oci/internal/fsutil"
)

// Default limits, used for every Limits field left zero.
const (
	// DefaultMaxFileBytes is the default largest regular file, in bytes (256 GiB: a CRIU pages
	// image holds a process's whole memory).
	DefaultMaxFileBytes int64 = 256 << 30
	// DefaultMaxTotalBytes is the default largest sum of all regular files, in bytes (1 TiB).
	DefaultMaxTotalBytes int64 = 1 << 40
	// DefaultMaxEntries is the default largest number of tar entries (files, directories and
	// skipped metadata entries).
	DefaultMaxEntries = 1 << 17
)

// Limits bound what Extract accepts. A zero field means the corresponding Default; there is no
// way to ask for "unlimited".
type Limits struct {
	// MaxFileBytes is the largest size of one regular file, in bytes.
	MaxFileBytes int64
	// MaxTotalBytes is the largest sum of the sizes of all regular files, in bytes (tar headers
	// and padding not counted).
	MaxTotalBytes int64
	// MaxEntries is the largest number of tar entries of any kind.
	MaxEntries int
}

// WithDefaults returns l with every zero (or negative) field replaced by its Default.
func (l Limits) WithDefaults() Limits {
	if l.MaxFileBytes <= 0 {
		l.MaxFileBytes = DefaultMaxFileBytes
	}
	if l.MaxTotalBytes <= 0 {
		l.MaxTotalBytes = DefaultMaxTotalBytes
	}
	if l.MaxEntries <= 0 {
		l.MaxEntries = DefaultMaxEntries
	}
	return l
}

// Extraction refusals. Extract wraps them as `entry "<name>": <sentinel>: <details>`, quoting the
// entry's name as the archive spells it.
var (
	// ErrUnsafePath: an entry name that is absolute, contains a ".." (or empty, or ".") element
	// after an optional leading "./", or is otherwise not a clean relative path.
	ErrUnsafePath = errors.New("unsafe entry name")
	// ErrLink: a symbolic or hard link entry. Checkpoints hold regular files only.
	ErrLink = errors.New("links are not allowed")
	// ErrSpecialFile: a device node, FIFO, or any other entry type than regular file and
	// directory (including old GNU sparse entries).
	ErrSpecialFile = errors.New("special files are not allowed")
	// ErrFileTooLarge: a regular file over Limits.MaxFileBytes.
	ErrFileTooLarge = errors.New("file exceeds the size limit")
	// ErrTotalTooLarge: the regular files add up to more than Limits.MaxTotalBytes.
	ErrTotalTooLarge = errors.New("archive exceeds the total size limit")
	// ErrTooManyEntries: more than Limits.MaxEntries entries.
	ErrTooManyEntries = errors.New("archive has too many entries")
	// ErrDuplicateEntry: a second entry for the same path (two files, or a file and a
	// directory); a repeated directory entry is accepted.
	ErrDuplicateEntry = errors.New("duplicate entry")
)

// Extract reads a tar stream from r and recreates it under dest, which must not exist: Extract
// creates it (mode 0700; its parent must exist) and, on any error, removes it with everything
// in it, so a failed extraction leaves nothing behind. Requiring a fresh dest makes that cleanup
// exact and keeps two extractions from sharing a directory.
//
// Files are created with mode 0600 and directories with 0700, whatever the archive says:
// checkpoints hold process memory, secrets included, and are for root only. Owners,
// modification times and modes in the archive are ignored. Parent directories missing from the
// archive are created. All file operations go through an os.Root on dest, so nothing can be
// written outside it. A leading "./" on names is accepted (and a "./" entry skipped), as
// `tar -C dir .` writes them; PAX global headers are skipped.
//
// Every check on an entry (count, name, type, size) happens before anything is written for it.
// Extract reads up to and including the end-of-archive marker, and no further. A stream that
// stops exactly between two entries cannot be told from a complete one: verify the result
// (checkpoint.Verify) or compare the byte count with the sender's.
//
// Errors: the *fs.PathError of creating dest (fs.ErrExist when it exists); ErrUnsafePath,
// ErrLink, ErrSpecialFile, ErrFileTooLarge, ErrTotalTooLarge, ErrTooManyEntries,
// ErrDuplicateEntry, wrapped with the entry's name; archive/tar's errors (tar.ErrHeader,
// io.ErrUnexpectedEOF for a cut stream) and r's read errors; write errors under dest. All are
// wrapped with dest.
func Extract(r io.Reader, dest string, lim Limits) (retErr error) {
	return extractTo(r, dest, lim, nil, Hooks{})
}

// Digests maps an extracted file's slash-separated path to "sha256:<hex>" of its content.
type Digests map[string]string

// ExtractDigests is Extract that also returns the sha256 of every regular file it wrote,
// computed while writing: a caller verifying a checkpoint against its manifest
// (checkpoint.VerifyDigests) need not read the files back. Errors are Extract's.
func ExtractDigests(r io.Reader, dest string, lim Limits) (Digests, error) {
	return ExtractDigestsThen(r, dest, lim, Hooks{})
}

// Entry is a tar entry as ExtractDigestsThen's Hooks.Before sees it, before anything of it is
// written: its cleaned slash-separated path, whether it is a directory, and its size in bytes
// (0 for a directory).
type Entry struct {
	Name string
	Dir  bool
	Size int64
}

// Hooks are the calls ExtractDigestsThen makes while it extracts; a nil one is not called.
// Before gets each regular file and directory before it is written; After gets each regular
// file's path once it is written, before the next entry is read. An error of either ends the
// extraction with it (wrapped with dest), dest removed.
type Hooks struct {
	Before func(Entry) error
	After  func(name string) error
}

// ExtractDigestsThen is ExtractDigests with hooks h: a receiver can refuse a stream by its first
// entries' names and sizes, and check what the first files say (a signature), before the rest
// of the stream reaches the disk.
func ExtractDigestsThen(r io.Reader, dest string, lim Limits, h Hooks) (Digests, error) {
	d := Digests{}
	if err := extractTo(r, dest, lim, d, h); err != nil {
		return nil, err
	}
	return d, nil
}

func extractTo(r io.Reader, dest string, lim Limits, digests Digests, h Hooks) (retErr error) {
	lim = lim.WithDefaults()
	if err := os.Mkdir(dest, 0o700); err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	defer func() {
		if retErr != nil {
			if err := os.RemoveAll(dest); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("extract: clean up: %w", err))
			}
		}
	}()
	root, err := os.OpenRoot(dest)
	if err != nil {
		return fmt.Errorf("extract: %w", err)
	}
	defer root.Close()
	if err := extract(r, root, lim, digests, h); err != nil {
		return fmt.Errorf("extract to %s: %w", dest, err)
	}
	return nil
}

func extract(r io.Reader, root *os.Root, lim Limits, digests Digests, h Hooks) error {
	tr := tar.NewReader(r)
	buf := make([]byte, copyBufferSize)
	var entries int
	var total int64
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil && !(hdr != nil && errors.Is(err, tar.ErrInsecurePath)) { // names are checked below
			return err
		}
		entries++
		if entries > lim.MaxEntries {
			return fmt.Errorf("entry %q: %w: more than %d", hdr.Name, ErrTooManyEntries, lim.MaxEntries)
		}
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeDir:
		case tar.TypeXGlobalHeader:
			continue
		case tar.TypeSymlink, tar.TypeLink:
			return fmt.Errorf("entry %q: %w: %s to %q", hdr.Name, ErrLink, entryTypeName(hdr.Typeflag), hdr.Linkname)
		default:
			return fmt.Errorf("entry %q: %w: %s", hdr.Name, ErrSpecialFile, entryTypeName(hdr.Typeflag))
		}
		name, skip, err := cleanName(hdr.Name, hdr.Typeflag == tar.TypeDir)
		if err != nil {
			return err
		}
		if skip {
			continue
		}

		if h.Before != nil {
			e := Entry{Name: name, Dir: hdr.Typeflag == tar.TypeDir}
			if !e.Dir {
				e.Size = hdr.Size
			}
			if err := h.Before(e); err != nil {
				return err
			}
		}
		if hdr.Typeflag == tar.TypeDir {
			if err := makeDir(root, name); err != nil {
				return fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
			continue
		}
		if hdr.Size > lim.MaxFileBytes {
			return fmt.Errorf("entry %q: %w: %d bytes, limit %d", hdr.Name, ErrFileTooLarge, hdr.Size, lim.MaxFileBytes)
		}
		if hdr.Size > lim.MaxTotalBytes-total {
			return fmt.Errorf("entry %q: %w: %d bytes after %d, limit %d", hdr.Name, ErrTotalTooLarge, hdr.Size, total, lim.MaxTotalBytes)
		}
		total += hdr.Size
		if err := writeEntry(root, name, tr, hdr.Size, buf, digests); err != nil {
			return fmt.Errorf("entry %q: %w", hdr.Name, err)
		}
		if h.After != nil {
			if err := h.After(name); err != nil {
				return err
			}
		}
	}
}

// cleanName turns a tar entry name into a path relative to the destination, or reports that the
// entry is the destination itself ("./"), to be skipped.
func cleanName(raw string, isDir bool) (name string, skip bool, err error) {
	if isDir && (raw == "./" || raw == ".") {
		return "", true, nil // the destination itself, as `tar -C dir .` writes it
	}
	name = strings.TrimPrefix(raw, "./")
	if isDir {
		name = strings.TrimSuffix(name, "/")
	}
	if name == "." || !fs.ValidPath(name) {
		return "", false, fmt.Errorf("entry %q: %w", raw, ErrUnsafePath)
	}
	return name, false, nil
}

// makeDir creates the directory name (and its parents) with mode 0700; an existing directory is
// fine.
func makeDir(root *os.Root, name string) error {
	err := root.Mkdir(name, 0o700)
	if errors.Is(err, fs.ErrNotExist) { // parent not in the archive (yet)
		if err = root.MkdirAll(path.Dir(name), 0o700); err == nil {
			err = root.Mkdir(name, 0o700)
		}
	}
	if errors.Is(err, fs.ErrExist) {
		if info, serr := root.Lstat(name); serr == nil && info.IsDir() {
			return nil
		}
		return fmt.Errorf("%w: a file of that name exists", ErrDuplicateEntry)
	}
	return err
}

// writeEntry creates the file name with mode 0600 and copies size bytes into it from r.
func writeEntry(root *os.Root, name string, r io.Reader, size int64, buf []byte, digests Digests) (retErr error) {
	if dir := path.Dir(name); dir != "." {
		if err := root.MkdirAll(dir, 0o700); err != nil {
			return err
		}
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: %s exists", ErrDuplicateEntry, name)
	}
	if err != nil {
		return err
	}
	defer func() {
		if err := f.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()
	var w io.Writer = fsutil.WriterOnly{W: f}
	var h hash.Hash
	if digests != nil {
		h = sha256.New()
		w = io.MultiWriter(w, h)
	}
	n, err := copyFull(w, r, size, buf)
	if err != nil {
		return err
	}
	if n != size { // archive/tar reports short content itself; this is a backstop
		return fmt.Errorf("%w: %d of %d bytes", io.ErrUnexpectedEOF, n, size)
	}
	if h != nil {
		digests[name] = "sha256:" + hex.EncodeToString(h.Sum(nil))
	}
	return nil
}

// copyFull copies up to size bytes from r to w, filling buf before each write: a TLS
// connection's reads return one record (16 KiB) at a time, and writing (and hashing) each
// on its own costs a write system call per record. It returns the bytes written; a short
// stream is no error here (the caller compares with size), r's other errors and w's are.
func copyFull(w io.Writer, r io.Reader, size int64, buf []byte) (int64, error) {
	var n int64
	for n < size {
		chunk := buf[:min(int64(len(buf)), size-n)]
		m, rerr := io.ReadFull(r, chunk)
		if m > 0 {
			wm, werr := w.Write(chunk[:m])
			n += int64(wm)
			if werr != nil {
				return n, werr
			}
			if wm != m {
				return n, io.ErrShortWrite
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
	return n, nil
}

// entryTypeName names a tar entry type for error messages.
func entryTypeName(t byte) string {
	switch t {
	case tar.TypeSymlink:
		return "symlink"
	case tar.TypeLink:
		return "hard link"
	case tar.TypeChar:
		return "character device"
	case tar.TypeBlock:
		return "block device"
	case tar.TypeFifo:
		return "fifo"
	case tar.TypeCont:
		return "contiguous file"
	case tar.TypeGNUSparse:
		return "GNU sparse file"
	default:
		return fmt.Sprintf("entry type %q", t)
	}
}
