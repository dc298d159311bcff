package e2e

// GPU fault tests on the real stack with berth's faithful fake GPU (gpu/fake): the ways the GPU
// steps of a checkpoint or a restore go wrong that an operator will meet, each asserting that
//   - the error names the cause: the PID and the step, or the field and both values,
//   - the workload afterwards: still serving the tokens of an uninterrupted run, its CUDA state
//     RUNNING (unlocked) as the fake driver reports it, its device memory back on its GPU,
//   - a refused or failed restore creates nothing on the destination (no container, no task, no
//     runc state) and leaves the checkpoint intact: it still verifies, and it restores once the
//     node is put back.
//
// The workload is `infer -gpu` with 8 MiB of weights on node1's GPU-node1-0 (a few on both of
// node1's GPUs). Container ids and checkpoint names start with "gflt-". Every change to a node
// (its fake GPU inventory and files, its shim configuration, a container's CRIU configuration)
// is undone when the test ends, and device memory files left by processes killed in a test are
// removed then, as a driver frees the memory of a dead process.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

const (
	// gfltWeightsMiB and gfltSeed configure the workload; gfltPrompt is its session's prompt.
	gfltWeightsMiB = 8
	gfltSeed       = 7
	gfltPrompt     = "the gpu faults story"
	gfltSession    = "gflt-session"
	// gfltDriver and gfltCUDA are the fake nodes' versions (test/node).
	gfltDriver = "580.65.06"
	gfltCUDA   = "12.8"
	gfltModel  = "Fake H200"
	// gfltLockTimeout is the shim's GPU lock timeout in the busy-workload test.
	gfltLockTimeout = 1500 * time.Millisecond
	// gfltHolderRef is the image of the busy fake CUDA program (gfltHolderSource).
	gfltHolderRef = "localhost/berth/gflt-holder:test"
)

// ---------------------------------------------------------------------------------------------
// 1. CRIU fails after the GPU checkpoint.

// TestGfltCRIUFailsAfterGPUCheckpoint breaks the container's CRIU configuration file (the one
// the shim writes at Create and runc hands to CRIU) so that the dump fails after the shim locked
// the workload's CUDA process and checkpointed its device memory into host memory: a line CRIU
// rejects (it refuses the whole request), and a pre-dump action script that fails (CRIU's dump
// itself fails, its log says why). berthctl migrate must fail naming CRIU; the shim must have
// restored and unlocked the process: the fake driver reports it RUNNING, its device memory is
// back in node1's GPU directory (new files of the same size: it was really checkpointed and
// restored), the task runs (resumed, not left paused), the session continues with the tokens
// of an uninterrupted run and node2 holds nothing. Once the file is repaired, a checkpoint
// succeeds and the workload still serves.
func TestGfltCRIUFailsAfterGPUCheckpoint(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-criu", []string{"GPU-node1-0"}, "")
	w.requireTokens(t, ctx, 0, 20)

	conf := filepath.Join(src.Dir, "state", "io.containerd.runtime.v2.task", node.Namespace, w.id, "berth-criu.conf")
	orig := fltRead(t, conf)
	repair := func() { fltNoErr(t, os.WriteFile(conf, orig, 0o600)) }
	t.Cleanup(repair)

	cases := []struct {
		name, line string
		want       []string
	}{
		// CRIU refuses a request whose configuration it cannot parse (EBADRQC), before it logs
		{"config-rejected", "gflt-no-such-criu-option", []string{"criu failed: type DUMP errno 56"}},
		{"dump-fails", "action-script /bin/false", []string{"criu failed: type DUMP", "CRIU says:", "Pre dump script failed"}},
	}
	tokens := 20
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			memBefore := w.mem(t)
			fltNoErr(t, os.WriteFile(conf, append(slices.Clone(orig), []byte(tc.line+"\n")...), 0o600))
			defer repair()
			before := fltDstState(t, ctx, dst)
			ev := fltWatch(t, ctx, src, w.id)
			name, target := "gflt-criu-"+tc.name, "gflt-criu-moved"
			out, err := fltBerthctl(ctx, c, "migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
				"--root", dst.CheckpointRoot, "--id", target, "--work-dir", t.TempDir(), "--name", name, w.id)
			fltRequireErr(t, "berthctl migrate", out, err, append([]string{"migrate " + w.id, "checkpoint " + w.id}, tc.want...)...)

			ev.requireResumed(t)
			w.requireRunning(t, ctx)
			memAfter := w.mem(t)
			if memAfter.total != memBefore.total || len(memAfter.names) != len(memBefore.names) {
				t.Errorf("device memory of %s on GPU-node1-0 after the failed dump: %d files, %d bytes; before: %d files, %d bytes",
					w.id, len(memAfter.names), memAfter.total, len(memBefore.names), memBefore.total)
			}
			if slices.Equal(memAfter.names, memBefore.names) {
				t.Errorf("device memory files of %s unchanged (%v): the GPU state was not checkpointed before CRIU ran", w.id, memAfter.names)
			}
			w.requireTokens(t, ctx, tokens, tokens+10)
			tokens += 10
			fltRequireDstClean(t, ctx, dst, before, []string{target}, name)
		})
	}

	// repaired, the same container checkpoints again: nothing of the failed attempts is left
	repair()
	ck := filepath.Join(t.TempDir(), "gflt-criu-again")
	gfltCheckpointOK(t, ctx, c, src, w.id, ck, "checkpoint after the CRIU configuration was repaired")
	w.requireRunning(t, ctx)
	w.requireTokens(t, ctx, tokens, tokens+20)
}

