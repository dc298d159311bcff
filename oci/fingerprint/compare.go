package fingerprint

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// Rule names how a field of a checkpoint's fingerprint must relate to a node's for a restore
// on that node to be allowed. The package doc's table says which field has which rule.
type Rule string

// The rules Compare applies.
const (
	// RuleExact: the values are equal.
	RuleExact Rule = "exact"
	// RuleExactIfBothSet: the values are equal, or at least one is empty.
	RuleExactIfBothSet Rule = "exact-if-both-set"
	// RuleAtLeast: the node's value is >= the checkpoint's (versions: by major.minor;
	// numbers: numerically).
	RuleAtLeast Rule = "at-least"
	// RuleSuperset: the node has every element the checkpoint has (CPU flags).
	RuleSuperset Rule = "superset"
	// RuleSameMajorMinor: the versions have equal major and minor numbers.
	RuleSameMajorMinor Rule = "same-major-minor"
	// RuleSameMajor: the versions have equal major numbers.
	RuleSameMajor Rule = "same-major"
)

// describe says what the rule requires of the node, for error messages.
func (r Rule) describe() string {
	switch r {
	case RuleAtLeast:
		return "node must be at least the checkpoint's"
	case RuleSuperset:
		return "node must have all of the checkpoint's"
	case RuleSameMajorMinor:
		return "major.minor must be equal"
	case RuleSameMajor:
		return "major must be equal"
	default:
		return "must be equal"
	}
}

// MismatchError is one field where a checkpoint's fingerprint and a node's are incompatible.
type MismatchError struct {
	// Field names the field as in the package doc's table ("kernel", "cpu.flags",
	// "gpus[0].driver").
	Field string
	// Checkpoint and Node are the two values as text. For cpu.flags, Checkpoint holds the
	// checkpoint's flags the node lacks (space-separated) and Node is empty.
	Checkpoint string
	Node       string
	// Rule is the rule that failed.
	Rule Rule
}

// Error reads, for example,
// `fingerprint mismatch: kernel: checkpoint has "6.18.0-1" but this node has "6.1.0-9"`;
// rules other than exact add what they require in parentheses.
func (e *MismatchError) Error() string {
	switch e.Rule {
	case RuleExact, RuleExactIfBothSet:
		return fmt.Sprintf("fingerprint mismatch: %s: checkpoint has %q but this node has %q",
			e.Field, e.Checkpoint, e.Node)
	case RuleSuperset:
		return fmt.Sprintf("fingerprint mismatch: %s: checkpoint needs %q but this node lacks them (%s)",
			e.Field, e.Checkpoint, e.Rule.describe())
	default:
		return fmt.Sprintf("fingerprint mismatch: %s: checkpoint has %q but this node has %q (%s)",
			e.Field, e.Checkpoint, e.Node, e.Rule.describe())
	}
}

// Compare reports whether a checkpoint taken with fingerprint checkpoint may be restored on a
// node with fingerprint node. It returns nil when every rule of the package doc's table holds,
// otherwise a *MismatchError for the first failing field in that table's order.
func Compare(checkpoint, node Fingerprint) error {
	if ms := compare(checkpoint, node, true); len(ms) > 0 {
		return ms[0]
	}
	return nil
}

// CompareAll is Compare that returns every mismatch, in the package doc's table order; nil
// when compatible. Join them with errors.Join when one error is wanted.
func CompareAll(checkpoint, node Fingerprint) []*MismatchError {
	return compare(checkpoint, node, false)
}

