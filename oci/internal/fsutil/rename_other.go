//go:build !linux

package transfer

// renameNoReplace renames oldpath to newpath, failing with an error wrapping fs.ErrExist if
// newpath exists. Off Linux it checks, then renames: a racing creator of an empty directory at
// newpath could be replaced.
func renameNoReplace(oldpath, newpath string) error { return renameChecked(oldpath, newpath) }