// ---------------------------------------------------------------------------------------------
// 2. The workload holds the GPU longer than the lock timeout.

// gfltHolderSource is a fake CUDA program whose one GPU call runs for -hold (a long kernel),
// while it keeps doing short GPU calls, each checking its device memory, and printing a tick.
const gfltHolderSource = `// Command gflt-holder is generated by berth's test/e2e/gpufaults_test.go: a fake CUDA process
// (gpu/fake/fakecuda) whose one GPU call runs for -hold, so that a checkpoint's GPU lock times out.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

func main() {
	hold := flag.Duration("hold", 8*time.Second, "duration of the one long GPU call")
	flag.Parse()
	c, err := fakecuda.Init()
	if err != nil {
		fmt.Println("holder:", err)
		os.Exit(1)
	}
	mem, err := c.Malloc(0, 1<<20)
	if err != nil {
		fmt.Println("holder:", err)
		os.Exit(1)
	}
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	started := make(chan struct{})
	go func() {
		_ = c.Do(func() {
			close(started)
			time.Sleep(*hold)
		})
		fmt.Println("holder released")
	}()
	<-started
	fmt.Println("holder holding")
	for i := 1; ; i++ {
		bad := -1
		if err := c.Do(func() {
			for j := range mem {
				if mem[j] != byte(j*7) {
					bad = j
					return
				}
			}
		}); err != nil {
			fmt.Println("holder:", err)
			os.Exit(1)
		}
		if bad >= 0 {
			fmt.Println("holder: device memory corrupt at byte", bad)
			os.Exit(1)
		}
		fmt.Println("holder tick", i, time.Now().Format("15:04:05.000"))
		time.Sleep(100 * time.Millisecond)
	}
}
`

// TestGfltLockTimeoutBusy runs a fake CUDA program whose GPU call lasts 8 s on a node whose shim
// locks with a 1.5 s timeout, and checkpoints it mid-call: the checkpoint must fail naming the
// PID, the GPU lock and the timeout; the task runs (resumed), the process is RUNNING (not left
// locked) and keeps doing GPU work; once the long call ended, the same container checkpoints.
func TestGfltLockTimeoutBusy(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src := c.Nodes[0]
	gfltReclaim(t, c)
	tar := filepath.Join(node.RepoRoot(), "_output", "images", "gflt-holder.tar")
	gfltBuildHolder(t, ctx, tar)
	fltNoErr(t, src.Import(ctx, node.Namespace, tar))
	t.Cleanup(func() { _, _ = src.Ctr(context.Background(), "-n", node.Namespace, "images", "rm", gfltHolderRef) })

	// the shim reads its configuration when it starts: a container created now gets the short
	// timeout, and the node's configuration is put back at once
	restoreCfg := gfltShimConfig(t, src, fmt.Sprintf("gpu_lock_timeout_ms = %d\n", gfltLockTimeout.Milliseconds()))
	const id = "gflt-lock"
	_ = src.Remove(ctx, id)
	log := filepath.Join(src.Dir, id+".log")
	_ = os.Remove(log)
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: gfltHolderRef, GPUs: []string{"GPU-node1-0"}, LogPath: log})
	restoreCfg()
	t.Cleanup(func() { _ = src.Remove(context.Background(), id) })
	fltNoErr(t, err)
	diag := func() string { return gfltProcState(int(pid)) }
	gfltWaitLog(t, log, "holder holding", 30*time.Second, diag)

	drv := &fake.Driver{Node: src.GPU}
	ev := fltWatch(t, ctx, src, id)
	ck := filepath.Join(t.TempDir(), "gflt-lock-ck")
	start := time.Now()
	out, err := fltBerthctl(ctx, c, "checkpoint", "create", "-a", src.Socket, "-n", node.Namespace, id, ck)
	took := time.Since(start)
	fltRequireErr(t, "berthctl checkpoint create", out, err, "checkpoint "+id,
		fmt.Sprintf("GPU lock of pid %d (timeout %v)", pid, gfltLockTimeout),
		fmt.Sprintf("lock: 1 GPU calls still running after %v", gfltLockTimeout), gpu.ErrTimeout.Error())
	if took < gfltLockTimeout {
		t.Errorf("checkpoint failed after %v, before the %v lock timeout", took, gfltLockTimeout)
	}
	if _, err := os.Stat(ck); err == nil {
		t.Errorf("failed checkpoint left %s", ck)
	}
	ev.requireResumed(t)
	if p, st, err := src.TaskPID(ctx, id); err != nil || st != containerd.Running || p != pid {
		t.Fatalf("task %s after the lock timeout: pid %d status %q (%v), want pid %d running", id, p, st, err, pid)
	}
	if st, err := drv.State(int(pid)); err != nil || st != gpu.StateRunning {
		t.Errorf("fake driver: pid %d is %v (%v) after the lock timeout, want running (unlocked)", pid, st, err)
	}
	ticks := gfltCount(t, log, "holder tick")
	time.Sleep(time.Second)
	if now := gfltCount(t, log, "holder tick"); now <= ticks {
		t.Errorf("the workload did no GPU work in the second after the lock timeout (%d ticks, then %d)", ticks, now)
	}

	// once the long call ended, the lock succeeds: nothing of the timed-out lock is left
	gfltWaitLog(t, log, "holder released", 30*time.Second, diag)
	gfltCheckpointOK(t, ctx, c, src, id, ck, "checkpoint after the long GPU call ended")
	if st, err := drv.State(int(pid)); err != nil || st != gpu.StateRunning {
		t.Errorf("fake driver: pid %d is %v (%v) after a checkpoint that left it running, want running", pid, st, err)
	}
	ticks = gfltCount(t, log, "holder tick")
	time.Sleep(500 * time.Millisecond)
	if now := gfltCount(t, log, "holder tick"); now <= ticks {
		t.Errorf("the workload does no GPU work after its checkpoint (%d ticks, then %d)", ticks, now)
	}
	if b := fltRead(t, log); strings.Contains(string(b), "holder:") {
		t.Errorf("the workload failed:\n%s", b)
	}
}

