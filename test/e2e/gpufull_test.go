package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu/fake/fakecuda"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/shim"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestGfltRestoreOntoFullGPU restores a GPU checkpoint onto node2 while its GPUs are full and the
// checkpoint could not record its device memory (the source's NVML reports per-process memory as
// unavailable, so the shim's free-memory check in Create has nothing to compare and lets it
// through): the case in which the real driver's cuCheckpointProcessRestore can hang.
//
//   - the driver refuses (RestoreWhenFull "refuse"): berthctl restore fails naming the pid and
//     "out of memory", the task is killed, nothing is left on node2, the checkpoint is intact;
//   - the driver hangs (RestoreWhenFull "hang"): the shim gives up after gpu_restore_timeout_ms
//     with "GPU restore of pid N did not finish within 3s; GPU-node2-0 (0 bytes free) may be full",
//     kills the task, leaves nothing and keeps the checkpoint intact, well before the fake's own
//     60 s call timeout;
//
// and once the GPUs are free again the same checkpoint restores and the session continues.
func TestGfltRestoreOntoFullGPU(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	fltNoErr(t, src.GPU.SetProcessMemoryUnavailable(true))
	t.Cleanup(func() { fltNoErr(t, src.GPU.SetProcessMemoryUnavailable(false)) })
	w := gfltStart(t, ctx, src, "gflt-f-src", []string{"GPU-node1-0"}, "")
	w.requireTokens(t, ctx, 0, 20)
	const name = "gflt-f-ck"
	local := gfltCheckpoint(t, ctx, c, w, name)
	fltNoErr(t, src.GPU.SetProcessMemoryUnavailable(false))
	m, err := checkpoint.ReadManifest(local)
	fltNoErr(t, err)
	if m.GPU == nil || len(m.GPU.Devices) != 1 || m.GPU.Devices[0].MemoryUsed != 0 {
		t.Fatalf("checkpoint with per-process memory unavailable: GPU state %+v, want one GPU with 0 bytes recorded", m.GPU)
	}
	ck := gfltSend(t, ctx, c, local, dst.CheckpointRoot, name)
	sums := fltDigests(t, local)

	unfill := gfltFill(t, dst, "GPU-node2-0", "GPU-node2-1")
	t.Cleanup(func() { fltNoErr(t, dst.GPU.SetRestoreWhenFull(fakecuda.FullRefuse)) })
	undoCfg := gfltShimConfig(t, dst, "gpu_restore_timeout_ms = 3000\n")
	cases := []struct {
		mode string
		want []string
	}{
		{fakecuda.FullRefuse, []string{"GPU restore of pid ", "out of memory"}},
		{fakecuda.FullHang, []string{"GPU restore of pid ", "did not finish within 3s",
			"GPU-node2-0 (0 bytes free) may be full", "gpu_restore_timeout_ms"}},
	}
	for i, tc := range cases {
		t.Run(tc.mode, func(t *testing.T) {
			fltNoErr(t, dst.GPU.SetRestoreWhenFull(tc.mode))
			id := "gflt-f-r" + strconv.Itoa(i)
			before := fltDstState(t, ctx, dst)
			start := time.Now()
			out, err := gfltRestore(t, ctx, c, dst, id, name)
			took := time.Since(start)
			fltRequireErr(t, "berthctl restore onto a full GPU ("+tc.mode+")", out, err,
				append([]string{"restore " + id, "the task was killed, the checkpoint", "is intact"}, tc.want...)...)
			if took > 45*time.Second {
				t.Errorf("the restore took %v to fail: not bounded by gpu_restore_timeout_ms", took)
			}
			t.Logf("failed in %v", took.Round(time.Millisecond))
			if m := regexp.MustCompile(`GPU restore of pid (\d+)`).FindStringSubmatch(out + fmt.Sprint(err)); m != nil {
				pid, _ := strconv.Atoi(m[1])
				gfltWaitGone(t, pid)
			}
			if strings.Contains(out, "task must be stopped before deletion") {
				t.Errorf("the killed task was still running when berthctl removed it: %s", out)
			}
			fltRequireDstClean(t, ctx, dst, before, []string{id})
			gfltRequireIntact(t, ck, sums)
		})
	}
	unfill()
	undoCfg()
	fltNoErr(t, dst.GPU.SetRestoreWhenFull(fakecuda.FullRefuse))
	r := gfltRestoreOK(t, ctx, c, dst, "gflt-f-ok", name)
	if st, err := client.Stats(ctx, r.target); err != nil || st.GPUs != "GPU-node2-0" || st.WeightsChecksum != w.checksum {
		t.Errorf("restored workload: stats %+v (%v), want GPU GPU-node2-0 and weights %s", st, err, w.checksum)
	}
	r.requireTokens(t, ctx, 20, 40)
	w.requireRunning(t, ctx)
}

