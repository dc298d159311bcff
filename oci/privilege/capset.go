package privilege

import (
	"encoding/json"
	"fmt"
	"math/bits"
	"strconv"
	"strings"
	"sync"

	"github.com/moby/sys/capability"
)

// CapSet is a set of Linux capabilities: bit n is capability n in the kernel's numbering
// (CAP_CHOWN is bit 0, CAP_SYS_ADMIN bit 21). Its JSON form is the list of names.
type CapSet uint64

// capTables maps capability numbers to "CAP_*" names (names) and back (numbers), from
// moby/sys/capability's table. Built by the first call (every container's shim links this
// package, few use it); never changed.
var capTables = sync.OnceValue(func() (t struct {
	names   map[int]string
	numbers map[string]int
}) {
	t.names, t.numbers = map[int]string{}, map[string]int{}
	for _, c := range capability.ListKnown() {
		n := "CAP_" + strings.ToUpper(c.String())
		t.names[int(c)], t.numbers[n] = n, int(c)
	}
	return t
})

// CapName returns the name of capability n ("CAP_SYS_ADMIN"), or "CAP_<n>" for a number the
// table does not know.
func CapName(n int) string {
	if s, ok := capTables().names[n]; ok {
		return s
	}
	return "CAP_" + strconv.Itoa(n)
}

// ParseCapSet returns the set of the named capabilities ("CAP_CHOWN", as in an OCI spec) and
// the names it does not know, which it leaves out of the set.
func ParseCapSet(names []string) (set CapSet, unknown []string) {
	for _, name := range names {
		n, ok := capTables().numbers[name]
		if !ok {
			unknown = append(unknown, name)
			continue
		}
		set |= 1 << n
	}
	return set, unknown
}

// Has reports whether capability n is in c.
func (c CapSet) Has(n int) bool { return n >= 0 && n < 64 && c&(1<<n) != 0 }

// Minus returns the capabilities in c that are not in o.
func (c CapSet) Minus(o CapSet) CapSet { return c &^ o }

// Names returns the names of c's capabilities in ascending number.
func (c CapSet) Names() []string {
	out := make([]string, 0, bits.OnesCount64(uint64(c)))
	for v := uint64(c); v != 0; v &= v - 1 {
		out = append(out, CapName(bits.TrailingZeros64(v)))
	}
	return out
}

// String lists c's names separated by commas, or "none".
func (c CapSet) String() string {
	if c == 0 {
		return "none"
	}
	return strings.Join(c.Names(), ",")
}

// MarshalJSON writes c as a list of names.
func (c CapSet) MarshalJSON() ([]byte, error) { return json.Marshal(c.Names()) }

// UnmarshalJSON reads a list of names; "CAP_<n>" stands for a number the table does not know.
// An unknown name is an error: a recorded set must read back exactly.
func (c *CapSet) UnmarshalJSON(b []byte) error {
	var names []string
	if err := json.Unmarshal(b, &names); err != nil {
		return err
	}
	var set CapSet
	for _, name := range names {
		n, ok := capTables().numbers[name]
		if !ok {
			v, err := strconv.Atoi(strings.TrimPrefix(name, "CAP_"))
			if !strings.HasPrefix(name, "CAP_") || err != nil || v < 0 || v > 63 {
				return fmt.Errorf("unknown capability %q", name)
			}
			n = v
		}
		set |= 1 << n
	}
	*c = set
	return nil
}