// gfltBuildHolder writes gfltHolderSource into the module (under _output, ignored by git and by
// ./... patterns) and builds it into the image gfltHolderRef at tar.
func gfltBuildHolder(t *testing.T, ctx context.Context, tar string) {
	t.Helper()
	dir := filepath.Join(node.RepoRoot(), "_output", "gflt-holder")
	fltNoErr(t, os.MkdirAll(dir, 0o755))
	fltNoErr(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(gfltHolderSource), 0o644))
	if _, err := image.BuildGoImage(ctx, node.RepoRoot(), "./_output/gflt-holder", gfltHolderRef, tar, image.Config{}); err != nil {
		t.Fatal(err)
	}
}

// gfltShimConfig appends extra to n's shim configuration file and returns the function that puts
// the original back (also run when the test ends).
func gfltShimConfig(t *testing.T, n *node.Node, extra string) func() {
	t.Helper()
	p := filepath.Join(n.Dir, "shim.toml")
	orig := fltRead(t, p)
	fltNoErr(t, os.WriteFile(p, append(slices.Clone(orig), []byte(extra)...), 0o644))
	var once sync.Once
	undo := func() { once.Do(func() { fltNoErr(t, os.WriteFile(p, orig, 0o644)) }) }
	t.Cleanup(undo)
	return undo
}

// ---------------------------------------------------------------------------------------------
// 3. Restore refused before CRIU runs.

