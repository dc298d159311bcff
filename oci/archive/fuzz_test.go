package archive

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// FuzzExtract feeds arbitrary bytes to Extract. Whatever the input, Extract must not panic, and
// either fail leaving nothing behind, or succeed with only 0600 files and 0700 directories, all
// inside dest. Seeds live in testdata/fuzz/FuzzExtract (a valid checkpoint tar, "../", a symlink
// followed by a write through it, an absolute name, a hard link, a long PAX name, a cut stream).
func FuzzExtract(f *testing.F) {
	lim := Limits{MaxFileBytes: 1 << 20, MaxTotalBytes: 4 << 20, MaxEntries: 256}
	f.Fuzz(func(t *testing.T, data []byte) {
		base := t.TempDir()
		dest := filepath.Join(base, "out")
		err := Extract(bytes.NewReader(data), dest, lim)
		left, rerr := os.ReadDir(base)
		if rerr != nil {
			t.Fatal(rerr)
		}
		if err != nil {
			if len(left) != 0 {
				t.Fatalf("Extract failed (%v) but left %v", err, left)
			}
			return
		}
		if len(left) != 1 || left[0].Name() != "out" {
			t.Fatalf("Extract wrote outside dest: %v", left)
		}
		checkModes(t, dest)
	})
}