func compare(c, n Fingerprint, first bool) []*MismatchError {
	var out []*MismatchError
	add := func(m *MismatchError) bool {
		if m != nil {
			out = append(out, m)
		}
		return first && len(out) > 0
	}
	exact := func(field, cv, nv string) *MismatchError {
		if cv != nv {
			return &MismatchError{Field: field, Checkpoint: cv, Node: nv, Rule: RuleExact}
		}
		return nil
	}
	version := func(field, cv, nv string, rule Rule) *MismatchError {
		if versionCompatible(cv, nv, rule) {
			return nil
		}
		return &MismatchError{Field: field, Checkpoint: cv, Node: nv, Rule: rule}
	}

	if add(exact("arch", c.Arch, n.Arch)) ||
		add(exact("kernel", c.Kernel, n.Kernel)) ||
		add(version("criu", c.CRIU, n.CRIU, RuleAtLeast)) ||
		add(exact("cpu.vendor", c.CPU.Vendor, n.CPU.Vendor)) ||
		add(missingFlags(c.CPU.Flags, n.CPU.Flags)) ||
		add(version("runc", c.Runc, n.Runc, RuleSameMajorMinor)) ||
		add(version("containerd", c.Containerd, n.Containerd, RuleSameMajor)) {
		return out
	}
	if c.ImageDigest != "" && n.ImageDigest != "" && c.ImageDigest != n.ImageDigest {
		if add(&MismatchError{Field: "imageDigest", Checkpoint: c.ImageDigest, Node: n.ImageDigest, Rule: RuleExactIfBothSet}) {
			return out
		}
	}
	if len(c.GPUs) != len(n.GPUs) {
		add(&MismatchError{Field: "gpus", Checkpoint: strconv.Itoa(len(c.GPUs)), Node: strconv.Itoa(len(n.GPUs)), Rule: RuleExact})
		return out
	}
	cg, ng := sortedGPUs(c.GPUs), sortedGPUs(n.GPUs)
	for i := range cg {
		p := fmt.Sprintf("gpus[%d].", cg[i].Index)
		if add(exact(p+"name", cg[i].Name, ng[i].Name)) ||
			add(exact(p+"driver", cg[i].Driver, ng[i].Driver)) ||
			add(exact(p+"cuda", cg[i].CUDA, ng[i].CUDA)) {
			return out
		}
		if ng[i].MemoryBytes < cg[i].MemoryBytes {
			if add(&MismatchError{Field: p + "memoryBytes",
				Checkpoint: strconv.FormatUint(cg[i].MemoryBytes, 10),
				Node:       strconv.FormatUint(ng[i].MemoryBytes, 10), Rule: RuleAtLeast}) {
				return out
			}
		}
	}
	return out
}

// missingFlags returns a cpu.flags mismatch listing the checkpoint flags the node lacks.
func missingFlags(cflags, nflags []string) *MismatchError {
	have := make(map[string]bool, len(nflags))
	for _, f := range nflags {
		have[f] = true
	}
	var missing []string
	for _, f := range cflags {
		if !have[f] {
			missing = append(missing, f)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	sort.Strings(missing)
	return &MismatchError{Field: "cpu.flags", Checkpoint: strings.Join(missing, " "), Rule: RuleSuperset}
}

// sortedGPUs returns a copy of gpus sorted by Index (stable).
func sortedGPUs(gpus []GPU) []GPU {
	out := append([]GPU(nil), gpus...)
	sort.SliceStable(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out
}

// versionCompatible applies a version rule. An empty checkpoint version imposes nothing; a node
// version that is empty or unparsable (when the checkpoint's is set) fails; an unparsable
// checkpoint version matches only an identical node string.
func versionCompatible(cv, nv string, rule Rule) bool {
	if cv == "" {
		return true
	}
	if cv == nv {
		return true
	}
	c, okc := parseVersion(cv)
	n, okn := parseVersion(nv)
	if !okc || !okn {
		return false
	}
	switch rule {
	case RuleAtLeast:
		return n[0] > c[0] || (n[0] == c[0] && n[1] >= c[1])
	case RuleSameMajorMinor:
		return n[0] == c[0] && n[1] == c[1]
	case RuleSameMajor:
		return n[0] == c[0]
	default:
		return false
	}
}

// parseVersion parses the major and minor numbers of "v1.2.3-rc.1+meta" or "4.2" forms; a
// missing minor is 0.
func parseVersion(s string) ([2]int, bool) {
	s = strings.TrimPrefix(strings.TrimSpace(s), "v")
	if i := strings.IndexAny(s, "-+"); i >= 0 {
		s = s[:i]
	}
	parts := strings.Split(s, ".")
	var v [2]int
	for i := 0; i < 2 && i < len(parts); i++ {
		x, err := strconv.Atoi(parts[i])
		if err != nil || x < 0 {
			return v, false
		}
		v[i] = x
	}
	return v, true
}

// Hash returns a stable short hash (16 lowercase hex characters, the first 64 bits of a
// SHA-256) of the fields the exact rule compares between nodes: arch, kernel, cpu.vendor, the
// GPU count and each GPU's name, driver and CUDA version (in Index order). ImageDigest is left
// out, so a checkpoint's hash equals the hash of the node it was taken on. Two fingerprints with
// different hashes are never compatible; equal hashes still need Compare (versions, CPU flags
// and GPU memory are not hashed). Suitable as a node label value.
func (f Fingerprint) Hash() string {
	var b strings.Builder
	fmt.Fprintf(&b, "berth-fingerprint-hash-v1\x00arch=%s\x00kernel=%s\x00cpu.vendor=%s\x00gpus=%d",
		f.Arch, f.Kernel, f.CPU.Vendor, len(f.GPUs))
	for _, g := range sortedGPUs(f.GPUs) {
		fmt.Fprintf(&b, "\x00gpu.name=%s\x00gpu.driver=%s\x00gpu.cuda=%s", g.Name, g.Driver, g.CUDA)
	}
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:8])
}
