package checkpoint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// StampDir is the directory inside a checkpoint root where a receiver records the checkpoints it
// has verified (one JSON stamp per checkpoint name). Names starting with "." are never
// checkpoints (transfer.ValidName), so it cannot collide with one.
const StampDir = ".verified"

// stamp records, for a checkpoint verified against its manifest, the manifest's digest and the
// identity of every file as the kernel reports it (size, inode, change time). Change time cannot
// be set by a user: any write, truncate, chmod or replacement of a file changes it.
//
// Nothing but the file system's permissions protects a stamp: no key can, since the receiver that
// writes it would have to hold that key. Whoever can write the checkpoint root (root on the node,
// uid 0 in the node agent) can change a checkpoint's files and write a stamp that matches them, so
// write access to the checkpoint root must be granted only where the node's key would be
// (contrib/TRUST.md).
//
// Boot is the kernel's boot ID when the stamp was written: a stamp of an earlier boot never
// matches, so after a crash or reboot every file is read again (a receiver that does not fsync,
// transfer.Receiver.NoSync, may leave files whose metadata survived a crash but not their data).
type stamp struct {
	Manifest string      `json:"manifest"`
	Boot     string      `json:"boot,omitempty"`
	Files    []stampFile `json:"files"`
}

// bootIDPath is where Linux reports the boot ID.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// bootID returns this boot's ID, "" where the kernel does not report one.
func bootID() string {
	b, err := os.ReadFile(bootIDPath)
	if err != nil {
		return ""
	}
	return string(bytes.TrimSpace(b))
}

type stampFile struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	Ino     uint64 `json:"ino"`
	CtimeNs int64  `json:"ctimeNs"`
}

func stampPath(dir string) string {
	return filepath.Join(filepath.Dir(dir), StampDir, filepath.Base(dir)+".json")
}

// WriteStamp records that the checkpoint directory dir has just been verified against its
// berth.json (VerifyStamped then skips re-reading files that have not changed since). The stamp
// goes to <parent of dir>/.verified/<name>.json with mode 0600. Errors: reading berth.json or
// a file's metadata, writing the stamp.
func WriteStamp(dir string, m *Manifest) error {
	st, err := currentStamp(dir, m)
	if err != nil {
		return fmt.Errorf("stamp %s: %w", dir, err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	p := stampPath(dir)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("stamp %s: %w", dir, err)
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("stamp %s: %w", dir, err)
	}
	return os.Rename(tmp, p)
}

// VerifyStamped verifies dir against m like Verify, except that when a stamp written by
// WriteStamp matches m's berth.json and every file's size, inode and change time, the files'
// digests are taken as verified without reading them. It reports whether the stamp was used.
// Errors are Verify's.
func VerifyStamped(dir string, m *Manifest) (bool, error) {
	return VerifyHeld(dir, dir, m)
}

// VerifyHeld is VerifyStamped for the checkpoint directory dir reached through held, another
// path of the same directory (such as /proc/self/fd/N of dir held open, so that a directory
// swapped in at dir's path meanwhile is not the one verified): the stamp is the one WriteStamp
// wrote for dir, and every file is stat'ed and read through held.
func VerifyHeld(held, dir string, m *Manifest) (bool, error) {
	if b, err := os.ReadFile(stampPath(dir)); err == nil {
		var old stamp
		if json.Unmarshal(b, &old) == nil {
			if cur, err := currentStamp(held, m); err == nil && equalStamps(old, cur) {
				known := make(map[string]string, len(m.Files))
				for _, f := range m.Files {
					known[f.Path] = f.Digest
				}
				return true, verifyPages(held, m, known, stampedPages(cur, m))
			}
		}
	}
	return false, Verify(held, m)
}

func currentStamp(dir string, m *Manifest) (stamp, error) {
	raw, err := ReadManifestBytes(dir)
	if err != nil {
		return stamp{}, err
	}
	sum := sha256.Sum256(raw)
	st := stamp{Manifest: DigestAlgorithm + hex.EncodeToString(sum[:]), Boot: bootID()}
	for _, f := range m.Files {
		if !ValidFilePath(f.Path) {
			return stamp{}, fmt.Errorf("%s: %w", f.Path, ErrInvalidManifest)
		}
		fi, err := os.Lstat(filepath.Join(dir, filepath.FromSlash(f.Path)))
		if err != nil {
			return stamp{}, err
		}
		sys, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || !fi.Mode().IsRegular() {
			return stamp{}, fmt.Errorf("%s: %w", f.Path, fs.ErrInvalid)
		}
		st.Files = append(st.Files, stampFile{Path: f.Path, Size: fi.Size(), Ino: sys.Ino, CtimeNs: sys.Ctim.Nano()})
	}
	if m.PageStream != nil {
		pages, err := pageStampFiles(dir)
		if err != nil {
			return stamp{}, err
		}
		st.Files = append(st.Files, pages...)
	}
	return st, nil
}

func equalStamps(a, b stamp) bool {
	if a.Manifest != b.Manifest || a.Boot != b.Boot || len(a.Files) != len(b.Files) {
		return false
	}
	for i := range a.Files {
		if a.Files[i] != b.Files[i] {
			return false
		}
	}
	return true
}

// RemoveStamp removes dir's stamp, if any.
func RemoveStamp(dir string) error {
	if err := os.Remove(stampPath(dir)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}
