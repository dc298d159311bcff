package transfer

import (
	"io/fs"

	"golang.org/x/sys/unix"
)

// statfsFree returns the bytes that may still be written to the file system holding path:
// statfs(2)'s f_bavail blocks of f_frsize bytes (what an unprivileged writer may use; root may
// use the reserved blocks too, which stay as a further margin).
func statfsFree(path string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, &fs.PathError{Op: "statfs", Path: path, Err: err}
	}
	bs := uint64(st.Frsize)
	if bs == 0 {
		bs = uint64(st.Bsize)
	}
	return st.Bavail * bs, nil
}
