package topology

import (
	"fmt"
	"strconv"
	"strings"
)

// LinkKind is the class of path between two devices, as `nvidia-smi topo -m` names it.
// The zero value, LinkUnknown, means "no link known" and is never valid inside a Topology.
type LinkKind uint8

// Link kinds, from nvidia-smi's legend.
const (
	LinkUnknown LinkKind = iota // no link known (zero value)
	LinkSelf                    // "X": the device itself
	LinkNVLink                  // "NV#": a bonded set of # NVLinks (through NVSwitch on HGX/DGX boards)
	LinkPIX                     // "PIX": at most one PCIe bridge
	LinkPXB                     // "PXB": several PCIe bridges, without crossing a PCIe host bridge
	LinkPHB                     // "PHB": a PCIe host bridge (usually the CPU)
	LinkNODE                    // "NODE": PCIe and the interconnect between host bridges inside one NUMA node
	LinkSYS                     // "SYS": PCIe and the SMP interconnect between NUMA nodes (QPI/UPI, xGMI)
)

// MaxNVLinks is the largest NVLink count ParseLink accepts in "NV#"; real boards have at most 18.
const MaxNVLinks = 255

// Link is the path between two GPUs. NVLinks is the number of bonded NVLinks when Kind is
// LinkNVLink and 0 otherwise. Link is comparable with ==.
type Link struct {
	Kind    LinkKind
	NVLinks int
}

// Convenience values for the link kinds without a count.
var (
	Self = Link{Kind: LinkSelf}
	PIX  = Link{Kind: LinkPIX}
	PXB  = Link{Kind: LinkPXB}
	PHB  = Link{Kind: LinkPHB}
	NODE = Link{Kind: LinkNODE}
	SYS  = Link{Kind: LinkSYS}
)

// NV returns the link of n bonded NVLinks ("NV<n>"); n should be in [1, MaxNVLinks].
func NV(n int) Link { return Link{Kind: LinkNVLink, NVLinks: n} }

// Rank orders links by bandwidth between the two GPUs: a higher rank is a faster path.
//
//	unknown 0 < SYS 1 < NODE 2 < PHB 3 < PXB 4 < PIX 5 < NV# (100 + #) < X (self, 1<<20)
//
// so every NVLink connection ranks above every PCIe one, and more bonded NVLinks rank higher
// (NV18 > NV12 > NV2 > NV1). The numbers are an order, not GB/s: compare ranks, never do
// arithmetic on them. Self ranks highest so that the slowest pair of a set is never the self-link.
func (l Link) Rank() int {
	switch l.Kind {
	case LinkSYS:
		return 1
	case LinkNODE:
		return 2
	case LinkPHB:
		return 3
	case LinkPXB:
		return 4
	case LinkPIX:
		return 5
	case LinkNVLink:
		return 100 + l.NVLinks
	case LinkSelf:
		return 1 << 20
	default:
		return 0
	}
}

// Valid reports whether l is a link ParseLink could have returned.
func (l Link) Valid() bool {
	switch l.Kind {
	case LinkNVLink:
		return l.NVLinks >= 1 && l.NVLinks <= MaxNVLinks
	case LinkSelf, LinkPIX, LinkPXB, LinkPHB, LinkNODE, LinkSYS:
		return l.NVLinks == 0
	default:
		return false
	}
}

// String returns nvidia-smi's code for l: "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS",
// or "?" for an unknown or invalid link.
func (l Link) String() string {
	if !l.Valid() {
		return "?"
	}
	switch l.Kind {
	case LinkSelf:
		return "X"
	case LinkNVLink:
		return "NV" + strconv.Itoa(l.NVLinks)
	case LinkPIX:
		return "PIX"
	case LinkPXB:
		return "PXB"
	case LinkPHB:
		return "PHB"
	case LinkNODE:
		return "NODE"
	default:
		return "SYS"
	}
}

// ParseLink parses one cell of the `nvidia-smi topo -m` matrix: "X", "NV<n>" with n in
// [1, MaxNVLinks], "PIX", "PXB", "PHB", "NODE", "SYS", and "SOC" (the name older drivers used for
// SYS). Surrounding spaces are ignored; case matters, as nvidia-smi prints upper case.
// The error wraps ErrMalformed and quotes the cell.
func ParseLink(s string) (Link, error) {
	s = strings.TrimSpace(s)
	switch s {
	case "X":
		return Self, nil
	case "PIX":
		return PIX, nil
	case "PXB":
		return PXB, nil
	case "PHB":
		return PHB, nil
	case "NODE":
		return NODE, nil
	case "SYS", "SOC":
		return SYS, nil
	}
	if rest, ok := strings.CutPrefix(s, "NV"); ok && rest != "" && isDigits(rest) {
		n, err := strconv.Atoi(rest)
		if err == nil && n >= 1 && n <= MaxNVLinks {
			return NV(n), nil
		}
		return Link{}, fmt.Errorf("%w: link %q: NVLink count must be 1-%d", ErrMalformed, s, MaxNVLinks)
	}
	return Link{}, fmt.Errorf("%w: unknown link code %q (want X, NV#, PIX, PXB, PHB, NODE or SYS)", ErrMalformed, s)
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}
