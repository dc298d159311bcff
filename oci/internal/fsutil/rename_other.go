//go:build !linux

package fsutil

// RenameNoReplace renames oldpath to newpath, failing with an error wrapping fs.ErrExist if
// newpath exists. Off Linux it checks, then renames: a racing creator of an empty directory at
// newpath could be replaced.
func RenameNoReplace(oldpath, newpath string) error { return RenameChecked(oldpath, newpath) }