// TestGfltRestoreRefused checkpoints a workload holding both of node1's GPUs (berthctl
// checkpoint create, left running), sends it into node2's checkpoint root (berthctl send to a
// transfer.Receiver) and restores it (berthctl restore) on nodes that cannot take it: another
// driver, another CUDA version, too little free memory, another model, fewer GPUs (node2's GPUs,
// mapped to other UUIDs), and too little free memory or another model on the very GPUs it ran
// on (node1, identical UUIDs). Each must be refused before CRIU runs, naming the field and both
// values; nothing is created; the checkpoint still verifies and is unchanged; and, the node put
// back, it restores on node2 and the session continues exactly.
func TestGfltRestoreRefused(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-r-src", []string{"GPU-node1-0", "GPU-node1-1"}, "")
	w.requireTokens(t, ctx, 0, 20)
	const name = "gflt-r-ck"
	local := gfltCheckpoint(t, ctx, c, w, name)
	m, err := checkpoint.ReadManifest(local)
	fltNoErr(t, err)
	if m.GPU == nil || len(m.GPU.Devices) != 2 {
		t.Fatalf("checkpoint of a 2-GPU container: GPU state %+v", m.GPU)
	}
	need := m.GPU.Devices[0].MemoryUsed
	if need < gfltWeightsMiB<<20 {
		t.Fatalf("checkpoint records %d bytes in use on GPU 0, less than the weights", need)
	}
	ckpts := map[*node.Node]string{dst: gfltSend(t, ctx, c, local, dst.CheckpointRoot, name)}
	// node1 gets a copy too: restores there see the identical GPUs
	ckpts[src] = filepath.Join(src.CheckpointRoot, name)
	fltCopyDir(t, local, ckpts[src])
	t.Cleanup(func() { os.RemoveAll(ckpts[src]) })
	sums := fltDigests(t, local)
	w.requireRunning(t, ctx)

	setDriver := func(n *node.Node, driver string) func() {
		return gfltEditGPUs(t, n, func(s *fake.NodeSpec) { s.Driver = driver })
	}
	setModel := func(n *node.Node, name string) func() {
		return gfltEditGPUs(t, n, func(s *fake.NodeSpec) {
			for i := range s.GPUs {
				s.GPUs[i].Name = name
			}
		})
	}
	cases := []struct {
		name string
		n    *node.Node
		prep func() func()
		want []string
	}{
		{"driver", dst, func() func() { return setDriver(dst, "575.51.03") },
			[]string{`fingerprint mismatch: gpu.driver: checkpoint has "580.65.06" but this node has "575.51.03"`}},
		{"cuda", dst, func() func() { return gfltEditGPUs(t, dst, func(s *fake.NodeSpec) { s.CUDA = "12.4" }) },
			[]string{`fingerprint mismatch: gpu.cuda: checkpoint has "12.8" but this node has "12.4"`}},
		{"memory-free", dst, func() func() { return gfltFill(t, dst, "GPU-node2-0", "GPU-node2-1") },
			[]string{fmt.Sprintf(`fingerprint mismatch: gpu[0].memoryFree: checkpoint has "%d bytes needed"`, need),
				"no unused " + gfltModel + " with that much free memory",
				"GPU-node2-0 " + gfltModel + " 0 bytes free", "GPU-node2-1 " + gfltModel + " 0 bytes free"}},
		{"model", dst, func() func() { return setModel(dst, "Fake B200") },
			[]string{fmt.Sprintf(`fingerprint mismatch: gpu[0].name: checkpoint has "%s"`, gfltModel),
				"no unused GPU of that model", "GPU-node2-0 Fake B200 ", "GPU-node2-1 Fake B200 "}},
		{"fewer-gpus", dst, func() func() {
			return gfltEditGPUs(t, dst, func(s *fake.NodeSpec) { s.GPUs = s.GPUs[:1] })
		}, []string{`fingerprint mismatch: gpus: checkpoint has "2" but this node has "1"`}},
		// both filled: the device map would otherwise swap the GPUs (the checkpoint records no
		// device memory on GPU 1, which then fits the full GPU-node1-0)
		{"memory-free-same-gpus", src, func() func() { return gfltFill(t, src, "GPU-node1-0", "GPU-node1-1") },
			[]string{fmt.Sprintf(`fingerprint mismatch: gpu[0].memoryFree: checkpoint has "%d bytes needed" but this node has "0 bytes free on GPU-node1-0"`, need)}},
		{"model-same-gpus", src, func() func() { return setModel(src, "Fake B200") },
			[]string{`fingerprint mismatch: gpu[0].name: checkpoint has "Fake H200" but this node has "Fake B200"`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id := "gflt-r-" + tc.name
			before := fltDstState(t, ctx, tc.n)
			memBefore := gfltNodeMem(t, tc.n)
			undo := tc.prep()
			start := time.Now()
			out, err := gfltRestore(t, ctx, c, tc.n, id, name)
			took := time.Since(start)
			undo()
			fltRequireErr(t, "berthctl restore on "+tc.n.Name, out, err, append([]string{"restore " + id}, tc.want...)...)
			// refused in the shim's Create: no runc restore, so no CRIU and no GPU step ran
			if strings.Contains(out+fmt.Sprint(err), "criu") || strings.Contains(out+fmt.Sprint(err), "GPU restore") {
				t.Errorf("the refusal came after CRIU or the GPU restore ran: %s %v", out, err)
			}
			t.Logf("refused in %v", took.Round(time.Millisecond))
			fltRequireDstClean(t, ctx, tc.n, before, []string{id})
			if got := gfltNodeMem(t, tc.n); !gfltSameMem(got, memBefore) {
				t.Errorf("%s: device memory files changed by a refused restore: %v, before %v", tc.n.Name, got, memBefore)
			}
			gfltRequireIntact(t, ckpts[tc.n], sums)
		})
	}
	w.requireRunning(t, ctx)
	w.requireTokens(t, ctx, 20, 30)

	// put back, node2 takes the checkpoint: GPU-node1-0 -> GPU-node2-0, GPU-node1-1 -> GPU-node2-1
	r := gfltRestoreOK(t, ctx, c, dst, "gflt-r-ok", name)
	if st, err := client.Stats(ctx, r.target); err != nil || st.GPUs != "GPU-node2-0,GPU-node2-1" || st.WeightsChecksum != w.checksum {
		t.Errorf("restored workload: stats %+v (%v), want GPUs GPU-node2-0,GPU-node2-1 and weights %s", st, err, w.checksum)
	}
	r.requireTokens(t, ctx, 20, 40)
}

// ---------------------------------------------------------------------------------------------
// 4. The GPU restore fails after CRIU restored the process.

// TestGfltGPURestoreFails corrupts the uuid file of node2's GPU the checkpoint is mapped to, so
// that CRIU restores the process but its fake CUDA restore cannot find the GPU (the driver's
// failure after CRIU, which it cannot roll back). berthctl restore must fail saying the GPU
// restore of pid N failed, the task was killed and the checkpoint is intact; the process is gone,
// nothing is left on node2 (no container, task, runc state or device memory); the checkpoint
// verifies; with the file repaired it restores and the session continues exactly.
func TestGfltGPURestoreFails(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	w := gfltStart(t, ctx, src, "gflt-g-src", []string{"GPU-node1-0"}, "")
	w.requireTokens(t, ctx, 0, 20)
	const name = "gflt-g-ck"
	local := gfltCheckpoint(t, ctx, c, w, name)
	ck := gfltSend(t, ctx, c, local, dst.CheckpointRoot, name)
	sums := fltDigests(t, local)

	dir, err := dst.GPU.Dir("GPU-node2-0") // the device map's choice: no identical UUID, lowest index
	fltNoErr(t, err)
	uuidFile := filepath.Join(dir, fakecuda.UUIDFile)
	orig := fltRead(t, uuidFile)
	var once sync.Once
	repair := func() { once.Do(func() { fltNoErr(t, os.WriteFile(uuidFile, orig, 0o644)) }) }
	t.Cleanup(repair)
	fltNoErr(t, os.WriteFile(uuidFile, []byte("GPU-gflt-corrupt\n"), 0o644))

	const id = "gflt-g-r1"
	before := fltDstState(t, ctx, dst)
	memBefore := gfltNodeMem(t, dst)
	out, err := gfltRestore(t, ctx, c, dst, id, name)
	fltRequireErr(t, "berthctl restore", out, err, "restore "+id, "GPU restore of pid ",
		"GPU GPU-node2-0 (checkpointed on GPU-node1-0) is not present under "+fakecuda.DefaultDevRoot,
		"the task was killed, the checkpoint", "is intact")
	if m := regexp.MustCompile(`GPU restore of pid (\d+)`).FindStringSubmatch(out + fmt.Sprint(err)); m != nil {
		pid, _ := strconv.Atoi(m[1])
		gfltWaitGone(t, pid)
	}
	if strings.Contains(out, "task must be stopped before deletion") {
		t.Errorf("PRODUCT BUG: the killed task was still running when berthctl removed it (%q): shim/service.go "+
			"Start kills the task after a failed GPU restore but returns before it exited, and the client's "+
			"WithProcessKill skips a restored task (its Pid was 0 at Create)", "task must be stopped before deletion")
	}
	fltRequireDstClean(t, ctx, dst, before, []string{id})
	if got := gfltNodeMem(t, dst); !gfltSameMem(got, memBefore) {
		t.Errorf("node2: device memory files changed by the failed restore: %v, before %v", got, memBefore)
	}
	gfltRequireIntact(t, ck, sums)

	repair()
	r := gfltRestoreOK(t, ctx, c, dst, "gflt-g-r2", name)
	if st, err := client.Stats(ctx, r.target); err != nil || st.GPUs != "GPU-node2-0" || st.WeightsChecksum != w.checksum {
		t.Errorf("restored workload: stats %+v (%v), want GPU GPU-node2-0 and weights %s", st, err, w.checksum)
	}
	r.requireTokens(t, ctx, 20, 40)
	w.requireRunning(t, ctx)
}