// TestGfltDeviceMapPrefersIdle restores a one-GPU checkpoint onto node2 while GPU-node2-0 (the
// lowest index, which the device map used to take) holds 64 MiB of another user's device memory
// and GPU-node2-1 is idle: the restore must map onto GPU-node2-1, say so in the shim's restore
// report, and `berthctl checkpoint inspect` must state the rule.
func TestGfltDeviceMapPrefersIdle(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-m-src", []string{"GPU-node1-0"}, "")
	w.requireTokens(t, ctx, 0, 20)
	const name = "gflt-m-ck"
	local := gfltCheckpoint(t, ctx, c, w, name)
	out, err := fltBerthctl(ctx, c, "checkpoint", "inspect", local)
	fltNoErr(t, err)
	if !strings.Contains(out, "idle ones before those in use") {
		t.Errorf("berthctl checkpoint inspect does not state the device map rule:\n%s", out)
	}
	gfltSend(t, ctx, c, local, dst.CheckpointRoot, name)

	dir, err := dst.GPU.Dir("GPU-node2-0")
	fltNoErr(t, err)
	busy := filepath.Join(dir, fakecuda.MemPrefix+"gflt-busy")
	f, err := os.OpenFile(busy, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	fltNoErr(t, err)
	fltNoErr(t, f.Truncate(64<<20))
	fltNoErr(t, f.Close())
	t.Cleanup(func() { os.Remove(busy) })

	r := gfltRestoreOK(t, ctx, c, dst, "gflt-m-r", name)
	if st, err := client.Stats(ctx, r.target); err != nil || st.GPUs != "GPU-node2-1" || st.WeightsChecksum != w.checksum {
		t.Errorf("restored workload: stats %+v (%v), want the idle GPU-node2-1 and weights %s", st, err, w.checksum)
	}
	r.requireTokens(t, ctx, 20, 30)
	var rep shim.RestoreReport
	fltNoErr(t, json.Unmarshal(fltRead(t, filepath.Join(dst.Dir, "state", "io.containerd.runtime.v2.task", node.Namespace, "gflt-m-r", shim.RestoreReportFile)), &rep))
	for _, want := range []string{"GPU-node1-0 -> GPU-node2-1 (idle)", "passed over: GPU-node2-0 (in use, 67108864 bytes used)"} {
		if !strings.Contains(rep.DeviceMapReason, want) {
			t.Errorf("restore report's device map reason %q does not say %q", rep.DeviceMapReason, want)
		}
	}
	w.requireRunning(t, ctx)
}

// TestGfltCheckGPUMemory: `berthctl checkpoint check --gpu fake` on node2 accepts a GPU
// checkpoint while node2's GPUs are free and refuses it, naming the GPU field, the most free
// device memory there and what the container held, once they are full (before anything is
// created or sent); free again, it accepts it.
func TestGfltCheckGPUMemory(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-k-src", []string{"GPU-node1-0"}, "")
	dir := gfltCheckpoint(t, ctx, c, w, "gflt-k-ck")
	m, err := checkpoint.ReadManifest(dir)
	fltNoErr(t, err)
	if m.GPU == nil || len(m.GPU.Devices) != 1 || m.GPU.Devices[0].MemoryUsed < gfltWeightsMiB<<20 {
		t.Fatalf("checkpoint's GPU state %+v, want one GPU with the weights' device memory recorded", m.GPU)
	}
	held := m.GPU.Devices[0].MemoryUsed
	check := func() (string, error) {
		return fltBerthctl(ctx, c, "-n", node.Namespace, "checkpoint", "check", "--on", dst.Socket, "--root", dst.CheckpointRoot,
			"--gpu", "fake", "--fake-gpu-root", dst.GPU.Root(), dir)
	}
	if out, err := check(); err != nil || !strings.Contains(out, "GPU memory)") {
		t.Errorf("checkpoint check onto free GPUs: %v\n%s", err, out)
	}

	before := fltDstState(t, ctx, dst)
	unfill := gfltFill(t, dst, "GPU-node2-0", "GPU-node2-1")
	out, err := check()
	fltRequireErr(t, "checkpoint check onto full GPUs", out, err, "refused: ",
		"gpu[0] device memory free ("+m.GPU.Devices[0].Name+") is 0 bytes at most, on GPU-node2-",
		fmt.Sprintf("needs >= %d bytes (what the container held on GPU-node1-0)", held),
		"free device memory on the destination's GPUs")
	fltRequireDstClean(t, ctx, dst, before, nil)

	unfill()
	if out, err := check(); err != nil {
		t.Errorf("checkpoint check once the GPUs are free again: %v\n%s", err, out)
	}
}

// TestGfltMigrateOntoFullGPURefused: migrate --gpu fake of a GPU container to a receiver whose
// node's GPUs are full (berthctl receive --gpu fake) is refused before the source is paused,
// naming the GPU field, the most free device memory there and what the source holds; nothing
// reaches the destination and the source keeps serving.
func TestGfltMigrateOntoFullGPURefused(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-mr-src", []string{"GPU-node1-0"}, "")
	rcv := ctStartReceive(t, ctx, c, dst.CheckpointRoot, "--gpu", "fake", "--fake-gpu-root", dst.GPU.Root())
	gfltFill(t, dst, "GPU-node2-0", "GPU-node2-1")
	before := fltDstState(t, ctx, dst)
	ev := fltWatch(t, ctx, src, w.id)
	out, err := fltBerthctl(ctx, c, "migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--receiver", rcv.addr, "--gpu", "fake", "--fake-gpu-root", src.GPU.Root(),
		"--id", "gflt-mr-moved", "--work-dir", t.TempDir(), "--name", "gflt-mr", w.id)
	fltRequireErr(t, "migrate onto a node whose GPUs are full", out, err, "nothing was paused",
		"gpu[0] device memory free (", ") is 0 bytes at most, on GPU-node2-", "(what the container held on GPU-node1-0)")
	ev.requireUntouched(t)
	fltRequireDstClean(t, ctx, dst, before, []string{"gflt-mr-moved"}, "gflt-mr")
	w.requireRunning(t, ctx)
}
