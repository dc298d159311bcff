package placement

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
)

// fixturesDir holds the real-machine `nvidia-smi topo -m` fixtures (gpu/topology's corpus).
const fixturesDir = "../../gpu/topology/testdata/topologies"

// ---- brute force: the objective of the package doc, written the plain way ----

// key is the objective of one candidate set, compared lexicographically.
type key struct {
	slowest int   // rank of the slowest pair (Self's rank for one GPU)
	domains int   // locality domains spanned
	frag    []int // per fragmentationSizes: best remaining k-set, packed (slowest*1000 - domains), -1<<60 if none
	strand  []int // per remaining GPU: rank of its best link to another remaining GPU (0 if none), ascending
}

func bruteSlowest(t *topology.Topology, set []int) int {
	r := topology.Self.Rank()
	for i := range set {
		for j := i + 1; j < len(set); j++ {
			r = min(r, t.Link(set[i], set[j]).Rank())
		}
	}
	return r
}

func bruteDomains(t *topology.Topology, set []int) int {
	d := map[string]bool{}
	for _, g := range set {
		gpu := t.GPUs[g]
		switch {
		case gpu.NUMA != nil:
			for _, n := range gpu.NUMA {
				d[fmt.Sprint("numa", n)] = true
			}
		case gpu.CPUs != nil:
			d[fmt.Sprint("cpus", gpu.CPUs)] = true
		default:
			d[fmt.Sprint("gpu", g)] = true
		}
	}
	return len(d)
}

// subsets calls f with every k-subset of s, ascending, in lexicographic order.
func subsets(s []int, k int, f func([]int)) {
	var rec func(start int, cur []int)
	rec = func(start int, cur []int) {
		if len(cur) == k {
			f(slices.Clone(cur))
			return
		}
		for i := start; i < len(s); i++ {
			rec(i+1, append(cur, s[i]))
		}
	}
	rec(0, nil)
}

func bruteKey(t *topology.Topology, set, free []int) key {
	k := key{slowest: bruteSlowest(t, set), domains: bruteDomains(t, set)}
	var rest []int
	for _, g := range free {
		if !slices.Contains(set, g) {
			rest = append(rest, g)
		}
	}
	for _, size := range fragmentationSizes {
		best := -1 << 60
		subsets(rest, size, func(sub []int) {
			best = max(best, bruteSlowest(t, sub)*1000-bruteDomains(t, sub))
		})
		k.frag = append(k.frag, best)
	}
	for _, g := range rest {
		best := 0
		for _, o := range rest {
			if o != g {
				best = max(best, t.Link(g, o).Rank())
			}
		}
		k.strand = append(k.strand, best)
	}
	slices.Sort(k.strand)
	return k
}

func (a key) cmp(b key) int {
	if a.slowest != b.slowest {
		return a.slowest - b.slowest
	}
	if a.domains != b.domains {
		return b.domains - a.domains
	}
	if c := slices.Compare(a.frag, b.frag); c != 0 {
		return c
	}
	return slices.Compare(a.strand, b.strand)
}

// bruteChoose enumerates the n-subsets of free in lexicographic order and keeps the first best.
func bruteChoose(t *topology.Topology, free []int, n int) ([]int, key) {
	free = slices.Sorted(slices.Values(free))
	var best []int
	var bestKey key
	subsets(free, n, func(set []int) {
		k := bruteKey(t, set, free)
		if best == nil || k.cmp(bestKey) > 0 {
			best, bestKey = set, k
		}
	})
	return best, bestKey
}

// ---- synthetic topologies ----

// build makes a topology of n GPUs from link(i, j) for i < j and each GPU's NUMA node
// (-1: unknown) and CPU affinity.
func build(n int, link func(i, j int) topology.Link, numa func(i int) int, cpus func(i int) []int) *topology.Topology {
	t := &topology.Topology{GPUs: make([]topology.GPU, n), Links: make([][]topology.Link, n)}
	for i := range n {
		t.GPUs[i] = topology.GPU{Index: i, GPUNUMA: -1, CPUs: cpus(i)}
		if nn := numa(i); nn >= 0 {
			t.GPUs[i].NUMA = []int{nn}
		}
		t.Links[i] = make([]topology.Link, n)
	}
	for i := range n {
		for j := range n {
			switch {
			case i == j:
				t.Links[i][j] = topology.Self
			case i < j:
				t.Links[i][j] = link(i, j)
			default:
				t.Links[i][j] = link(j, i)
			}
		}
	}
	return t
}

