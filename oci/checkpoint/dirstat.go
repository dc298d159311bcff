package checkpoint

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"syscall"
)

// ErrChanged: a checkpoint directory is not what it was when it was verified (a file was added,
// removed, replaced, written, truncated or had its mode changed).
var ErrChanged = errors.New("checkpoint changed since it was verified")

// DirStat is what a checkpoint directory holds as the kernel reports it: for every entry below
// it (files, directories and anything else, berth.json and berth.sig included), its path, type,
// size, inode and change time. A user cannot set a change time: any write, truncate, chmod or
// replacement of a file changes it, so two equal DirStats of one directory mean that nothing in
// it changed in between (directories are compared by inode and entries: renaming one moves its
// change time). Take one before and one after verifying a checkpoint, and again before
// using it, to use exactly the bytes that were verified.
type DirStat struct {
	entries []statEntry
}

type statEntry struct {
	path    string
	mode    fs.FileMode // type bits and permissions
	size    int64
	ino     uint64
	ctimeNs int64
}

// StatDir returns the DirStat of dir, walking it without following symbolic links (a link is
// recorded as a link, not followed).
func StatDir(dir string) (DirStat, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return DirStat{}, fmt.Errorf("stat checkpoint: %w", err)
	}
	defer root.Close()
	var out []statEntry
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("%s: no inode", p)
		}
		out = append(out, statEntry{path: p, mode: info.Mode(), size: info.Size(), ino: st.Ino, ctimeNs: st.Ctim.Nano()})
		return nil
	})
	if err != nil {
		return DirStat{}, fmt.Errorf("stat checkpoint %s: %w", dir, err)
	}
	slices.SortFunc(out, func(a, b statEntry) int { return cmp.Compare(a.path, b.path) })
	return DirStat{entries: out}, nil
}

// Len is the number of entries (the directory itself included).
func (d DirStat) Len() int { return len(d.entries) }

// Same returns nil when now shows the same entries as d, else an error wrapping ErrChanged that
// names the first entry that differs and how.
func (d DirStat) Same(now DirStat) error {
	i, j := 0, 0
	for i < len(d.entries) || j < len(now.entries) {
		switch {
		case j == len(now.entries) || (i < len(d.entries) && d.entries[i].path < now.entries[j].path):
			return fmt.Errorf("%s: removed: %w", d.entries[i].path, ErrChanged)
		case i == len(d.entries) || now.entries[j].path < d.entries[i].path:
			return fmt.Errorf("%s: added: %w", now.entries[j].path, ErrChanged)
		}
		a, b := d.entries[i], now.entries[j]
		switch {
		case a.ino != b.ino || a.mode.Type() != b.mode.Type():
			return fmt.Errorf("%s: replaced (inode %d, now %d): %w", a.path, a.ino, b.ino, ErrChanged)
		case a.size != b.size:
			return fmt.Errorf("%s: size %d, now %d: %w", a.path, a.size, b.size, ErrChanged)
		case !a.mode.IsDir() && (a.ctimeNs != b.ctimeNs || a.mode != b.mode):
			// a directory's own change time moves when it is renamed; its entries are compared
			return fmt.Errorf("%s: written or its mode changed (ctime): %w", a.path, ErrChanged)
		}
		i++
		j++
	}
	return nil
}