// ---------------------------------------------------------------------------------------------
// 5. A checkpoint without the GPU steps does not survive the move (the fake is faithful).

// TestGfltSkippedGPUStepCaught checkpoints the GPU workload with plain runc (containerd's
// io.containerd.runc.v2: no GPU steps), moves the checkpoint image to node2 (ctr export/import)
// and restores it there with ctr: CRIU must fail, and its restore log must say that it cannot
// open the device memory file: the device memory is a shared mapping of a file in node1's GPU
// directory, which a process that was not GPU-checkpointed still maps.
// (Both nodes share this host's filesystem: the source's device memory files, which its driver
// frees when it dies and which the other host never had, are moved aside.) The control: with the
// files put back the same restore succeeds, so the missing device memory is what failed it.
func TestGfltSkippedGPUStepCaught(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	gfltReclaim(t, c)
	const id, ref = "gflt-s-src", "localhost/berth/ckpt/gflt-s:1"
	ns := []string{"-n", node.Namespace}
	tar := filepath.Join(t.TempDir(), "gflt-s.tar")
	t.Cleanup(func() {
		bg := context.Background()
		_, _ = src.Ctr(bg, append(ns, "images", "rm", ref)...)
		_, _ = dst.Ctr(bg, append(ns, "images", "rm", ref)...)
	})
	w := gfltStart(t, ctx, src, id, []string{"GPU-node1-0"}, "io.containerd.runc.v2")
	mem := w.mem(t)
	if out, err := src.Ctr(ctx, append(ns, "containers", "checkpoint", "--task", "--rw", "--image", id, ref)...); err != nil {
		t.Fatalf("ctr containers checkpoint with runc: %v %s", err, out)
	}
	fltNoErr(t, src.Remove(ctx, id)) // the source's node is gone in a real move (and its cgroup path is shared here)
	aside := t.TempDir()
	for _, f := range mem.names {
		fltNoErr(t, os.Rename(filepath.Join(w.gpuDir, f), filepath.Join(aside, f)))
	}
	if _, err := src.Ctr(ctx, append(ns, "images", "export", "--skip-manifest-json", tar, ref)...); err != nil {
		t.Fatal(err)
	}
	ctrImport(t, ctx, dst, tar)

	const rid = "gflt-s-restored"
	t.Cleanup(func() { _ = dst.Remove(context.Background(), rid) })
	out, err := dst.Ctr(ctx, append(ns, "containers", "restore", "--live", "--rw", rid, ref)...)
	fltRequireErr(t, "ctr containers restore of a checkpoint without GPU steps", out, err, "criu")
	if err == nil {
		t.Fatal("a checkpoint without the GPU steps restored on another node: the fake GPU does not punish a missing GPU step")
	}
	if _, st, err := dst.TaskPID(ctx, rid); err == nil && st == containerd.Running {
		t.Errorf("task %s is running after the failed restore", rid)
	}
	gfltRequireCRIULog(t, dst, rid, mem.names)
	_ = dst.Remove(ctx, rid)

	// control: the same checkpoint restores once the device memory files are back
	for _, f := range mem.names {
		fltNoErr(t, os.Rename(filepath.Join(aside, f), filepath.Join(w.gpuDir, f)))
	}
	const rid2 = "gflt-s-control"
	t.Cleanup(func() { _ = dst.Remove(context.Background(), rid2) })
	if out, err := dst.Ctr(ctx, append(ns, "containers", "restore", "--live", "--rw", rid2, ref)...); err != nil {
		t.Fatalf("control: restore with the device memory files in place failed: %v %s", err, out)
	}
	if _, st, err := dst.TaskPID(ctx, rid2); err != nil || st != containerd.Running {
		t.Errorf("control: task %s: status %q (%v), want running", rid2, st, err)
	}
}

