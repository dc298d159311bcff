package images

import (
	"fmt"
	"path/filepath"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"

	"github.com/berth-dev/berth/oci/privilege"
)

// SeccompChain is the seccomp filter chain of one thread of a checkpoint, as CRIU stored it
// (seccomp.img) and restores it: the kernel applies every filter and takes the most restrictive
// result.
type SeccompChain struct {
	// PID and TID are the process and thread ids in the checkpoint; Comm its name.
	PID, TID int
	Comm     string
	// Filters are the chain's filters, oldest (installed first) first: each a struct
	// sock_filter array in this machine's byte order (seccompbpf.Parse).
	Filters [][]byte
}

// ReadSeccompChains returns the filter chain of every thread of the CRIU images directory that
// runs in seccomp filter mode (ReadProcesses's threads whose Seccomp is filter: a thread CRIU
// recorded without a filter of its own because its main thread's chain is synchronised,
// SECCOMP_FILTER_FLAG_TSYNC, gets that chain). Errors are ReadProcesses's, and ErrBadImage for a
// chain that points outside seccomp.img, loops, or is missing.
func ReadSeccompChains(imagesDir string) ([]SeccompChain, error) {
	read := func(name string, limit int64) ([]byte, error) {
		return readImageFile(filepath.Join(imagesDir, name), limit)
	}
	procs, err := readProcesses(read)
	if err != nil {
		return nil, err
	}
	filters, err := readSeccompFilters(read)
	if err != nil {
		return nil, fmt.Errorf("criu: read seccomp filters: %w", err)
	}
	chainOf := func(tid int) ([][]byte, bool, error) {
		name := fmt.Sprintf("core-%d.img", tid)
		b, err := read(name, maxCoreImage)
		if err != nil {
			return nil, false, err
		}
		cores, err := decodeImage(name, b, coreMagic, 1, &criucore.CoreEntry{})
		if err != nil || len(cores) != 1 {
			return nil, false, fmt.Errorf("%s: %w", name, ErrBadImage)
		}
		tc := cores[0].(*criucore.CoreEntry).GetThreadCore()
		if tc.SeccompFilter == nil {
			return nil, false, nil
		}
		var chain [][]byte
		i := tc.GetSeccompFilter()
		for range len(filters) + 1 {
			if int(i) >= len(filters) {
				return nil, false, fmt.Errorf("%s: %w: thread %d's seccomp filter %d is not in %s (%d filters)", name, ErrBadImage, tid, i, seccompImage, len(filters))
			}
			f := filters[i]
			chain = append([][]byte{f.GetFilter()}, chain...)
			if f.Prev == nil {
				return chain, true, nil
			}
			i = f.GetPrev()
		}
		return nil, false, fmt.Errorf("%s: %w: thread %d's seccomp filters loop", name, ErrBadImage, tid)
	}
	var out []SeccompChain
	leaders := map[int][][]byte{}
	for _, p := range procs {
		if p.Seccomp != privilege.SeccompFilter {
			continue
		}
		chain, own, err := chainOf(p.TID)
		if err != nil {
			return nil, fmt.Errorf("criu: read seccomp filters: %w", err)
		}
		if !own {
			// a thread that shares its main thread's synchronised chain
			if chain = leaders[p.PID]; chain == nil {
				return nil, fmt.Errorf("criu: read seccomp filters: %w: thread %d of process %d runs a filter, but neither it nor its main thread records one", ErrBadImage, p.TID, p.PID)
			}
		}
		if p.TID == p.PID {
			leaders[p.PID] = chain
		}
		out = append(out, SeccompChain{PID: p.PID, TID: p.TID, Comm: p.Comm, Filters: chain})
	}
	return out, nil
}
