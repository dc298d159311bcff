package topology

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Sentinel errors. Every error from Parse and Validate wraps ErrMalformed; the more specific
// ones wrap it too, so errors.Is(err, ErrMalformed) holds for all of them.
var (
	// ErrMalformed: the text or the model is not a consistent node topology.
	ErrMalformed = errors.New("malformed topology")
	// ErrEmpty: the input holds no topology matrix at all (empty, or only comments).
	ErrEmpty = fmt.Errorf("%w: no topology matrix", ErrMalformed)
	// ErrTruncated: a GPU row has fewer cells than the header, or a GPU of the header has no row.
	// The fixture 10-gb200-tray-PARTIAL.tsv gives this error: berth refuses a partial matrix
	// rather than guessing the missing links.
	ErrTruncated = fmt.Errorf("%w: truncated", ErrMalformed)
	// ErrAsymmetric: the link from GPU i to GPU j differs from the link from j to i.
	ErrAsymmetric = fmt.Errorf("%w: asymmetric links", ErrMalformed)
)

// GPU is one GPU of a node and where it sits relative to the CPUs.
type GPU struct {
	// Index is the GPU's nvidia-smi index (GPU<Index>); in a Topology it equals its position.
	Index int
	// CPUs are the Linux CPU ids the GPU is close to ("CPU Affinity"), ascending;
	// nil when unknown ("N/A" or no such column).
	CPUs []int
	// NUMA are the Linux NUMA node ids the GPU is close to ("NUMA Affinity"), ascending;
	// nil when unknown ("N/A" or no such column). On Grace systems the list also names the
	// NUMA nodes that expose GPU memory.
	NUMA []int
	// GPUNUMA is the NUMA node id of the GPU's own memory ("GPU NUMA ID", Grace systems),
	// or -1 when the GPU's memory is not a NUMA node or the column is absent.
	GPUNUMA int
}

// Topology is a node's GPUs and the link between every pair of them.
// GPUs[i].Index == i; Links is len(GPUs) x len(GPUs), Links[i][i] is Self, and
// Links[i][j] == Links[j][i]. Build one with Parse, or by hand and check it with Validate.
type Topology struct {
	GPUs  []GPU
	Links [][]Link
}

// Link returns the link between GPU indices i and j (Self when i == j).
// It panics if either index is outside [0, len(t.GPUs)), like a slice index.
func (t *Topology) Link(i, j int) Link { return t.Links[i][j] }

// Validate checks the invariants documented on Topology and that every link is Valid. The
// error wraps ErrMalformed (ErrAsymmetric for asymmetric links) and names the GPUs and values.
func (t *Topology) Validate() error {
	if t == nil {
		return fmt.Errorf("%w: nil topology", ErrMalformed)
	}
	n := len(t.GPUs)
	if n == 0 {
		return fmt.Errorf("%w: no GPUs", ErrMalformed)
	}
	if len(t.Links) != n {
		return fmt.Errorf("%w: %d GPUs but %d rows of links", ErrMalformed, n, len(t.Links))
	}
	for i, g := range t.GPUs {
		if g.Index != i {
			return fmt.Errorf("%w: GPU at position %d has index %d", ErrMalformed, i, g.Index)
		}
		if g.GPUNUMA < -1 {
			return fmt.Errorf("%w: GPU%d: GPU NUMA id %d (want >= 0, or -1 for none)", ErrMalformed, i, g.GPUNUMA)
		}
		if len(t.Links[i]) != n {
			return fmt.Errorf("%w: GPU%d has %d links, want %d", ErrMalformed, i, len(t.Links[i]), n)
		}
	}
	for i := range n {
		for j := range n {
			l := t.Links[i][j]
			switch {
			case !l.Valid():
				return fmt.Errorf("%w: GPU%d-GPU%d: invalid link %+v", ErrMalformed, i, j, l)
			case i == j && l != Self:
				return fmt.Errorf("%w: GPU%d-GPU%d: diagonal is %s, want X", ErrMalformed, i, j, l)
			case i != j && l == Self:
				return fmt.Errorf("%w: GPU%d-GPU%d: X off the diagonal", ErrMalformed, i, j)
			case l != t.Links[j][i]:
				return fmt.Errorf("%w: GPU%d-GPU%d is %s but GPU%d-GPU%d is %s",
					ErrAsymmetric, i, j, l, j, i, t.Links[j][i])
			}
		}
	}
	return nil
}

// String prints t in the format of `nvidia-smi topo -m` (tab-separated, GPU columns then
// "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID"; "N/A" for unknown), which Parse reads back.
func (t *Topology) String() string {
	var b strings.Builder
	for i := range t.GPUs {
		fmt.Fprintf(&b, "\tGPU%d", i)
	}
	b.WriteString("\t" + colCPU + "\t" + colNUMA + "\t" + colGPUNUMA + "\n")
	for i, g := range t.GPUs {
		fmt.Fprintf(&b, "GPU%d", i)
		for j := range t.GPUs {
			b.WriteString("\t" + t.Links[i][j].String())
		}
		b.WriteString("\t" + formatOptionalList(g.CPUs) + "\t" + formatOptionalList(g.NUMA) + "\t")
		if g.GPUNUMA < 0 {
			b.WriteString("N/A")
		} else {
			b.WriteString(strconv.Itoa(g.GPUNUMA))
		}
		b.WriteByte('\n')
	}
	return b.String()
}

func formatOptionalList(ids []int) string {
	if ids == nil {
		return "N/A"
	}
	return FormatIDList(ids)
}