func socketCPUs(perSocket, sockets int) func(i int) []int {
	return func(i int) []int {
		s := i * sockets / perSocket / sockets
		ids := make([]int, 4)
		for c := range ids {
			ids[c] = s*4 + c
		}
		return ids
	}
}

func synthetic() map[string]*topology.Topology {
	half := func(n int) func(int) int { return func(i int) int { return i * 2 / n } }
	noCPUs := func(int) []int { return nil }
	return map[string]*topology.Topology{
		// One socket, 8 GPUs: pairs under a PCIe switch (PIX), pairs of pairs under a second level
		// (PXB), halves under different host bridges (PHB).
		"one-socket-pcie-tree": build(8, func(i, j int) topology.Link {
			switch {
			case i/2 == j/2:
				return topology.PIX
			case i/4 == j/4:
				return topology.PXB
			}
			return topology.PHB
		}, func(int) int { return 0 }, func(int) []int { return []int{0, 1, 2, 3} }),
		// Two sockets, PCIe only: NODE inside a socket, SYS across.
		"two-socket-sys": build(8, func(i, j int) topology.Link {
			if i/4 == j/4 {
				return topology.NODE
			}
			return topology.SYS
		}, half(8), socketCPUs(8, 2)),
		// Every pair SYS, NUMA alone decides (like 8x RTX 4090), with 4 NUMA nodes.
		"four-numa-all-sys": build(8, func(i, j int) topology.Link { return topology.SYS },
			func(i int) int { return i / 2 }, noCPUs),
		// DGX-1-like hybrid cube mesh, with no NUMA column: CPU affinity is the only locality.
		"dgx1-cube-mesh": build(8, func(i, j int) topology.Link { return dgx1[i][j] },
			func(int) int { return -1 }, func(i int) []int { return []int{i / 4} }),
		// NVLink bridges on pairs (0,3), (1,2), (4,6), (5,7): partners are not adjacent indices;
		// PHB inside a socket, SYS across.
		"nvlink-bridge-pairs": build(8, func(i, j int) topology.Link {
			partner := map[int]int{0: 3, 3: 0, 1: 2, 2: 1, 4: 6, 6: 4, 5: 7, 7: 5}
			switch {
			case partner[i] == j:
				return topology.NV(4)
			case i/4 == j/4:
				return topology.PHB
			}
			return topology.SYS
		}, half(8), socketCPUs(8, 2)),
		// NVSwitch all-to-all on 8 GPUs, two NUMA halves (HGX H100 without the fixture).
		"nvswitch-8": build(8, func(i, j int) topology.Link { return topology.NV(18) }, half(8), socketCPUs(8, 2)),
		// 12 GPUs, three sockets, NV2 within a socket's quad, SYS across; unknown locality.
		"twelve-gpus-unknown-locality": build(12, func(i, j int) topology.Link {
			if i/4 == j/4 {
				return topology.NV(2 + (i+j)%2)
			}
			return topology.SYS
		}, func(int) int { return -1 }, noCPUs),
		// Mixed: NVLink counts differ inside the set (NV1..NV3), eight NUMA nodes.
		"eight-numa-mixed-nvlink": build(8, func(i, j int) topology.Link {
			if (i+j)%3 == 0 {
				return topology.SYS
			}
			return topology.NV(1 + (i*j)%3)
		}, func(i int) int { return i }, noCPUs),
	}
}

// dgx1 is the DGX-1 V100 GPU matrix (the 01 fixture's).
var dgx1 = func() [][]topology.Link {
	rows := []string{
		"X NV1 NV1 NV2 NV2 SYS SYS SYS",
		"NV1 X NV2 NV1 SYS NV2 SYS SYS",
		"NV1 NV2 X NV2 SYS SYS NV1 SYS",
		"NV2 NV1 NV2 X SYS SYS SYS NV1",
		"NV2 SYS SYS SYS X NV1 NV1 NV2",
		"SYS NV2 SYS SYS NV1 X NV2 NV1",
		"SYS SYS NV1 SYS NV1 NV2 X NV2",
		"SYS SYS SYS NV1 NV2 NV1 NV2 X",
	}
	m := make([][]topology.Link, len(rows))
	for i, r := range rows {
		for _, c := range strings.Fields(r) {
			l, err := topology.ParseLink(c)
			if err != nil {
				panic(err)
			}
			m[i] = append(m[i], l)
		}
	}
	return m
}()

