package alloc_test

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/node/nodetest"
)

var dgxNode *node.Node

// TestMain builds the DGX H100 node model once: writing a 224-CPU sysfs tree is slow on some
// disks, and the model is immutable, so every test shares it.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "alloc-test-")
	if err != nil {
		panic(err)
	}
	spec, topo := nodetest.DGXH100()
	if err := nodetest.WriteSysfs(dir, spec); err != nil {
		panic(err)
	}
	n, err := node.ReadSysfs(dir)
	if err == nil {
		dgxNode, err = n.WithGPUs(topo, nil)
	}
	os.RemoveAll(dir)
	if err != nil {
		panic(err)
	}
	os.Exit(m.Run())
}

func dgx(testing.TB) *node.Node { return dgxNode }

func newState(t testing.TB, n *node.Node, reserved ...int) *alloc.State {
	t.Helper()
	s, err := alloc.New(n, reserved)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ids(s string) []int {
	v, err := topology.ParseIDList(s)
	if err != nil {
		panic(err)
	}
	return v
}

func TestParsePolicy(t *testing.T) {
	for _, ok := range []string{"none", "best-effort", "restricted", "single-numa-node"} {
		if p, err := alloc.ParsePolicy(ok); err != nil || string(p) != ok {
			t.Errorf("ParsePolicy(%q) = %q, %v", ok, p, err)
		}
	}
	for _, bad := range []string{"", "Best-Effort", "single", "numa"} {
		if _, err := alloc.ParsePolicy(bad); !errors.Is(err, alloc.ErrUnknownPolicy) || !errors.Is(err, alloc.ErrInvalidRequest) {
			t.Errorf("ParsePolicy(%q) = %v, want ErrUnknownPolicy", bad, err)
		}
	}
}

// step is one call in a scripted sequence against one State.
type step struct {
	req      alloc.Request
	release  string
	wantGPUs string // "" none
	wantCPUs string
	wantMems string // "-" for unset
	aligned  bool
	err      error
	errText  string
	updates  map[string]string // container id -> new cpuset
}

func runSteps(t *testing.T, s *alloc.State, steps []step) {
	t.Helper()
	for i, st := range steps {
		if st.release != "" {
			ups, ok := s.Release(st.release)
			if !ok {
				t.Fatalf("step %d: release %s: not placed", i, st.release)
			}
			checkUpdates(t, i, ups, st.updates)
			continue
		}
		p, ups, err := s.Allocate(st.req)
		if st.err != nil {
			if !errors.Is(err, st.err) || !strings.Contains(err.Error(), st.errText) {
				t.Fatalf("step %d (%s): err = %v, want %v containing %q", i, st.req.ID, err, st.err, st.errText)
			}
			if _, placed := s.Placement(st.req.ID); placed {
				t.Fatalf("step %d: failed request %s left a placement", i, st.req.ID)
			}
			continue
		}
		if err != nil {
			t.Fatalf("step %d (%s): %v", i, st.req.ID, err)
		}
		if got := topology.FormatIDList(p.GPUs); got != st.wantGPUs {
			t.Errorf("step %d (%s): GPUs %q, want %q (%s)", i, st.req.ID, got, st.wantGPUs, p.Reason)
		}
		if got := topology.FormatIDList(p.CPUs); got != st.wantCPUs {
			t.Errorf("step %d (%s): CPUs %q, want %q (%s)", i, st.req.ID, got, st.wantCPUs, p.Reason)
		}
		mems := "-"
		if p.Mems != nil {
			mems = topology.FormatIDList(p.Mems)
		}
		if mems != st.wantMems {
			t.Errorf("step %d (%s): mems %q, want %q", i, st.req.ID, mems, st.wantMems)
		}
		if p.Aligned != st.aligned {
			t.Errorf("step %d (%s): aligned %v, want %v (%s; %v)", i, st.req.ID, p.Aligned, st.aligned, p.Reason, p.Warnings)
		}
		checkUpdates(t, i, ups, st.updates)
	}
}

func checkUpdates(t *testing.T, i int, ups []alloc.Update, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for _, u := range ups {
		got[u.ID] = topology.FormatIDList(u.CPUs)
	}
	if len(got) != len(want) {
		t.Errorf("step %d: updates %v, want %v", i, got, want)
		return
	}
	for id, c := range want {
		if got[id] != c {
			t.Errorf("step %d: update of %s = %q, want %q", i, id, got[id], c)
		}
	}
}

func req(id string, gpus, cpus int, policy alloc.Policy) alloc.Request {
	return alloc.Request{ID: id, Name: "container default/" + id, GPUs: gpus, ExclusiveCPUs: cpus, Policy: policy}
}

const (
	none   = alloc.PolicyNone
	best   = alloc.PolicyBestEffort
	strict = alloc.PolicyRestricted
	single = alloc.PolicySingleNUMANode
)

func TestAllocateDGXH100(t *testing.T) {
	tests := []struct {
		name  string
		steps []step
	}{
		{"two GPUs and eight CPUs on one NUMA node, SMT siblings together", []step{
			{req: req("a", 2, 8, single), wantGPUs: "0-1", wantCPUs: "0-3,112-115", wantMems: "0", aligned: true},
			// best fit: the next 2 GPUs stay on node 0 (2 left there) rather than break node 1's 4.
			{req: req("b", 2, 8, single), wantGPUs: "2-3", wantCPUs: "4-7,116-119", wantMems: "0", aligned: true},
			{req: req("c", 4, 0, single), wantGPUs: "4-7", wantCPUs: "56-111,168-223", wantMems: "1", aligned: true},
			{req: req("d", 1, 0, single), err: alloc.ErrUnplaceable,
				errText: "cannot place container default/d under policy single-numa-node: no NUMA node has 1 free GPU; free now: node 0: 0 GPUs, 96 CPUs; node 1: 0 GPUs, 112 CPUs"},
		}},
		{"eight GPUs need both NUMA nodes", []step{
			{req: req("a", 8, 0, single), err: alloc.ErrUnplaceable, errText: "no single NUMA node can hold 8 free GPUs even when empty"},
			{req: req("a", 8, 0, strict), wantGPUs: "0-7", wantCPUs: "0-223", wantMems: "0-1", aligned: true},
		}},
		{"fragmented: restricted refuses, best-effort spans sockets and says so", []step{
			{req: req("a", 3, 0, single), wantGPUs: "0-2", wantCPUs: "0-55,112-167", wantMems: "0", aligned: true},
			{req: req("b", 3, 0, single), wantGPUs: "4-6", wantCPUs: "56-111,168-223", wantMems: "1", aligned: true},
			{req: req("c", 2, 4, strict), err: alloc.ErrUnplaceable,
				errText: "no NUMA node has 2 free GPUs and 4 free CPUs together; free now: node 0: 1 GPU (3), 112 CPUs; node 1: 1 GPU (7), 112 CPUs"},
			{req: req("c", 2, 4, best), wantGPUs: "3,7", wantCPUs: "0-1,112-113", wantMems: "0-1", aligned: false,
				updates: map[string]string{"a": "2-55,114-167"}},
		}},
		{"shared container follows its GPUs' node; exclusive CPUs shrink its pool", []step{
			{req: req("s", 1, 0, best), wantGPUs: "0", wantCPUs: "0-55,112-167", wantMems: "0", aligned: true},
			// CPU-only: best fit towards the node with fewer free GPUs (node 0: 3, node 1: 4).
			{req: req("e", 0, 2, best), wantCPUs: "0,112", wantMems: "0", aligned: true,
				updates: map[string]string{"s": "1-55,113-167"}},
			{req: req("f", 2, 4, best), wantGPUs: "1-2", wantCPUs: "1-2,113-114", wantMems: "0", aligned: true,
				updates: map[string]string{"s": "3-55,115-167"}},
			{release: "f", updates: map[string]string{"s": "1-55,113-167"}},
		}},
		{"policy none: no mems, GPUs by links only", []step{
			{req: req("a", 2, 2, none), wantGPUs: "0-1", wantCPUs: "0,112", wantMems: "-", aligned: false},
			{req: req("b", 0, 0, none), wantCPUs: "1-111,113-223", wantMems: "-", aligned: true},
		}},
		{"too large", []step{
			{req: req("a", 9, 0, best), err: alloc.ErrUnplaceable, errText: "it asks for 9 GPUs; this node has 8 GPUs"},
			{req: req("a", 0, 224, best), err: alloc.ErrUnplaceable, errText: "this node can give at most 223 (224 online, 0 reserved, 1 always kept shared)"},
			{req: req("a", 0, 223, best), wantCPUs: "0-222", wantMems: "0-1", aligned: true},
			{req: req("b", 0, 1, best), err: alloc.ErrUnplaceable, errText: "0 CPUs can be given exclusively now, 1 requested"},
			{req: req("c", 0, 0, best), wantCPUs: "223", wantMems: "-", aligned: true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runSteps(t, newState(t, dgx(t)), tt.steps)
		})
	}
}

func TestExclusiveCPUsSMT(t *testing.T) {
	// one socket, 4 cores x 2 threads, Intel numbering: core c is CPUs c and c+4.
	n := nodetest.Build(t, nodetest.Spec{Sockets: 1, NUMAPerSocket: 1, CoresPerNUMA: 4, Threads: 2, MemPerNUMA: 1 << 20}, nil)
	runSteps(t, newState(t, n, 0), []step{
		// CPU 0 is reserved: core 0 is not whole, so whole cores 1 and 2 come first.
		{req: req("a", 0, 4, best), wantCPUs: "1-2,5-6", wantMems: "0", aligned: true},
		// odd: one thread of the partly used core 0 (CPU 4) before splitting core 3.
		{req: req("b", 0, 1, best), wantCPUs: "4", wantMems: "0", aligned: true},
		{req: req("c", 0, 2, best), wantCPUs: "3,7", wantMems: "0", aligned: true},
		{req: req("d", 0, 1, best), err: alloc.ErrUnplaceable, errText: "the node does not have 1 free CPU"},
		{req: req("shared", 0, 0, best), wantCPUs: "0", wantMems: "-", aligned: true},
		{release: "a", updates: map[string]string{"shared": "0-2,5-6"}},
	})
}

func TestAssignedGPUs(t *testing.T) {
	n := dgx(t)
	s := newState(t, n)
	p, _, err := s.Allocate(alloc.Request{ID: "x", AssignedGPUs: []int{5, 4, 5}, ExclusiveCPUs: 2, Policy: best})
	if err != nil {
		t.Fatal(err)
	}
	if topology.FormatIDList(p.GPUs) != "4-5" || p.ChosenGPUs || topology.FormatIDList(p.Mems) != "1" || topology.FormatIDList(p.CPUs) != "56,168" {
		t.Fatalf("placement %+v", p)
	}
	if len(p.Warnings) != 0 || p.Misaligned != nil {
		t.Errorf("NV18 pair warned: %v %v", p.Warnings, p.Misaligned)
	}
	// A GPU someone else gave that berth already booked: conflict, nothing booked.
	if _, _, err := s.Allocate(alloc.Request{ID: "y", AssignedGPUs: []int{5}, Policy: best}); !errors.Is(err, alloc.ErrConflict) ||
		!strings.Contains(err.Error(), "GPU 5, which it was given, is held by container x") {
		t.Fatalf("double booking: %v", err)
	}
	// Not link-adjacent: a SYS pair on a node that has NVLink pairs.
	top := nodetest.Topology(nodetest.Spec{Sockets: 2, NUMAPerSocket: 1, CoresPerNUMA: 2, Threads: 1}, 2, func(i, j int) topology.Link {
		if i/2 == j/2 {
			return topology.NV(4)
		}
		return topology.SYS
	})
	n2 := nodetest.Build(t, nodetest.Spec{Sockets: 2, NUMAPerSocket: 1, CoresPerNUMA: 2, Threads: 1, MemPerNUMA: 1 << 20}, top)
	s2 := newState(t, n2)
	p, _, err = s2.Allocate(alloc.Request{ID: "z", AssignedGPUs: []int{1, 2}, Policy: best})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Warnings) != 2 || !strings.Contains(p.Warnings[0], "not link-adjacent: slowest pair SYS (GPU1-GPU2)") ||
		!strings.Contains(p.Warnings[1], "GPUs 1-2 hang off NUMA nodes 0-1") {
		t.Errorf("warnings %v", p.Warnings)
	}
	if strings.Join(p.Misaligned, " ") != alloc.MisalignedLinks+" "+alloc.MisalignedNUMA {
		t.Errorf("misaligned %v, want links and NUMA", p.Misaligned)
	}
	if topology.FormatIDList(p.Mems) != "0-1" {
		t.Errorf("mems %v, want both nodes of the assigned GPUs", p.Mems)
	}
	// single-numa-node refuses GPUs given on two nodes.
	if _, _, err := s2.Allocate(alloc.Request{ID: "w", AssignedGPUs: []int{0, 3}, Policy: single}); !errors.Is(err, alloc.ErrUnplaceable) ||
		!strings.Contains(err.Error(), "no single NUMA node can hold its GPUs 0,3 even when empty") {
		t.Errorf("single-numa-node with GPUs on two nodes: %v", err)
	}
}

func TestRequestErrors(t *testing.T) {
	s := newState(t, dgx(t))
	if _, _, err := s.Allocate(req("dup", 1, 0, best)); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		r    alloc.Request
		want error
		text string
	}{
		{"no id", alloc.Request{Policy: best}, alloc.ErrInvalidRequest, "no container id"},
		{"duplicate id", req("dup", 1, 0, best), alloc.ErrConflict, "already placed"},
		{"negative GPUs", req("a", -1, 0, best), alloc.ErrInvalidRequest, "-1 GPUs"},
		{"negative CPUs", req("a", 0, -2, best), alloc.ErrInvalidRequest, "-2 exclusive CPUs"},
		{"unknown policy", req("a", 1, 0, "numa-please"), alloc.ErrUnknownPolicy, `"numa-please"`},
		{"empty policy", req("a", 1, 0, ""), alloc.ErrUnknownPolicy, `""`},
		{"both", alloc.Request{ID: "a", GPUs: 1, AssignedGPUs: []int{2}, Policy: best}, alloc.ErrInvalidRequest, "already has GPUs 2 and asks berth for 1 more"},
		{"no such GPU", alloc.Request{ID: "a", AssignedGPUs: []int{8}, Policy: best}, alloc.ErrInvalidRequest, "GPU 8, but this node has 8 GPUs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, _, err := s.Allocate(tt.r); !errors.Is(err, tt.want) || !strings.Contains(err.Error(), tt.text) {
				t.Fatalf("Allocate = %v, want %v containing %q", err, tt.want, tt.text)
			}
			if s.Len() != 1 {
				t.Fatalf("a failed request changed the state: %d containers", s.Len())
			}
		})
	}
	if _, err := alloc.New(dgx(t), []int{999}); !errors.Is(err, alloc.ErrInvalidRequest) {
		t.Errorf("reserved offline CPU: %v", err)
	}
}