// gfltRequireCRIULog checks that CRIU's restore log of container id on n (kept by containerd's
// runc shim in the task's work directory under the node's root) says that it could not open one
// of the device memory files names.
func gfltRequireCRIULog(t *testing.T, n *node.Node, id string, names []string) {
	t.Helper()
	p := filepath.Join(n.Dir, "root", "io.containerd.runtime.v2.task", node.Namespace, id, "restore.log")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Errorf("CRIU's restore log: %v", err)
		return
	}
	for _, l := range strings.Split(string(b), "\n") {
		for _, f := range names {
			if strings.Contains(l, "Error") && strings.Contains(l, "Can't open file "+strings.TrimPrefix(fakecuda.DefaultDevRoot, "/")+"/0/"+f) {
				t.Logf("%s: %s", p, strings.TrimSpace(l))
				return
			}
		}
	}
	t.Errorf("%s does not say that CRIU could not open a device memory file of the source (%v)", p, names)
}

// ---------------------------------------------------------------------------------------------
// Workloads.

// gfltWorkload is the inference workload in GPU mode on a node.
type gfltWorkload struct {
	n      *node.Node
	id     string
	pid    uint32
	target client.Target
	// gpuDir is the host directory of its GPU 0 (where its device memory lives); memPrefix
	// starts the names of its device memory files ("mem-<nspid>-<tag>-").
	gpuDir, memPrefix string
	checksum          string
}

// gfltStart runs `infer -gpu` as container id on n with the GPUs gpus (runtime "" is berth's),
// waits for its ready line, and removes it when the test ends.
func gfltStart(t *testing.T, ctx context.Context, n *node.Node, id string, gpus []string, runtime string) *gfltWorkload {
	t.Helper()
	_ = n.Remove(ctx, id)
	gdir, err := n.GPU.Dir(gpus[0])
	fltNoErr(t, err)
	old := map[string]bool{}
	for _, f := range gfltMemFiles(t, gdir, fakecuda.MemPrefix) {
		old[f] = true
	}
	log := filepath.Join(n.Dir, id+".log")
	_ = os.Remove(log)
	pid, err := n.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, Runtime: runtime, GPUs: gpus, LogPath: log,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", fmt.Sprint(gfltWeightsMiB),
			"-seed", fmt.Sprint(gfltSeed), "-delay-ms", "0", "-gpu"}})
	fltNoErr(t, err)
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	// the ready line, not an HTTP probe: a kept-alive connection would be an established TCP
	// socket, which plain runc's dump refuses
	line := gfltWaitLog(t, log, "infer ready", time.Minute)
	w := &gfltWorkload{n: n, id: id, pid: pid, gpuDir: gdir,
		target: client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}}
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, "checksum="); ok {
			w.checksum = v
		}
	}
	nspid, err := fake.NSPid(int(pid))
	fltNoErr(t, err)
	for _, f := range gfltMemFiles(t, gdir, fmt.Sprintf("%s%d-", fakecuda.MemPrefix, nspid)) {
		if !old[f] {
			// mem-<nspid>-<tag>-<seq>
			if i := strings.LastIndex(f, "-"); i > 0 {
				w.memPrefix = f[:i+1]
			}
		}
	}
	if w.memPrefix == "" || w.checksum == "" {
		t.Fatalf("workload %s: no device memory files of pid %d (ns pid %d) in %s, or no checksum in %q", id, pid, nspid, gdir, line)
	}
	if m := w.mem(t); m.total < gfltWeightsMiB<<20 {
		t.Fatalf("workload %s holds %d bytes of device memory, less than its weights", id, m.total)
	}
	return w
}

// gfltMem is a process's device memory files on a GPU: names (sorted) and total size.
type gfltMem struct {
	names []string
	total int64
}

func (w *gfltWorkload) mem(t *testing.T) gfltMem {
	t.Helper()
	var m gfltMem
	for _, f := range gfltMemFiles(t, w.gpuDir, w.memPrefix) {
		m.names = append(m.names, f)
		m.total += fltFileSize(t, filepath.Join(w.gpuDir, f))
	}
	return m
}

// requireRunning checks that the workload's task is the same process, running, and that the
// fake driver reports its CUDA state RUNNING (not locked, not checkpointed).
func (w *gfltWorkload) requireRunning(t *testing.T, ctx context.Context) {
	t.Helper()
	pid, st, err := w.n.TaskPID(ctx, w.id)
	if err != nil || st != containerd.Running || pid != w.pid {
		t.Fatalf("%s: task pid %d status %q (%v), want pid %d running", w.id, pid, st, err, w.pid)
	}
	drv := &fake.Driver{Node: w.n.GPU}
	if gs, err := drv.State(int(pid)); err != nil || gs != gpu.StateRunning {
		t.Errorf("%s: fake driver reports pid %d %v (%v), want running", w.id, pid, gs, err)
	}
}

// requireTokens streams tokens from..n-1 of the session and compares them with an uninterrupted
// run of the same model.
func (w *gfltWorkload) requireTokens(t *testing.T, ctx context.Context, from, n int) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got, err := client.Stream(sctx, w.target, client.Request{Session: gfltSession, Prompt: gfltPrompt, From: from, N: n, Delay: client.NoDelay})
	if err != nil {
		t.Fatalf("%s on %s: stream tokens %d..%d: %v", w.id, w.n.Name, from, n, err)
	}
	ref, err := model.Reference(model.Config{WeightsMiB: gfltWeightsMiB, Seed: gfltSeed}, gfltPrompt, n)
	fltNoErr(t, err)
	if want := model.Words(ref[from:]); !slices.Equal(got, want) {
		t.Errorf("%s on %s: tokens %d..%d are %v, an uninterrupted run emits %v", w.id, w.n.Name, from, n, got, want)
	}
}

