package checkpoint

import (
	"errors"
	"fmt"
	"os"
)

// Verification failures. Verify wraps them with the file's path (relative to the checkpoint,
// slash-separated) and both values, for example
//
//	checkpoint/pages-1.img: digest mismatch: manifest sha256:ab... file sha256:cd...
var (
	// ErrDigestMismatch: the file's SHA-256 differs from the manifest's digest.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrMissingFile: the manifest lists a file the directory does not have.
	ErrMissingFile = errors.New("missing file")
	// ErrExtraFile: the directory has a regular file the manifest does not list.
	ErrExtraFile = errors.New("file not in manifest")
	// ErrTruncated: the file is smaller than the manifest's size.
	ErrTruncated = errors.New("file truncated")
	// ErrSizeMismatch: the file is larger than the manifest's size (or changed size while it
	// was read).
	ErrSizeMismatch = errors.New("size mismatch")
)

// Verify checks that dir holds exactly the files m lists, with their sizes (bytes) and digests.
// The top-level berth.json is not part of the check (it is not in m.Files); directories are not
// either, so an empty directory is not an extra file.
//
// Checks that need no reading come first (missing, extra, sizes), so a damaged checkpoint is
// usually reported without hashing it; then every file is hashed, concurrently as in DigestDir.
// When several files fail, the error is about the first in m.Files order (missing files before
// extra files before sizes before digests), so the result does not depend on scheduling.
//
// Errors: ErrInvalidManifest (wrapped) if m itself breaks the manifest's rules (a path with "..",
// unsorted files...), checked before touching dir; ErrMissingFile, ErrExtraFile, ErrTruncated,
// ErrSizeMismatch or ErrDigestMismatch, wrapped as "<path>: <sentinel>: <values>";
// ErrUnsupportedFile (wrapped) for a symlink, device, FIFO or socket under dir; the *fs.PathError
// of a failed directory read, open or read, wrapped with dir.
func Verify(dir string, m *Manifest) error {
	return verify(dir, m, nil)
}

// VerifyDigests is Verify where known (slash-separated path -> "sha256:<hex>") holds digests
// computed while the files were written (archive.ExtractDigests); those files are not read
// again, every other check is the same. Errors are Verify's.
func VerifyDigests(dir string, m *Manifest, known map[string]string) error {
	return verify(dir, m, known)
}

func verify(dir string, m *Manifest, known map[string]string) error {
	return verifyPages(dir, m, known, nil)
}

// verifyPages is verify where pages (slash-separated paths) are page images received from m's
// page stream and recorded by the receiver's stamp: they are neither extra files nor read.
func verifyPages(dir string, m *Manifest, known map[string]string, pages map[string]bool) error {
	if m == nil {
		return fmt.Errorf("verify %s: %w: nil manifest", dir, ErrInvalidManifest)
	}
	if err := validateManifest(m); err != nil {
		return fmt.Errorf("verify %s: %w", dir, err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	defer root.Close()

	entries, err := walkFiles(root)
	if err != nil {
		return fmt.Errorf("verify %s: %w", dir, err)
	}
	onDisk := make(map[string]int64, len(entries))
	for _, e := range entries {
		onDisk[e.path] = e.size
	}
	listed := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		listed[f.Path] = true
		if _, ok := onDisk[f.Path]; !ok {
			return fmt.Errorf("%s: %w (manifest size %d bytes)", f.Path, ErrMissingFile, f.Size)
		}
	}
	if len(pages) > 0 || m.PageStream != nil {
		kept := entries[:0:0]
		for _, e := range entries {
			switch {
			case listed[e.path]:
				kept = append(kept, e)
			case pages[e.path]:
			case m.PageStream != nil && IsPageImage(e.path):
				return fmt.Errorf("%s: %w: %d bytes", e.path, ErrPagesUnverified, e.size)
			default:
				return fmt.Errorf("%s: %w: %d bytes", e.path, ErrExtraFile, e.size)
			}
		}
		entries = kept
	}
	for _, e := range entries {
		if !listed[e.path] {
			return fmt.Errorf("%s: %w: %d bytes", e.path, ErrExtraFile, e.size)
		}
	}
	// Both lists are sorted by path and hold the same paths: entries[i] is m.Files[i].
	for i, f := range m.Files {
		if err := checkSize(f, entries[i].size); err != nil {
			return err
		}
	}
	var toHash []fileEntry
	var idx []int
	results := make([]hashResult, len(entries))
	for i, e := range entries {
		if d, ok := known[e.path]; ok {
			results[i] = hashResult{size: e.size, digest: d}
			continue
		}
		toHash = append(toHash, e)
		idx = append(idx, i)
	}
	for k, r := range hashFiles(root, toHash, false) {
		results[idx[k]] = r
	}
	for i, f := range m.Files {
		r := results[i]
		if r.err != nil {
			return fmt.Errorf("verify %s: %w", dir, r.err)
		}
		if err := checkSize(f, r.size); err != nil {
			return err
		}
		if r.digest != f.Digest {
			return fmt.Errorf("%s: %w: manifest %s file %s", f.Path, ErrDigestMismatch, f.Digest, r.digest)
		}
	}
	return nil
}

// checkSize compares a file's actual size (bytes) with the manifest's.
func checkSize(f File, actual int64) error {
	switch {
	case actual < f.Size:
		return fmt.Errorf("%s: %w: manifest %d bytes, file %d bytes", f.Path, ErrTruncated, f.Size, actual)
	case actual > f.Size:
		return fmt.Errorf("%s: %w: manifest %d bytes, file %d bytes", f.Path, ErrSizeMismatch, f.Size, actual)
	}
	return nil
}
