package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// dirMarker is the file berth-demo-k8s leaves in a -dir it created, so that a later run may empty it.
const dirMarker = ".berth-demo-k8s"

// prepareDir readies dir for the demo's nodes: a missing or empty directory is created and
// marked as berth-demo-k8s's; one that berth-demo-k8s marked before (a previous run) is emptied. A
// directory that holds anything else is refused, untouched: the demo removes dir when it ends,
// and it must never delete what the user kept there.
func prepareDir(dir string) error {
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("-dir %s: %w", dir, err)
	case len(entries) == 0:
	default:
		if _, err := os.Lstat(filepath.Join(dir, dirMarker)); err != nil {
			return fmt.Errorf("-dir %s is not empty and was not made by berth-demo-k8s (no %s in it): the demo deletes its directory when it ends, so give a new or empty directory", dir, dirMarker)
		}
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, dirMarker), []byte("made by berth-demo-k8s; removed when it ends\n"), 0o644)
}