func TestAdopt(t *testing.T) {
	s := newState(t, dgx(t))
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(s.Adopt(alloc.Placement{ID: "a", CPUs: ids("0-1"), Exclusive: true, GPUs: []int{0}, Mems: []int{0}, NUMANodes: []int{0}, Policy: best}, true))
	must(s.Adopt(alloc.Placement{ID: "b", CPUs: ids("0-223"), GPUs: []int{1}}, false)) // unpinned, foreign
	for _, bad := range []struct {
		p    alloc.Placement
		want error
	}{
		{alloc.Placement{ID: "a"}, alloc.ErrConflict},
		{alloc.Placement{ID: "c", CPUs: ids("1-2"), Exclusive: true}, alloc.ErrConflict},
		{alloc.Placement{ID: "c", GPUs: []int{1}}, alloc.ErrConflict},
		{alloc.Placement{ID: "c", GPUs: []int{8}}, alloc.ErrInvalidRequest},
		{alloc.Placement{ID: "c", CPUs: []int{300}}, alloc.ErrInvalidRequest},
	} {
		if err := s.Adopt(bad.p, true); !errors.Is(err, bad.want) {
			t.Errorf("Adopt(%+v) = %v, want %v", bad.p, err, bad.want)
		}
	}
	if s.Len() != 2 || s.CPUOwner(1) != "a" || s.CPUOwner(2) != "" || s.GPUOwner(1) != "b" {
		t.Fatalf("state after adopt: len %d, CPU1 %q CPU2 %q GPU1 %q", s.Len(), s.CPUOwner(1), s.CPUOwner(2), s.GPUOwner(1))
	}
	// The next allocation sees the adopted ones and produces no update for the foreign one.
	p, ups, err := s.Allocate(req("c", 2, 2, best))
	must(err)
	if slices.Contains(p.GPUs, 0) || slices.Contains(p.GPUs, 1) || slices.Contains(p.CPUs, 0) || slices.Contains(p.CPUs, 1) || len(ups) != 0 {
		t.Fatalf("allocation after adopt: %+v, updates %v", p, ups)
	}
}

