package checkpoint

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-dev/berth/oci/internal/fsutil"
)

// ArchiveExt is the file name extension of a checkpoint archive (a checkpoint directory written
// by oci/archive as a tar stream). AnnotationRestoreFrom may name such a file.
const ArchiveExt = ".tar"

var (
	// ErrInvalidRef is returned (wrapped, quoting the reference) for a restore-from reference
	// that is empty, contains a NUL byte or a ".." element, names the checkpoint root itself, or
	// names something that is neither a directory nor a regular file ending in ArchiveExt.
	ErrInvalidRef = errors.New("invalid restore-from reference")
	// ErrOutsideRoot is returned (wrapped, with the reference and the path it reaches) for a
	// reference that is not under the checkpoint root, lexically or after resolving symlinks.
	ErrOutsideRoot = errors.New("restore-from reference outside the checkpoint root")
	// ErrInvalidRoot is returned (wrapped) when the checkpoint root is not an absolute path of an
	// existing directory.
	ErrInvalidRoot = errors.New("invalid checkpoint root")
)

// ResolveRestoreFrom resolves ref, the value of AnnotationRestoreFrom, against root, the
// shim's checkpoint root, and returns the checkpoint's real path: absolute, with every symlink
// resolved, strictly inside root's real path. It is a checkpoint directory, or a checkpoint
// archive (a regular file named *.tar) that the caller extracts with oci/archive.Extract.
//
// ref may be relative to root, or absolute and under root (under root as given, or under its
// real path). Rules, in order:
//   - root must be absolute and resolve (symlinks included) to an existing directory;
//   - ref must be non-empty, without NUL bytes, and without any ".." element, even one that
//     would stay inside root ("a/../b" is refused: a reference is a plain path, not a walk);
//   - an absolute ref must lie under root after filepath.Clean;
//   - the path must exist; every symlink on it is resolved (filepath.EvalSymlinks), and the
//     result must still lie strictly inside root's real path, so a symlink in root, or a
//     symlinked parent directory, cannot lead out of it;
//   - the result must be a directory or a regular *.tar file.
//
// The check is only as good as root's permissions: whoever can write under root can swap a
// component after the check. Root must be writable by root only, as a checkpoint holds process
// memory.
//
// Errors: ErrInvalidRoot, ErrInvalidRef, ErrOutsideRoot (wrapped, with the reference); an
// *fs.PathError wrapping fs.ErrNotExist (naming the missing path) when the checkpoint does not
// exist; other *fs.PathError from resolving or stat-ing the path.
func ResolveRestoreFrom(root, ref string) (string, error) {
	if !filepath.IsAbs(root) {
		return "", fmt.Errorf("%w: %q is not an absolute path", ErrInvalidRoot, root)
	}
	root = filepath.Clean(root)
	realRoot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalidRoot, err)
	}
	if info, err := os.Stat(realRoot); err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalidRoot, err)
	} else if !info.IsDir() {
		return "", fmt.Errorf("%w: %s is not a directory", ErrInvalidRoot, root)
	}

	if ref == "" {
		return "", fmt.Errorf("%w: empty", ErrInvalidRef)
	}
	if strings.ContainsRune(ref, 0) {
		return "", fmt.Errorf("%w: %q contains a NUL byte", ErrInvalidRef, ref)
	}
	for _, elem := range strings.FieldsFunc(ref, func(r rune) bool { return r < 0x80 && os.IsPathSeparator(uint8(r)) }) {
		if elem == ".." {
			return "", fmt.Errorf("%w: %q contains a \"..\" element", ErrInvalidRef, ref)
		}
	}

	var candidate string
	if filepath.IsAbs(ref) {
		candidate = filepath.Clean(ref)
		if !within(root, candidate) && !within(realRoot, candidate) && candidate != root && candidate != realRoot {
			return "", fmt.Errorf("%w: %q is not under %s", ErrOutsideRoot, ref, root)
		}
	} else {
		candidate = filepath.Join(root, ref) // no ".." element: stays under root lexically
	}
	if candidate == root || candidate == realRoot {
		return "", fmt.Errorf("%w: %q names the checkpoint root itself", ErrInvalidRef, ref)
	}

	real, err := filepath.EvalSymlinks(candidate)
	if err != nil {
		return "", fmt.Errorf("restore-from %q: %w", ref, err)
	}
	if real == realRoot {
		return "", fmt.Errorf("%w: %q resolves to the checkpoint root itself", ErrInvalidRef, ref)
	}
	if !within(realRoot, real) {
		return "", fmt.Errorf("%w: %q resolves to %s, outside %s", ErrOutsideRoot, ref, real, realRoot)
	}
	info, err := os.Stat(real)
	if err != nil {
		return "", fmt.Errorf("restore-from %q: %w", ref, err)
	}
	if !info.IsDir() && !(info.Mode().IsRegular() && strings.HasSuffix(real, ArchiveExt)) {
		return "", fmt.Errorf("%w: %q is a %s, not a checkpoint directory or %s archive",
			ErrInvalidRef, ref, fsutil.TypeName(info.Mode()), ArchiveExt)
	}
	return real, nil
}

// within reports whether the clean path p lies strictly inside the clean directory dir.
func within(dir, p string) bool {
	prefix := dir
	if !strings.HasSuffix(prefix, string(filepath.Separator)) {
		prefix += string(filepath.Separator)
	}
	return len(p) > len(prefix) && strings.HasPrefix(p, prefix)
}
