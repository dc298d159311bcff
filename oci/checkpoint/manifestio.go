package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-dev/berth/oci/internal/fsutil"
)

// MaxManifestBytes is the largest berth.json ReadManifest, ReadManifestBytes and ParseManifest
// accept, and WriteManifest writes, in bytes. A manifest entry takes about 150 bytes, so this
// allows about 100 000 files.
const MaxManifestBytes = 16 << 20

var (
	// ErrInvalidManifest is returned (wrapped, with the reason) for a manifest that is not valid
	// JSON of the Manifest shape or breaks its rules: a File path that is absolute, unclean,
	// contains "..", or names the top-level berth.json; a negative size; a digest that is not
	// "sha256:" and 64 lowercase hex digits; Files not sorted by Path or with duplicates; an
	// ImageSize other than the sum of the sizes; a pageStream whose digest is not a known page
	// digest algorithm (PageDigestAlgorithms, then also ErrPageDigestAlgorithm), ":" and 64
	// lowercase hex digits, or whose size is negative; a berth.json over MaxManifestBytes.
	ErrInvalidManifest = errors.New("invalid berth manifest")
	// ErrUnsupportedVersion is returned (wrapped, naming the version) for a manifest whose
	// Version is not ManifestVersion: written by a newer berth, or missing.
	ErrUnsupportedVersion = errors.New("unsupported berth manifest version")
)

// WriteManifest writes m as dir/berth.json (ManifestFile), atomically: it writes a temporary file
// in dir with mode 0600, fsyncs it, renames it over berth.json and fsyncs dir, so a reader sees
// either the previous berth.json or the complete new one.
//
// It completes m in place first: a zero Version becomes ManifestVersion; a nil Files is filled by
// DigestDir(dir) together with ImageSize (the sum of the file sizes, in bytes); a non-nil Files
// with a zero ImageSize gets ImageSize computed from it. Files must not change between
// WriteManifest and the readers' Verify.
//
// Errors: ErrUnsupportedVersion if m.Version is neither 0 nor ManifestVersion; ErrInvalidManifest
// (wrapped) if m breaks the manifest's rules or encodes to more than MaxManifestBytes; DigestDir's
// errors; the *fs.PathError of a failed create, write, sync or rename (no temporary file is left
// behind then).
func WriteManifest(dir string, m *Manifest) (retErr error) {
	path := filepath.Join(dir, ManifestFile)
	if m == nil {
		return fmt.Errorf("write %s: %w: nil manifest", path, ErrInvalidManifest)
	}
	switch m.Version {
	case 0:
		m.Version = ManifestVersion
	case ManifestVersion:
	default:
		return fmt.Errorf("write %s: %w: version %d (this berth writes version %d)",
			path, ErrUnsupportedVersion, m.Version, ManifestVersion)
	}
	if m.Files == nil {
		files, total, err := DigestDir(dir)
		if err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		m.Files, m.ImageSize = files, total
	} else if m.ImageSize == 0 {
		for _, f := range m.Files {
			m.ImageSize += f.Size
		}
	}
	if err := validateManifest(m); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	data = append(data, '\n')
	if len(data) > MaxManifestBytes {
		return fmt.Errorf("write %s: %w: %d bytes, more than %d", path, ErrInvalidManifest, len(data), MaxManifestBytes)
	}

	tmp, err := os.CreateTemp(dir, "."+ManifestFile+"-*.tmp") // mode 0600
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmpName := tmp.Name()
	defer func() {
		if retErr != nil {
			_ = tmp.Close() // may already be closed
			_ = os.Remove(tmpName)
		}
	}()
	if _, err := tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmpName, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := fsutil.SyncDir(dir); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// ReadManifest reads and parses dir/berth.json (see ReadManifestBytes and ParseManifest). It does
// not look at the other files; Verify does.
//
// Errors: those of ReadManifestBytes and ParseManifest (ErrUnsupportedVersion,
// ErrInvalidManifest, ErrUnsupportedFile, *fs.PathError), wrapped with the path.
func ReadManifest(dir string) (*Manifest, error) {
	data, err := ReadManifestBytes(dir)
	if err != nil {
		return nil, err
	}
	m, err := ParseManifest(data)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", filepath.Join(dir, ManifestFile), err)
	}
	return m, nil
}

// ReadManifestBytes returns the raw content of dir/berth.json, which must be a regular file (not
// a symlink) of at most MaxManifestBytes bytes. Use it where the exact bytes matter (sending a
// manifest inline); ReadManifest parses them.
//
// Errors: an *fs.PathError wrapping fs.ErrNotExist when there is no berth.json; ErrUnsupportedFile
// when it is a symlink or another non-regular file; ErrInvalidManifest when it is larger than
// MaxManifestBytes; the *fs.PathError of a failed read. All wrapped with the path.
func ReadManifestBytes(dir string) ([]byte, error) {
	path := filepath.Join(dir, ManifestFile)
	info, err := os.Lstat(path)
	if err != nil {
		return nil, fmt.Errorf("read manifest: %w", err)
	}
	if !info.Mode().IsRegular() {
		return nil, fmt.Errorf("read %s: %w (%s)", path, ErrUnsupportedFile, fsutil.TypeName(info.Mode()))
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read manifest: %w", err)
	}
	defer f.Close()
	opened, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("read manifest: %w", err)
	}
	if !os.SameFile(info, opened) { // swapped for something else between Lstat and Open
		return nil, fmt.Errorf("read %s: %w (replaced while opening)", path, ErrUnsupportedFile)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxManifestBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(data) > MaxManifestBytes {
		return nil, fmt.Errorf("read %s: %w: larger than %d bytes", path, ErrInvalidManifest, MaxManifestBytes)
	}
	return data, nil
}

