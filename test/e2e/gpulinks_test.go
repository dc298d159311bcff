package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/shim"
	"github.com/berth-dev/berth/test/node"
)

// gfltLinks returns the nvidia-smi link matrix of n GPUs where the pairs in nv are joined by
// NV4 and every other pair by SYS.
func gfltLinks(n int, nv ...[2]int) [][]string {
	m := make([][]string, n)
	for i := range m {
		m[i] = make([]string, n)
		for j := range m[i] {
			m[i][j] = "SYS"
		}
		m[i][i] = "X"
	}
	for _, p := range nv {
		m[p[0]][p[1]], m[p[1]][p[0]] = "NV4", "NV4"
	}
	return m
}

// gfltFourGPUs gives n four fake GPUs with links until the test ends (then its own two again).
func gfltFourGPUs(t *testing.T, n *node.Node, links [][]string) {
	t.Helper()
	orig := n.GPU.Spec()
	gpus := append([]fake.GPUSpec(nil), orig.GPUs...)
	for i := len(gpus); i < 4; i++ {
		g := gpus[0]
		g.UUID = fmt.Sprintf("GPU-%s-%d", n.Name, i)
		gpus = append(gpus, g)
	}
	fltNoErr(t, n.GPU.SetGPUs(gpus, links))
	t.Cleanup(func() { fltNoErr(t, n.GPU.SetGPUs(orig.GPUs, orig.Links)) })
}

// TestGfltNVLinkDeviceMap moves a container that uses two NVLink peers (GPUs 0 and 1 of a
// 4-GPU source whose NVLink pairs are 0-1 and 2-3) onto a 4-GPU destination whose NVLink pairs
// are 0-2 and 1-3, all idle: the device map must keep the peers peers (0-2 or 1-3), not take the
// lowest indexes 0 and 1, which are joined by SYS only there; the restore report says so, and
// the session continues on the mapped GPUs.
func TestGfltNVLinkDeviceMap(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	gfltFourGPUs(t, src, gfltLinks(4, [2]int{0, 1}, [2]int{2, 3}))
	gfltFourGPUs(t, dst, gfltLinks(4, [2]int{0, 2}, [2]int{1, 3}))

	w := gfltStart(t, ctx, src, "gflt-nv-src", []string{"GPU-node1-0", "GPU-node1-1"}, "")
	w.requireTokens(t, ctx, 0, 20)
	const name = "gflt-nv-ck"
	local := gfltCheckpoint(t, ctx, c, w, name)
	m, err := checkpoint.ReadManifest(local)
	fltNoErr(t, err)
	if m.GPU == nil || len(m.GPU.Devices) != 2 {
		t.Fatalf("checkpoint of a 2-GPU container: GPU state %+v", m.GPU)
	}
	gfltSend(t, ctx, c, local, dst.CheckpointRoot, name)
	r := gfltRestoreOK(t, ctx, c, dst, "gflt-nv-r", name)
	r.requireTokens(t, ctx, 20, 30)

	var rep shim.RestoreReport
	fltNoErr(t, json.Unmarshal(fltRead(t, filepath.Join(dst.Dir, "state", "io.containerd.runtime.v2.task", node.Namespace, "gflt-nv-r", shim.RestoreReportFile)), &rep))
	got := map[string]string{}
	for _, p := range rep.DeviceMap {
		got[p.Old] = p.New
	}
	a, b := got["GPU-node1-0"], got["GPU-node1-1"]
	pair := a + "+" + b
	switch pair {
	case "GPU-node2-0+GPU-node2-2", "GPU-node2-2+GPU-node2-0", "GPU-node2-1+GPU-node2-3", "GPU-node2-3+GPU-node2-1":
	default:
		t.Errorf("device map %v (%s): the checkpoint's NVLink peers are not NVLink peers on the destination (its NV4 pairs: 0-2, 1-3)\nreason: %s", rep.DeviceMap, pair, rep.DeviceMapReason)
	}
	if !strings.Contains(strings.ToLower(rep.DeviceMapReason), "link") {
		t.Errorf("restore report's device map reason does not speak of the links: %q", rep.DeviceMapReason)
	}
	w.requireRunning(t, ctx)
}
