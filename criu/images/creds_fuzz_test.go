package images

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// FuzzReadProcesses feeds readProcesses a pstree image and one core image, which it reads for
// every thread the tree lists. The seed corpus (testdata/fuzz/FuzzReadProcesses) holds the
// fixtures' pstree with their main thread's core and with another thread's (no task core),
// and empty files. Whatever the bytes, it must return processes with valid ids or an
// error that wraps ErrBadImage and names a file, without panicking or allocating more than
// the limits allow.
func FuzzReadProcesses(f *testing.F) {
	const maxFuzzThreads = 256
	f.Fuzz(func(t *testing.T, pstree, core []byte) {
		cores := 0
		procs, err := readProcesses(func(name string, limit int64) ([]byte, error) {
			b := core
			if name == pstreeImage {
				b = pstree
			} else if cores++; cores > maxFuzzThreads {
				// The same core for every thread: keep each run cheap (the thread limit
				// itself is TestReadProcessesErrors's).
				return nil, fmt.Errorf("%s: %w: fuzzing reads at most %d cores", name, ErrBadImage, maxFuzzThreads)
			}
			if int64(len(b)) > limit {
				return nil, fmt.Errorf("%s: %w: %d bytes, over the limit of %d", name, ErrBadImage, len(b), limit)
			}
			return b, nil
		})
		if err != nil {
			if !errors.Is(err, ErrBadImage) {
				t.Fatalf("error %v does not wrap ErrBadImage", err)
			}
			if !strings.Contains(err.Error(), ".img") {
				t.Fatalf("error %q names no image file", err)
			}
			return
		}
		if len(procs) > maxThreads {
			t.Fatalf("%d threads, over the limit of %d", len(procs), maxThreads)
		}
		seen := map[int]bool{}
		for _, p := range procs {
			if p.PID <= 0 || p.TID <= 0 || seen[p.TID] {
				t.Fatalf("bad or repeated ids in %+v", p)
			}
			seen[p.TID] = true
		}
	})
}