// ParseManifest decodes a berth manifest and checks its rules (see ErrInvalidManifest).
//
// Decoding policy: the version is checked first, on its own, so a manifest of another version is
// reported as ErrUnsupportedVersion rather than as whatever shape error it would cause. Within
// ManifestVersion, unknown fields are ignored: a writer may add optional, informational fields
// without bumping the version, and an older reader must still accept them; a change that alters
// the meaning of existing fields, or that a reader must understand to restore correctly, bumps
// ManifestVersion, which older readers reject. Everything else is strict: a value of the wrong
// JSON type, trailing data after the object, or any rule broken is an error. The File list is
// the security-relevant part (it drives Verify), and it is fully checked.
//
// Errors: ErrUnsupportedVersion (wrapped, naming the version found and the one supported) when
// version is missing or not ManifestVersion; ErrInvalidManifest (wrapped, with the reason)
// otherwise.
func ParseManifest(data []byte) (*Manifest, error) {
	if len(data) > MaxManifestBytes {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidManifest, len(data), MaxManifestBytes)
	}
	var v struct {
		Version *int `json:"version"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidManifest, err)
	}
	if v.Version == nil {
		return nil, fmt.Errorf("%w: no version (this berth reads version %d)", ErrUnsupportedVersion, ManifestVersion)
	}
	if *v.Version != ManifestVersion {
		return nil, fmt.Errorf("%w: version %d (this berth reads version %d)", ErrUnsupportedVersion, *v.Version, ManifestVersion)
	}
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil { // rejects trailing data and type mismatches
		return nil, fmt.Errorf("%w: %w", ErrInvalidManifest, err)
	}
	if m.Files == nil {
		m.Files = []File{}
	}
	if err := validateManifest(&m); err != nil {
		return nil, err
	}
	return &m, nil
}

// validateManifest checks the rules a manifest's file list must follow; see ErrInvalidManifest.
func validateManifest(m *Manifest) error {
	var sum int64
	for i, f := range m.Files {
		if !ValidFilePath(f.Path) {
			return fmt.Errorf("%w: files[%d]: path %q is not a clean relative path inside the checkpoint", ErrInvalidManifest, i, f.Path)
		}
		if i > 0 && m.Files[i-1].Path >= f.Path {
			return fmt.Errorf("%w: files[%d]: path %q is not sorted after %q or is a duplicate", ErrInvalidManifest, i, f.Path, m.Files[i-1].Path)
		}
		if f.Size < 0 {
			return fmt.Errorf("%w: files[%d] %s: negative size %d", ErrInvalidManifest, i, f.Path, f.Size)
		}
		if !validDigest(f.Digest) {
			return fmt.Errorf("%w: files[%d] %s: digest %q is not sha256:<64 lowercase hex>", ErrInvalidManifest, i, f.Path, f.Digest)
		}
		if sum > math.MaxInt64-f.Size {
			return fmt.Errorf("%w: file sizes overflow", ErrInvalidManifest)
		}
		sum += f.Size
	}
	if m.PageStream != nil {
		if _, err := PageDigestAlgorithm(m.PageStream.Digest); err != nil {
			if !errors.Is(err, ErrInvalidManifest) {
				err = fmt.Errorf("%w: %w", ErrInvalidManifest, err)
			}
			return err
		}
		if m.PageStream.Size < 0 {
			return fmt.Errorf("%w: pageStream: negative size %d", ErrInvalidManifest, m.PageStream.Size)
		}
		if id := m.PageStream.ID; id != "" && !ValidStreamID(id) {
			return fmt.Errorf("%w: pageStream: id %q is not 32 lowercase hex digits", ErrInvalidManifest, id)
		}
	}
	if sum != m.ImageSize {
		return fmt.Errorf("%w: imageSize %d bytes, but the files add up to %d bytes", ErrInvalidManifest, m.ImageSize, sum)
	}
	return nil
}

// ValidFilePath reports whether p may be a File.Path: relative, slash-separated, clean (no empty,
// "." or ".." elements, no leading or trailing slash) and not the top-level berth.json.
func ValidFilePath(p string) bool {
	return p != "." && p != ManifestFile && fs.ValidPath(p)
}

// validDigest reports whether d is "sha256:" and 64 lowercase hex digits.
func validDigest(d string) bool {
	hexPart, ok := strings.CutPrefix(d, DigestAlgorithm)
	return ok && lowerHex(hexPart, 64)
}