// ---------------------------------------------------------------------------------------------
// Checkpoints.

// gfltCheckpoint checkpoints the workload with `berthctl checkpoint create` (it keeps running)
// into a temporary directory named name and returns its path.
func gfltCheckpoint(t *testing.T, ctx context.Context, c *node.Cluster, w *gfltWorkload, name string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), name)
	gfltCheckpointOK(t, ctx, c, w.n, w.id, dir, "berthctl checkpoint create "+w.id)
	w.requireRunning(t, ctx)
	return dir
}

// gfltCheckpointOK runs `berthctl checkpoint create` of container id on n into dir (the task
// keeps running) and fails the test if it fails, naming a race of the fake GPU it is known for.
func gfltCheckpointOK(t *testing.T, ctx context.Context, c *node.Cluster, n *node.Node, id, dir, what string) {
	t.Helper()
	out, err := fltBerthctl(ctx, c, "checkpoint", "create", "-a", n.Socket, "-n", node.Namespace, id, dir)
	if err == nil {
		return
	}
	if regexp.MustCompile(`Unix socket \d+ not found`).MatchString(out) {
		t.Errorf("FAKE GPU BUG: CRIU found a unix socket of another network namespace in the process: the server " +
			"side of a fake CUDA control connection, which gpu/fake.Driver's call does not wait to be closed " +
			"(fakecuda's serveConn closes it after the shim has gone on to freeze and dump the process)")
	}
	t.Fatalf("%s: %v\n%s", what, err, out)
}

// gfltSend sends checkpoint dir with `berthctl send` to a transfer.Receiver on root, as name,
// and returns its path there (removed when the test ends).
func gfltSend(t *testing.T, ctx context.Context, c *node.Cluster, dir, root, name string) string {
	t.Helper()
	done := make(chan error, 1)
	addr := fltInProcessReceiver(t, ctx, root, done)
	p := filepath.Join(root, name)
	t.Cleanup(func() { os.RemoveAll(p) })
	if out, err := fltBerthctl(ctx, c, "send", "--name", name, dir, addr); err != nil {
		t.Fatalf("berthctl send %s: %v\n%s", dir, err, out)
	}
	select {
	case err := <-done:
		fltNoErr(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the receiver did not finish")
	}
	return p
}

// gfltRestore runs `berthctl restore` of checkpoint name on n as container id. The container is
// removed when the test ends, whatever the outcome (a failed restore must leave none, but if it
// does, later tests must not see it).
// extra are more flags of berthctl restore (--mount).
func gfltRestore(t *testing.T, ctx context.Context, c *node.Cluster, n *node.Node, id, name string, extra ...string) (string, error) {
	t.Helper()
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	args := append([]string{"restore", "--address", n.Socket, "-n", node.Namespace, "--root", n.CheckpointRoot,
		"--id", id, "--log", filepath.Join(n.Dir, id+".log")}, extra...)
	return fltBerthctl(ctx, c, append(args, name)...)
}

// gfltRestoreOK restores checkpoint name on n as id and returns the restored workload.
func gfltRestoreOK(t *testing.T, ctx context.Context, c *node.Cluster, n *node.Node, id, name string) *gfltWorkload {
	t.Helper()
	if out, err := gfltRestore(t, ctx, c, n, id, name); err != nil {
		t.Fatalf("restore of %s on %s, the node put back: %v\n%s", name, n.Name, err, out)
	}
	pid, st, err := n.TaskPID(ctx, id)
	if err != nil || st != containerd.Running {
		t.Fatalf("restored task %s: status %q (%v)", id, st, err)
	}
	r := &gfltWorkload{n: n, id: id, pid: pid, target: client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}}
	r.requireRunning(t, ctx)
	return r
}

// gfltRequireIntact checks that checkpoint dir verifies (its manifest's digests) and that its
// files are exactly those of sums.
func gfltRequireIntact(t *testing.T, dir string, sums map[string]string) {
	t.Helper()
	m, err := checkpoint.ReadManifest(dir)
	if err != nil {
		t.Errorf("checkpoint %s: %v", dir, err)
		return
	}
	if err := checkpoint.Verify(dir, m); err != nil {
		t.Errorf("checkpoint %s does not verify: %v", dir, err)
	}
	fltRequireSums(t, dir, sums, "")
}

// ---------------------------------------------------------------------------------------------
// Fake GPU nodes.

// gfltEditGPUs rewrites n's fake GPU inventory (inventory.json) through edit, and every GPU's
// driver file to the edited driver version; the returned function (also run when the test ends)
// puts the files back. Shims started afterwards read the edited inventory.
func gfltEditGPUs(t *testing.T, n *node.Node, edit func(*fake.NodeSpec)) func() {
	t.Helper()
	spec := n.GPU.Spec()
	files := map[string][]byte{}
	inv := filepath.Join(n.GPU.Root(), fake.InventoryFile)
	files[inv] = fltRead(t, inv)
	for _, g := range spec.GPUs {
		p := filepath.Join(n.GPU.Root(), g.UUID, fakecuda.DriverFile)
		files[p] = fltRead(t, p)
	}
	var once sync.Once
	undo := func() {
		once.Do(func() {
			for p, b := range files {
				fltNoErr(t, os.WriteFile(p, b, 0o644))
			}
		})
	}
	t.Cleanup(undo)
	edit(&spec)
	for _, g := range n.GPU.Spec().GPUs {
		fltNoErr(t, os.WriteFile(filepath.Join(n.GPU.Root(), g.UUID, fakecuda.DriverFile), []byte(spec.Driver+"\n"), 0o644))
	}
	b, err := json.MarshalIndent(spec, "", "  ")
	fltNoErr(t, err)
	fltNoErr(t, os.WriteFile(inv, append(b, '\n'), 0o644))
	if _, err := fake.Open(n.GPU.Root()); err != nil {
		t.Fatalf("edited fake GPU node %s does not open: %v", n.Name, err)
	}
	return undo
}