// TestManyContainersNoDoubleBooking allocates and releases in a long deterministic stream and
// checks after every step that no CPU or GPU has two holders and that the free counts add up.
func TestManyContainersNoDoubleBooking(t *testing.T) {
	n := dgx(t)
	s := newState(t, n, 0, 112)
	var live []string
	policies := []alloc.Policy{none, best, strict, single}
	for i := range 2000 {
		id := fmt.Sprintf("c%d", i)
		if len(live) > 0 && (i%3 == 0 || len(live) > 60) {
			k := (i * 7) % len(live)
			s.Release(live[k])
			live = slices.Delete(live, k, k+1)
		} else {
			r := req(id, (i/5)%3, (i*13)%9, policies[i%4])
			if _, _, err := s.Allocate(r); err == nil {
				live = append(live, id)
			} else if !errors.Is(err, alloc.ErrUnplaceable) {
				t.Fatalf("step %d: %v", i, err)
			}
		}
		cpuHolders := map[int]string{}
		gpuHolders := map[int]string{}
		for _, id := range live {
			p, ok := s.Placement(id)
			if !ok {
				t.Fatalf("step %d: %s lost", i, id)
			}
			for _, g := range p.GPUs {
				if h, dup := gpuHolders[g]; dup {
					t.Fatalf("step %d: GPU %d held by %s and %s", i, g, h, id)
				}
				gpuHolders[g] = id
			}
			if p.Exclusive {
				for _, c := range p.CPUs {
					if h, dup := cpuHolders[c]; dup {
						t.Fatalf("step %d: CPU %d held by %s and %s", i, c, h, id)
					}
					if c == 0 || c == 112 {
						t.Fatalf("step %d: reserved CPU %d given to %s", i, c, id)
					}
					cpuHolders[c] = id
				}
			}
		}
		for _, id := range live {
			if p, _ := s.Placement(id); !p.Exclusive {
				for _, c := range p.CPUs {
					if h, ok := cpuHolders[c]; ok {
						t.Fatalf("step %d: shared %s runs on %s's exclusive CPU %d", i, id, h, c)
					}
				}
			}
		}
	}
}

