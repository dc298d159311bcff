package devicemap

import (
	"errors"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// topo builds a topology of n GPUs where every pair is SYS except those listed as NV links.
func topo(n int, nv map[[2]int]int) *topology.Topology {
	t := &topology.Topology{GPUs: make([]topology.GPU, n), Links: make([][]topology.Link, n)}
	for i := range n {
		t.GPUs[i] = topology.GPU{Index: i, GPUNUMA: -1}
		t.Links[i] = make([]topology.Link, n)
		for j := range n {
			switch {
			case i == j:
				t.Links[i][j] = topology.Self
			case nv[[2]int{min(i, j), max(i, j)}] > 0:
				t.Links[i][j] = topology.NV(nv[[2]int{min(i, j), max(i, j)}])
			default:
				t.Links[i][j] = topology.SYS
			}
		}
	}
	return t
}

func devs(name string, used ...uint64) []gpu.Device {
	var out []gpu.Device
	for i, u := range used {
		out = append(out, gpu.Device{Index: i, UUID: "GPU-d" + string(rune('0'+i)), Name: name, MemoryTotal: 80 << 30, MemoryUsed: u})
	}
	return out
}

func src(n int, name string, need uint64) []Source {
	var out []Source
	for i := range n {
		out = append(out, Source{UUID: "GPU-s" + string(rune('0'+i)), Name: name, MemoryUsed: need})
	}
	return out
}

func news(c Choice) string {
	var v []string
	for _, p := range c.Pairs {
		v = append(v, p.New)
	}
	return strings.Join(v, ",")
}

func TestChoose(t *testing.T) {
	const h = "H200"
	pair := [][]topology.Link{{topology.Self, topology.NV(4)}, {topology.NV(4), topology.Self}}
	sys := [][]topology.Link{{topology.Self, topology.SYS}, {topology.SYS, topology.Self}}
	nvPairs := map[[2]int]int{{0, 1}: 4, {2, 3}: 4}
	cases := []struct {
		name   string
		r      Request
		want   string
		reason []string
	}{
		{"idle over busy, one GPU", Request{GPUs: src(1, h, 1<<30), Devices: devs(h, 8<<20, 0)},
			"GPU-d1", []string{"GPU-s0 -> GPU-d1 (idle)", "passed over: GPU-d0 (in use, 8388608 bytes used)"}},
		{"lowest index among idle", Request{GPUs: src(1, h, 1<<30), Devices: devs(h, 0, 0)}, "GPU-d0", nil},
		{"busy when nothing idle fits", Request{GPUs: src(1, h, 1<<30), Devices: devs(h, 8<<20, 80<<30)}, "GPU-d0", nil},
		{"less loaded among busy (NVML counts reservations)", Request{GPUs: src(1, h, 1<<30), Devices: devs(h, 20<<30, 500<<20)}, "GPU-d1", nil},
		{"other model skipped", Request{GPUs: src(1, h, 1<<30), Devices: append(devs("B200", 0), gpu.Device{Index: 1, UUID: "GPU-h", Name: h, MemoryTotal: 80 << 30, MemoryUsed: 1})}, "GPU-h", nil},
		{"identity when the own GPUs are here", Request{GPUs: []Source{{UUID: "GPU-d1", Name: h}}, Devices: devs(h, 0, 5)},
			"GPU-d1", []string{"same UUIDs"}},
		{"NVLink pair kept", Request{GPUs: src(2, h, 1<<30), Links: pair, Devices: devs(h, 0, 0, 0, 0), Topology: topo(4, nvPairs)},
			"GPU-d0,GPU-d1", []string{"links kept: 0-1 NV4 (was NV4)"}},
		{"NVLink pair kept, busy pair avoided", Request{GPUs: src(2, h, 1<<30), Links: pair, Devices: devs(h, 8<<20, 0, 0, 0), Topology: topo(4, nvPairs)},
			"GPU-d2,GPU-d3", []string{"links kept: 0-1 NV4"}},
		{"links kept over idle", Request{GPUs: src(2, h, 1<<30), Links: pair, Devices: devs(h, 8<<20, 0, 0, 0), Topology: topo(4, map[[2]int]int{{0, 1}: 4})},
			"GPU-d0,GPU-d1", nil},
		{"no NVLink set: says so", Request{GPUs: src(2, h, 1<<30), Links: pair, Devices: devs(h, 0, 0, 0), Topology: topo(3, nil)},
			"GPU-d0,GPU-d1", []string{"links slower than on the source", "0-1 SYS (was NV4)"}},
		{"source over SYS, still prefers faster", Request{GPUs: src(2, h, 1<<30), Links: sys, Devices: devs(h, 0, 0, 0, 0), Topology: topo(4, map[[2]int]int{{2, 3}: 4})},
			"GPU-d2,GPU-d3", nil},
		{"order of the container kept on an NVLink set", Request{GPUs: src(2, h, 1<<30), Links: pair, Devices: devs(h, 0, 0, 0, 0), Topology: topo(4, map[[2]int]int{{1, 3}: 2})},
			"GPU-d1,GPU-d3", []string{"0-1 NV2 (was NV4)"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Choose(tc.r)
			if err != nil {
				t.Fatal(err)
			}
			if got := news(c); got != tc.want {
				t.Errorf("map onto %s, want %s (%s)", got, tc.want, c.Reason)
			}
			for _, w := range tc.reason {
				if !strings.Contains(c.Reason, w) {
					t.Errorf("reason %q does not say %q", c.Reason, w)
				}
			}
		})
	}
}

func TestChooseNoFit(t *testing.T) {
	_, err := Choose(Request{GPUs: src(1, "H200", 1<<30), Devices: devs("H200", 80<<30)})
	if !errors.Is(err, ErrNoFit) || !strings.Contains(err.Error(), "GPU-s0") {
		t.Errorf("full GPU: %v", err)
	}
	_, err = Choose(Request{GPUs: src(3, "H200", 1), Devices: devs("H200", 0, 0)})
	if !errors.Is(err, ErrNoFit) {
		t.Errorf("too few GPUs: %v", err)
	}
}

// TestChooseEightOfSixteen: the search stays fast on a 16-GPU node (two NVLink islands of 8)
// and keeps an 8-GPU NVLink set whole.
func TestChooseEightOfSixteen(t *testing.T) {
	nv := map[[2]int]int{}
	for a := range 16 {
		for b := a + 1; b < 16; b++ {
			if a/8 == b/8 {
				nv[[2]int{a, b}] = 18
			}
		}
	}
	links := topo(8, nil).Links
	for i := range 8 {
		for j := range 8 {
			if i != j {
				links[i][j] = topology.NV(18)
			}
		}
	}
	used := make([]uint64, 16)
	used[0] = 1 // island 0 is partly in use
	c, err := Choose(Request{GPUs: src(8, "H200", 1<<30), Links: links, Devices: devs("H200", used...), Topology: topo(16, nv)})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range c.Pairs {
		var i int
		for j, d := range devs("H200", used...) {
			if d.UUID == p.New {
				i = j
			}
		}
		if i < 8 {
			t.Fatalf("mapped onto %s, want island 1 (8-15): %s", news(c), c.Reason)
		}
	}
}