// gfltFill fills the named GPUs of n: a sparse device memory file as large as the GPU's memory
// (the fake counts file sizes); the returned function (also run when the test ends) removes them.
func gfltFill(t *testing.T, n *node.Node, uuids ...string) func() {
	t.Helper()
	var files []string
	var once sync.Once
	undo := func() {
		once.Do(func() {
			for _, f := range files {
				if err := os.Remove(f); err != nil {
					t.Error(err)
				}
			}
		})
	}
	t.Cleanup(undo)
	for _, u := range uuids {
		dir, err := n.GPU.Dir(u)
		fltNoErr(t, err)
		total, err := strconv.ParseInt(strings.TrimSpace(string(fltRead(t, filepath.Join(dir, fakecuda.MemoryFile)))), 10, 64)
		fltNoErr(t, err)
		p := filepath.Join(dir, fakecuda.MemPrefix+"gflt-fill")
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		fltNoErr(t, err)
		files = append(files, p)
		fltNoErr(t, f.Truncate(total))
		fltNoErr(t, f.Close())
	}
	return undo
}

// gfltMemFiles returns the sorted names in dir that start with prefix.
func gfltMemFiles(t *testing.T, dir, prefix string) []string {
	t.Helper()
	var out []string
	for _, e := range fltList(t, dir) {
		if strings.HasPrefix(e, prefix) {
			out = append(out, e)
		}
	}
	return out
}

// gfltNodeMem returns the device memory files of every GPU of n ("<uuid>/<name>").
func gfltNodeMem(t *testing.T, n *node.Node) []string {
	t.Helper()
	var out []string
	for _, g := range n.GPU.Spec().GPUs {
		for _, f := range gfltMemFiles(t, filepath.Join(n.GPU.Root(), g.UUID), fakecuda.MemPrefix) {
			out = append(out, g.UUID+"/"+f)
		}
	}
	return out
}

func gfltSameMem(a, b []string) bool { return slices.Equal(a, b) }

// gfltReclaim removes, when the test ends (after its containers are removed), the device memory
// files that appeared on the cluster's GPUs during the test: those of processes the test killed,
// which a real driver frees with the process.
func gfltReclaim(t *testing.T, c *node.Cluster) {
	t.Helper()
	before := map[string]bool{}
	for _, n := range c.Nodes {
		for _, f := range gfltNodeMem(t, n) {
			before[n.GPU.Root()+"/"+f] = true
		}
	}
	t.Cleanup(func() {
		for _, n := range c.Nodes {
			for _, f := range gfltNodeMem(t, n) {
				if p := n.GPU.Root() + "/" + f; !before[p] {
					_ = os.Remove(p)
				}
			}
		}
	})
}

// ---------------------------------------------------------------------------------------------
// Logs and processes.

// gfltWaitLog waits until file p has a line containing s and returns that line; on timeout the
// error holds the file and what diag (if given) says.
func gfltWaitLog(t *testing.T, p, s string, timeout time.Duration, diag ...func() string) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if f, err := os.Open(p); err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if strings.Contains(sc.Text(), s) {
					f.Close()
					return sc.Text()
				}
			}
			f.Close()
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(p)
			var more []string
			for _, d := range diag {
				more = append(more, d())
			}
			t.Fatalf("%s: no line with %q after %v:\n%s%s", p, s, timeout, b, strings.Join(more, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// gfltProcState describes host process pid for a failure message: its state and each thread's,
// and its cgroup v1 freezer state (or cgroup v2 cgroup.freeze).
func gfltProcState(pid int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "process %d:", pid)
	threads, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	for _, th := range threads {
		if st, err := os.ReadFile(th); err == nil {
			if f := strings.Fields(string(st)); len(f) > 2 {
				fmt.Fprintf(&b, " %s=%s", f[0], f[2])
			}
		}
	}
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	for _, l := range strings.Split(string(cg), "\n") {
		f := strings.SplitN(l, ":", 3)
		switch {
		case len(f) == 3 && f[1] == "freezer":
			st, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/freezer", f[2], "freezer.state"))
			fmt.Fprintf(&b, "; freezer.state %s %v", strings.TrimSpace(string(st)), err)
		case len(f) == 3 && f[0] == "0" && f[1] == "":
			if st, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", f[2], "cgroup.freeze")); err == nil {
				fmt.Fprintf(&b, "; cgroup.freeze %s", strings.TrimSpace(string(st)))
			}
		}
	}
	return b.String()
}

// gfltCount counts the lines of file p that contain s.
func gfltCount(t *testing.T, p, s string) int {
	t.Helper()
	return strings.Count(string(fltRead(t, p)), s)
}

// gfltWaitGone waits up to 10 s until host process pid no longer exists (or is a zombie).
func gfltWaitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return
		}
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("process %d still exists 10 s after its failed GPU restore: %s", pid, b)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
