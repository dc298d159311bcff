package checkpoint

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/berth-dev/berth/oci/internal/fsutil"
)

// DigestAlgorithm is the prefix of every file digest in a berth manifest: a File's Digest is
// DigestAlgorithm followed by the lowercase hex of the SHA-256 of the file's content. A copy-mode
// PageStream's digest names its own algorithm (pagedigest.go).
const DigestAlgorithm = "sha256:"

// ErrUnsupportedFile is returned (wrapped, with the path and the file's type) for anything in a
// checkpoint directory that is neither a regular file nor a directory: symlinks, devices, FIFOs
// and sockets. A checkpoint holds only regular files, so that it can be digested, archived and
// moved without following links or opening devices.
var ErrUnsupportedFile = errors.New("not a regular file or directory")

const (
	// hashBufferSize is the read buffer of one hashing worker, in bytes. Large reads keep the
	// number of syscalls per GiB small; SHA-256 itself then sets the pace.
	hashBufferSize = 1 << 20
	// maxHashWorkers caps the hashing workers (and their buffers) on large machines: at about
	// 2 GB/s per core with SHA-NI, 8 workers outrun any local disk, and the shim stays small.
	maxHashWorkers = 8
)

// DigestDir digests every regular file under dir except the top-level berth manifest
// (ManifestFile) and its signature (SignatureFile), as the Files of a Manifest.
//
// It returns the files sorted by Path (relative to dir, slash-separated), each with its size in
// bytes and its "sha256:<hex>" digest, and the sum of their sizes in bytes (the manifest's
// ImageSize). An empty directory yields an empty, non-nil slice. Files are hashed concurrently by
// up to min(GOMAXPROCS, 8) workers, largest first, each streaming through a 1 MiB buffer (one
// large file is hashed by one worker: SHA-256 does not split).
//
// Errors: ErrUnsupportedFile (wrapped, naming the path) for a symlink, device, FIFO or socket
// anywhere under dir (a top-level berth.json that is not a regular file included); the *fs.PathError
// of any directory read, open or read that fails. dir itself may be a symlink to a directory.
func DigestDir(dir string) ([]File, int64, error) {
	return DigestDirKnown(dir, nil)
}

// DigestDirKnown is DigestDir that takes the digest of a file from known (keyed by its path
// relative to dir) instead of reading it, when the file's size is the known size: for a
// directory that embeds files whose digests were just computed (the shim's manifest of the
// CRIU images inside a berth checkpoint). Errors are DigestDir's.
func DigestDirKnown(dir string, known map[string]File) ([]File, int64, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, 0, fmt.Errorf("digest: %w", err)
	}
	defer root.Close()

	entries, err := walkFiles(root)
	if err != nil {
		return nil, 0, fmt.Errorf("digest %s: %w", dir, err)
	}
	results := make([]hashResult, len(entries))
	var toHash []fileEntry
	var idx []int
	for i, e := range entries {
		if k, ok := known[e.path]; ok && k.Size == e.size && k.Digest != "" {
			results[i] = hashResult{size: e.size, digest: k.Digest}
			continue
		}
		toHash = append(toHash, e)
		idx = append(idx, i)
	}
	for k, r := range hashFiles(root, toHash, true) {
		results[idx[k]] = r
	}
	files := make([]File, len(entries))
	var total int64
	for i, r := range results {
		if r.err != nil {
			return nil, 0, fmt.Errorf("digest %s: %w", dir, r.err)
		}
		files[i] = File{Path: entries[i].path, Size: r.size, Digest: r.digest}
		total += r.size
	}
	return files, total, nil
}

// fileEntry is a regular file found by walkFiles.
type fileEntry struct {
	// path is relative to the walked root, slash-separated.
	path string
	// size is the size lstat reported, in bytes.
	size int64
}

// walkFiles lists the regular files under root, sorted by path, except the top-level berth.json
// and berth.sig when they are regular files. It fails on anything that is neither a regular file nor a directory.
func walkFiles(root *os.Root) ([]fileEntry, error) {
	var out []fileEntry
	err := fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		t := d.Type()
		switch {
		case t.IsDir():
			return nil
		case t.IsRegular():
			if p == ManifestFile || p == SignatureFile {
				return nil
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			if !info.Mode().IsRegular() { // replaced since the directory was read
				return fmt.Errorf("%s: %w (%s)", p, ErrUnsupportedFile, fsutil.TypeName(info.Mode()))
			}
			out = append(out, fileEntry{path: p, size: info.Size()})
			return nil
		default:
			return fmt.Errorf("%s: %w (%s)", p, ErrUnsupportedFile, fsutil.TypeName(t))
		}
	})
	if err != nil {
		return nil, err
	}
	// fs.WalkDir's order is per directory; a byte-wise sort of the whole path is the manifest's.
	slices.SortFunc(out, func(a, b fileEntry) int { return cmp.Compare(a.path, b.path) })
	return out, nil
}

// hashResult is the outcome of hashing one file.
type hashResult struct {
	// size is the number of bytes read (the file's size at the time), in bytes.
	size int64
	// digest is "sha256:<hex>".
	digest string
	err    error
}

// hashFiles hashes entries concurrently (up to min(GOMAXPROCS, maxHashWorkers) workers, largest
// files first) and
// returns results index-aligned with entries. With stopOnErr, workers stop taking new files after
// the first failure; the results of files never hashed are zero.
func hashFiles(root *os.Root, entries []fileEntry, stopOnErr bool) []hashResult {
	results := make([]hashResult, len(entries))
	if len(entries) == 0 {
		return results
	}
	// Largest first: the long pole starts early, so the workers finish together.
	order := make([]int, len(entries))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(entries[b].size, entries[a].size) })

	workers := min(runtime.GOMAXPROCS(0), maxHashWorkers, len(entries))
	var next atomic.Int64
	var failed atomic.Bool
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			buf := make([]byte, hashBufferSize)
			for {
				k := int(next.Add(1) - 1)
				if k >= len(order) || (stopOnErr && failed.Load()) {
					return
				}
				i := order[k]
				results[i] = hashFile(root, entries[i].path, buf)
				if results[i].err != nil {
					failed.Store(true)
				}
			}
		})
	}
	wg.Wait()
	return results
}

// hashFile streams one regular file through SHA-256.
func hashFile(root *os.Root, path string, buf []byte) hashResult {
	f, err := root.Open(path)
	if err != nil {
		return hashResult{err: err}
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return hashResult{err: err}
	}
	if !info.Mode().IsRegular() {
		return hashResult{err: fmt.Errorf("%s: %w (%s)", path, ErrUnsupportedFile, fsutil.TypeName(info.Mode()))}
	}
	h := sha256.New()
	// ReaderOnly hides (*os.File).WriteTo, which would bring its own 32 KiB buffer.
	n, err := io.CopyBuffer(h, fsutil.ReaderOnly{R: f}, buf)
	if err != nil {
		return hashResult{err: fmt.Errorf("read %s: %w", path, err)}
	}
	return hashResult{size: n, digest: DigestAlgorithm + hex.EncodeToString(h.Sum(nil))}
}
