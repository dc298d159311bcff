package topology

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// MaxID is the largest CPU or NUMA node id ParseIDList accepts. Linux allows at most 8192 CPUs
// and 1024 NUMA nodes; the bound keeps a hostile "0-999999999" from allocating gigabytes.
const MaxID = 1<<16 - 1

// ParseIDList parses a Linux id list (cpuset "cpus"/"mems" and sysfs cpulist format) such as
// "0-55,112-167" or "0,3-9,11-17" into ids sorted ascending. Surrounding spaces are ignored.
// Ids must be in [0, MaxID], a range's low end must not exceed its high end, and no id may
// appear twice. The empty string gives an empty, non-nil list. Errors wrap ErrMalformed and
// quote the offending element.
func ParseIDList(s string) ([]int, error) {
	s = strings.TrimSpace(s)
	ids := []int{}
	if s == "" {
		return ids, nil
	}
	for elem := range strings.SplitSeq(s, ",") {
		elem = strings.TrimSpace(elem)
		lo, hi, isRange := strings.Cut(elem, "-")
		a, err := parseID(lo)
		if err != nil {
			return nil, fmt.Errorf("%w: id list %q: element %q: %w", ErrMalformed, s, elem, err)
		}
		b := a
		if isRange {
			if b, err = parseID(hi); err != nil {
				return nil, fmt.Errorf("%w: id list %q: element %q: %w", ErrMalformed, s, elem, err)
			}
			if a > b {
				return nil, fmt.Errorf("%w: id list %q: range %q runs backwards", ErrMalformed, s, elem)
			}
		}
		if len(ids)+(b-a+1) > MaxID+1 {
			return nil, fmt.Errorf("%w: id list %q: more than %d ids", ErrMalformed, s, MaxID+1)
		}
		for id := a; id <= b; id++ {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for i := 1; i < len(ids); i++ {
		if ids[i] == ids[i-1] {
			return nil, fmt.Errorf("%w: id list %q: id %d appears twice", ErrMalformed, s, ids[i])
		}
	}
	return ids, nil
}

func parseID(s string) (int, error) {
	if !isDigits(s) {
		return 0, fmt.Errorf("%q is not a non-negative integer", s)
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > MaxID {
		return 0, fmt.Errorf("id %s is above the maximum %d", s, MaxID)
	}
	return n, nil
}

// FormatIDList formats ids (CPU ids, NUMA node ids or GPU indices) in the Linux list format,
// joining runs of consecutive ids into ranges: [0 1 2 3 7] gives "0-3,7". The ids are sorted
// first (a copy; the argument is not changed); duplicates are printed once. Empty gives "".
func FormatIDList(ids []int) string {
	s := slices.Clone(ids)
	slices.Sort(s)
	s = slices.Compact(s)
	var b strings.Builder
	for i := 0; i < len(s); {
		j := i
		for j+1 < len(s) && s[j+1] == s[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(s[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(s[j]))
		}
		i = j + 1
	}
	return b.String()
}