// TestHeldByNUMA: what containers hold per NUMA node follows allocations, adoptions and
// releases, and GPUs whose affinity spans nodes are counted apart.
func TestHeldByNUMA(t *testing.T) {
	s := newState(t, dgx(t), 0, 112)
	h := func(numa, excl, shared, gpus, mems int) alloc.Held {
		return alloc.Held{NUMA: numa, ExclusiveCPUs: excl, SharedCPUs: shared, GPUs: gpus, MemContainers: mems}
	}
	steps := []struct {
		name string
		do   func() error
		want []alloc.Held
	}{
		{"empty", func() error { return nil }, []alloc.Held{h(0, 0, 112, 0, 0), h(1, 0, 112, 0, 0)}},
		{"2 GPUs, 4 CPUs on node 0", func() error { _, _, err := s.Allocate(req("a", 2, 4, best)); return err },
			[]alloc.Held{h(0, 4, 108, 2, 1), h(1, 0, 112, 0, 0)}},
		{"4 GPUs, 8 CPUs on node 1", func() error { _, _, err := s.Allocate(req("b", 4, 8, single)); return err },
			[]alloc.Held{h(0, 4, 108, 2, 1), h(1, 8, 104, 4, 1)}},
		{"shared, unaligned", func() error { _, _, err := s.Allocate(req("c", 0, 0, best)); return err },
			[]alloc.Held{h(0, 4, 108, 2, 1), h(1, 8, 104, 4, 1)}},
		{"adopted, memory on both nodes", func() error {
			return s.Adopt(alloc.Placement{ID: "d", CPUs: ids("50-51"), Exclusive: true, Mems: []int{0, 1}, NUMANodes: []int{0, 1}}, true)
		}, []alloc.Held{h(0, 6, 106, 2, 2), h(1, 8, 104, 4, 2)}},
		{"release a", func() error { s.Release("a"); return nil }, []alloc.Held{h(0, 2, 110, 0, 1), h(1, 8, 104, 4, 2)}},
		{"release the rest", func() error { s.Release("b"); s.Release("c"); s.Release("d"); return nil },
			[]alloc.Held{h(0, 0, 112, 0, 0), h(1, 0, 112, 0, 0)}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := s.HeldByNUMA(); !slices.Equal(got, st.want) {
			t.Fatalf("%s: HeldByNUMA = %+v, want %+v", st.name, got, st.want)
		}
	}

	// A GPU close to both NUMA nodes of a 2-node machine is reported under NUMA -1.
	spec := nodetest.Spec{Sockets: 2, NUMAPerSocket: 1, CoresPerNUMA: 2, Threads: 1, MemPerNUMA: 1 << 20}
	topo := nodetest.Topology(spec, 1, func(int, int) topology.Link { return topology.NV(4) })
	topo.GPUs[1].NUMA, topo.GPUs[1].CPUs = []int{0, 1}, ids("0-3")
	s = newState(t, nodetest.Build(t, spec, topo))
	if _, _, err := s.Allocate(alloc.Request{ID: "e", AssignedGPUs: []int{1}, Policy: none}); err != nil {
		t.Fatal(err)
	}
	want := []alloc.Held{h(0, 0, 2, 0, 0), h(1, 0, 2, 0, 0), h(-1, 0, 0, 1, 0)}
	if got := s.HeldByNUMA(); !slices.Equal(got, want) {
		t.Fatalf("spread GPU: HeldByNUMA = %+v, want %+v", got, want)
	}
}