// fixtures returns every real-machine fixture table, plus the topology package's testdata. Each
// must parse; only the truncated one (PARTIAL in its name) is left out, by name.
func fixtures(t *testing.T) map[string]*topology.Topology {
	t.Helper()
	out := map[string]*topology.Topology{}
	var paths []string
	for _, pattern := range []string{filepath.Join(fixturesDir, "*.tsv"), "../../gpu/topology/testdata/*.tsv"} {
		p, _ := filepath.Glob(pattern)
		paths = append(paths, p...)
	}
	for _, p := range paths {
		if strings.Contains(filepath.Base(p), "PARTIAL") {
			continue // truncated in its source: gpu/topology's tests check its error
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		top, err := topology.Parse(f)
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		out["fixture/"+filepath.Base(p)] = top
	}
	if len(out) < 7 {
		t.Fatalf("only %d fixtures (want the 5 real tables and 2 of gpu/topology/testdata)", len(out))
	}
	return out
}

// occupancies are the fixed partly-occupied states every topology is tested in.
var occupancies = [][]int{{}, {0}, {7}, {1, 2}, {0, 3, 5}, {2, 3, 4, 5}, {0, 2, 4, 6}, {1, 2, 3, 4, 5, 6}}

func freeGPUs(n int, occupied []int) []int {
	var free []int
	for g := range n {
		if !slices.Contains(occupied, g) {
			free = append(free, g)
		}
	}
	return free
}

// TestChooseMatchesBruteForce checks Choose against the exhaustive search on every topology,
// every occupancy and every request size: the same objective value and the same set.
func TestChooseMatchesBruteForce(t *testing.T) {
	all := synthetic()
	for name, top := range fixtures(t) {
		all[name] = top
	}
	cases := 0
	for name, top := range all {
		for _, occ := range occupancies {
			free := freeGPUs(len(top.GPUs), occ)
			for n := 1; n <= len(free); n++ {
				t.Run(fmt.Sprintf("%s/occupied=%v/n=%d", name, occ, n), func(t *testing.T) {
					got, err := Choose(top, free, n)
					if err != nil {
						t.Fatal(err)
					}
					want, wantKey := bruteChoose(top, free, n)
					if gotKey := bruteKey(top, got.GPUs, free); gotKey.cmp(wantKey) != 0 {
						t.Fatalf("Choose = %v (%+v), brute force = %v (%+v)", got.GPUs, gotKey, want, wantKey)
					}
					if !slices.Equal(got.GPUs, want) {
						t.Fatalf("Choose = %v, brute force = %v (same objective, tie broken differently)", got.GPUs, want)
					}
					if got.SlowestLink.Rank() != bruteSlowest(top, got.GPUs) {
						t.Fatalf("SlowestLink %s does not match the set %v", got.SlowestLink, got.GPUs)
					}
					if !strings.HasPrefix(got.Reason, "GPU") || !strings.Contains(got.Reason, joinInts(got.GPUs)) {
						t.Fatalf("Reason %q does not name the GPUs", got.Reason)
					}
				})
				cases++
			}
		}
	}
	t.Logf("%d topologies, %d cases, all optimal", len(all), cases)
}

func loadFixture(t *testing.T, name string) *topology.Topology {
	t.Helper()
	f, err := os.Open(filepath.Join(fixturesDir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	top, err := topology.Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	return top
}

// TestChooseExamples pins down choices a person can check by reading the fixture.
func TestChooseExamples(t *testing.T) {
	tests := []struct {
		fixture     string
		occupied    []int
		n           int
		want        []int
		slowest     topology.Link
		numa        []int
		reasonParts []string
	}{
		// DGX H100: all NV18, so NUMA halves decide, and the other half is kept whole.
		{"05-dgx-h100.tsv", nil, 4, []int{0, 1, 2, 3}, topology.NV(18), []int{0},
			[]string{"GPUs 0,1,2,3: slowest pair NV18", "1 NUMA node (0)", "leaves GPUs 4-7 free, best next 4: 4-7 (slowest pair NV18, 1 NUMA node (1))"}},
		// Two GPUs of half 0 taken: a pair request goes to the rest of half 0, keeping half 1 whole.
		{"05-dgx-h100.tsv", []int{0, 1}, 2, []int{2, 3}, topology.NV(18), []int{0}, nil},
		// Same on the all-SYS 4090 box: only NUMA affinity separates the choices.
		{"08-8x4090-all-sys.tsv", []int{0, 1}, 2, []int{2, 3}, topology.SYS, []int{0}, nil},
		{"08-8x4090-all-sys.tsv", []int{0}, 4, []int{4, 5, 6, 7}, topology.SYS, []int{1}, nil},
		// Bridge pairs 0-2, 1-3, 4-5, 6-7: a pair is the bridged one, not adjacent indices.
		{"02-8gpu-nvlink-bridge-pairs.tsv", nil, 2, []int{0, 2}, topology.NV(12), []int{0}, nil},
		{"02-8gpu-nvlink-bridge-pairs.tsv", []int{0}, 2, []int{1, 3}, topology.NV(12), []int{0}, nil},
		// One GPU with GPU0 busy: take its bridge partner 2, which is stranded anyway, rather
		// than break an intact pair (key 4).
		{"02-8gpu-nvlink-bridge-pairs.tsv", []int{0}, 1, []int{2}, topology.Self, []int{0},
			[]string{"GPU 2: a single GPU, no pair"}},
		// L40S: NODE within a socket.
		{"07-4xl40s-pcie.tsv", nil, 2, []int{0, 1}, topology.NODE, []int{0}, nil},
		{"07-4xl40s-pcie.tsv", []int{1}, 2, []int{2, 3}, topology.NODE, []int{1}, nil},
		{"07-4xl40s-pcie.tsv", []int{1}, 3, []int{0, 2, 3}, topology.SYS, []int{0, 1}, nil},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%s/occupied=%v/n=%d", tc.fixture, tc.occupied, tc.n), func(t *testing.T) {
			top := loadFixture(t, tc.fixture)
			got, err := Choose(top, freeGPUs(len(top.GPUs), tc.occupied), tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got.GPUs, tc.want) || got.SlowestLink != tc.slowest || !slices.Equal(got.NUMANodes, tc.numa) {
				t.Fatalf("got %v slowest %s NUMA %v; want %v slowest %s NUMA %v\nreason: %s",
					got.GPUs, got.SlowestLink, got.NUMANodes, tc.want, tc.slowest, tc.numa, got.Reason)
			}
			for _, p := range tc.reasonParts {
				if !strings.Contains(got.Reason, p) {
					t.Errorf("Reason %q lacks %q", got.Reason, p)
				}
			}
		})
	}
}

// TestChooseDGX1 checks the hybrid cube mesh: with GPU1 busy the first four free GPUs
// (0,2,3,4) include a SYS pair; Choose must find a 4-set joined by NVLink only.
func TestChooseDGX1(t *testing.T) {
	top := loadFixture(t, "01-dgx1-v100.tsv")
	for _, tc := range []struct {
		occupied []int
		nvlink   bool // an all-NVLink 4-set exists among the free GPUs
	}{{nil, true}, {[]int{1}, true}, {[]int{2}, true}, {[]int{6}, true}, {[]int{0, 5}, false}} {
		occ := tc.occupied
		free := freeGPUs(8, occ)
		got, err := Choose(top, free, 4)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := bruteChoose(top, free, 4)
		if (tc.nvlink && got.SlowestLink.Rank() < topology.NV(1).Rank()) || !slices.Equal(got.GPUs, want) {
			t.Fatalf("occupied %v: got %v (slowest %s), brute force %v; %s", occ, got.GPUs, got.SlowestLink, want, got.Reason)
		}
		if first := free[:4]; tc.nvlink && bruteSlowest(top, first) < topology.NV(1).Rank() && slices.Equal(got.GPUs, first) {
			t.Fatalf("occupied %v: picked the first four %v, which include a non-NVLink pair", occ, first)
		}
		t.Logf("occupied %v: %s", occ, got.Reason)
	}
}

func TestChooseArgumentsUnchangedAndOrderFree(t *testing.T) {
	top := synthetic()["nvlink-bridge-pairs"]
	free := []int{7, 5, 1, 2, 0}
	a, err := Choose(top, free, 2)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(free, []int{7, 5, 1, 2, 0}) {
		t.Fatalf("Choose changed free: %v", free)
	}
	b, _ := Choose(top, []int{0, 1, 2, 5, 7}, 2)
	if !slices.Equal(a.GPUs, b.GPUs) || a.Reason != b.Reason {
		t.Fatalf("order of free changed the choice: %v vs %v", a, b)
	}
	// Both 1,2 and 5,7 are intact NV4 pairs; taking 5,7 leaves GPU0 with PHB neighbours 1,2
	// instead of SYS ones (key 4).
	if !slices.Equal(a.GPUs, []int{5, 7}) {
		t.Fatalf("got %v, want the bridged pair 5,7: %s", a.GPUs, a.Reason)
	}
}

func TestChooseErrors(t *testing.T) {
	top := synthetic()["nvswitch-8"]
	big := build(MaxFree+1, func(i, j int) topology.Link { return topology.SYS },
		func(int) int { return 0 }, func(int) []int { return nil })
	bad := build(2, func(i, j int) topology.Link { return topology.SYS },
		func(int) int { return 0 }, func(int) []int { return nil })
	bad.Links[0][1] = topology.NV(1)
	tests := []struct {
		name string
		top  *topology.Topology
		free []int
		n    int
		want error
		msg  string
	}{
		{"zero", top, []int{0, 1}, 0, ErrInvalidRequest, "requested 0 GPUs, want at least 1"},
		{"negative", top, []int{0, 1}, -2, ErrInvalidRequest, "requested -2 GPUs"},
		{"too few free", top, []int{6, 4}, 3, ErrInsufficientGPUs, "requested 3 GPUs, but only 2 are free: 4,6"},
		{"none free", top, nil, 1, ErrInsufficientGPUs, "requested 1 GPUs, but only 0 are free: none"},
		{"index too high", top, []int{0, 8}, 1, ErrInvalidRequest, "free GPU index 8 is not a GPU of this node (it has GPUs 0-7)"},
		{"negative index", top, []int{-1, 0}, 1, ErrInvalidRequest, "free GPU index -1"},
		{"duplicate", top, []int{3, 1, 3}, 1, ErrInvalidRequest, "free GPU index 3 is listed twice"},
		{"nil topology", nil, []int{0}, 1, ErrInvalidRequest, "no topology"},
		{"invalid topology", bad, []int{0}, 1, ErrInvalidRequest, "GPU0-GPU1 is NV1 but GPU1-GPU0 is SYS"},
		{"too many free", big, freeGPUs(MaxFree+1, nil), 2, ErrTooManyGPUs, "17 GPUs are free, at most 16"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Choose(tc.top, tc.free, tc.n)
			if !errors.Is(err, tc.want) || !strings.Contains(fmt.Sprint(err), tc.msg) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.want, tc.msg)
			}
			if c.GPUs != nil {
				t.Fatalf("choice %v returned with an error", c.GPUs)
			}
		})
	}
	if _, err := Choose(bad, []int{0}, 1); !errors.Is(err, topology.ErrAsymmetric) {
		t.Fatalf("invalid topology error %v does not wrap the topology's cause", err)
	}
	if _, err := Choose(big, freeGPUs(MaxFree, nil), 8); err != nil {
		t.Fatalf("MaxFree free GPUs must be searched: %v", err)
	}
}

func BenchmarkChooseH100(b *testing.B) {
	f, err := os.Open(filepath.Join(fixturesDir, "05-dgx-h100.tsv"))
	if err != nil {
		b.Fatal(err)
	}
	top, err := topology.Parse(f)
	f.Close()
	if err != nil {
		b.Fatal(err)
	}
	free := freeGPUs(8, nil)
	for n := 1; n <= 8; n++ {
		b.Run("n="+strconv.Itoa(n), func(b *testing.B) {
			for b.Loop() {
				if _, err := Choose(top, free, n); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
