package scenario

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// PrepareDir readies dir for a demo's nodes: a missing or empty directory is created and marked
// with the file "."+demo (demo is the command's name, e.g. "berth-demo"); one that the same demo
// marked before (a previous run) is emptied. A directory that holds anything else is refused,
// untouched, with an error naming -dir, dir and the marker: the demo removes dir when it ends,
// and it must never delete what the user kept there. Other errors are the file system's.
func PrepareDir(dir, demo string) error {
	marker := "." + demo
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("-dir %s: %w", dir, err)
	case len(entries) == 0:
	default:
		if _, err := os.Lstat(filepath.Join(dir, marker)); err != nil {
			return fmt.Errorf("-dir %s is not empty and was not made by %s (no %s in it): the demo deletes its directory when it ends, so give a new or empty directory", dir, demo, marker)
		}
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, marker), []byte("made by "+demo+"; removed when it ends\n"), 0o644)
}
