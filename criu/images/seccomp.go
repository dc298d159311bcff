package images

import (
	"fmt"
	"path/filepath"

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
	// Flags are each filter's SECCOMP_FILTER_FLAG_* bits, as CRIU installs it.
	Flags []uint32
}

// ReadSeccompChains returns the filter chain of every thread of the CRIU images directory that
// CRIU's restore leaves in seccomp filter mode, as it installs them (seccompOf: the main thread's
// old_seccomp_mode and old_seccomp_filter win, a missing filter index is 0, a chain installed
// with SECCOMP_FILTER_FLAG_TSYNC reaches the threads left without one), each filter with the
// flags CRIU installs it with. Errors are ReadProcesses's.
func ReadSeccompChains(imagesDir string) ([]SeccompChain, error) {
	read := func(name string, limit int64) ([]byte, error) {
		return readImageFile(filepath.Join(imagesDir, name), limit)
	}
	threads, err := readProcesses(read)
	if err != nil {
		return nil, err
	}
	filters, err := readSeccompFilters(read)
	if err != nil {
		return nil, fmt.Errorf("criu: read seccomp filters: %w", err)
	}
	var out []SeccompChain
	for _, t := range threads {
		if t.Seccomp != privilege.SeccompFilter {
			continue
		}
		c := SeccompChain{PID: t.PID, TID: t.TID, Comm: t.Comm}
		for _, i := range t.chain {
			c.Filters = append(c.Filters, filters[i].GetFilter())
			c.Flags = append(c.Flags, filters[i].GetFlags())
		}
		out = append(out, c)
	}
	return out, nil
}
