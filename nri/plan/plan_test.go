package plan_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/plan"
)

// dgxText is the GPU part of a DGX H100's `nvidia-smi topo -m` (NICs left out).
const dgxText = "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\tNUMA Affinity\n" +
	"GPU0\tX\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t0-55,112-167\t0\n" +
	"GPU1\tNV18\tX\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t0-55,112-167\t0\n" +
	"GPU2\tNV18\tNV18\tX\tNV18\tNV18\tNV18\tNV18\tNV18\t0-55,112-167\t0\n" +
	"GPU3\tNV18\tNV18\tNV18\tX\tNV18\tNV18\tNV18\tNV18\t0-55,112-167\t0\n" +
	"GPU4\tNV18\tNV18\tNV18\tNV18\tX\tNV18\tNV18\tNV18\t56-111,168-223\t1\n" +
	"GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\tX\tNV18\tNV18\t56-111,168-223\t1\n" +
	"GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tX\tNV18\t56-111,168-223\t1\n" +
	"GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tX\t56-111,168-223\t1\n"

func dgx(t *testing.T) *node.Node {
	top, err := topology.Parse(strings.NewReader(dgxText))
	if err != nil {
		t.Fatal(err)
	}
	n, err := node.FromTopology(top)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestPlan(t *testing.T) {
	n := dgx(t)
	res, err := plan.Plan(n, plan.Request{GPUs: 2, ExclusiveCPUs: 8, Policy: alloc.PolicySingleNUMANode, OccupiedGPUs: []int{0, 4}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(res)
	want := `{"gpus":[1,2],"cpus":[0,1,2,3,4,5,6,7],"exclusive":true,"numaNodes":[0],"mems":[0],"slowestLink":"NV18","policy":"single-numa-node","aligned":true,`
	if !strings.HasPrefix(string(b), want) {
		t.Fatalf("JSON %s\nwant prefix %s", b, want)
	}
	var text strings.Builder
	res.WriteText(&text)
	for _, line := range []string{"GPUs:        1-2 (slowest pair NV18)", "CPUs:        0-7 (exclusive, 8)", "cpuset.mems: 0"} {
		if !strings.Contains(text.String(), line) {
			t.Errorf("text lacks %q:\n%s", line, text.String())
		}
	}
	_, err = plan.Plan(n, plan.Request{GPUs: 2, Policy: alloc.PolicySingleNUMANode, OccupiedGPUs: []int{0, 1, 2, 4, 5, 6}})
	if !errors.Is(err, alloc.ErrUnplaceable) || !strings.Contains(err.Error(), "no NUMA node has 2 free GPUs; free now: node 0: 1 GPU (3), 112 CPUs; node 1: 1 GPU (7), 112 CPUs") {
		t.Fatalf("unplaceable: %v", err)
	}
	if _, err := plan.Plan(n, plan.Request{GPUs: 1, Policy: alloc.PolicyBestEffort, OccupiedGPUs: []int{9}}); !errors.Is(err, alloc.ErrInvalidRequest) {
		t.Fatalf("occupied GPU 9: %v", err)
	}
}

func TestDescribe(t *testing.T) {
	m := plan.Describe(dgx(t))
	if m.CPUs != 224 || len(m.NUMANodes) != 2 || len(m.GPUs) != 8 || m.Links[0][1] != "NV18" || m.Links[3][3] != "X" {
		t.Fatalf("model %+v", m)
	}
	var text strings.Builder
	m.WriteText(&text)
	if !strings.Contains(text.String(), "NUMA 1:  CPUs 56-111,168-223, memory unknown, distances [20 10]") ||
		!strings.Contains(text.String(), "GPU7\tNV18") {
		t.Fatalf("text:\n%s", text.String())
	}
}
