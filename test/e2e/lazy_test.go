package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/scenario"
)

// lazyPipes makes fs.pipe-max-size at least criu.MinLazyPipeMaxSize for the test (root here
// lacks CAP_SYS_RESOURCE, so CRIU's lazy page server needs it) and puts the old value back
// when the test ends.
func lazyPipes(t *testing.T) {
	t.Helper()
	setPipeMaxSize(t, criu.MinLazyPipeMaxSize, false)
}

// setPipeMaxSize sets fs.pipe-max-size to v (only when it is lower, unless exact) and restores
// the old value when the test ends.
func setPipeMaxSize(t testing.TB, v int, exact bool) {
	t.Helper()
	b, err := os.ReadFile(criu.PipeMaxSizeFile)
	if err != nil {
		t.Fatal(err)
	}
	old, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if old == v || (!exact && old >= v) {
		return
	}
	if err := os.WriteFile(criu.PipeMaxSizeFile, []byte(strconv.Itoa(v)), 0o644); err != nil {
		t.Fatalf("set fs.pipe-max-size to %d: %v", v, err)
	}
	t.Cleanup(func() {
		if err := os.WriteFile(criu.PipeMaxSizeFile, []byte(strconv.Itoa(old)), 0o644); err != nil {
			t.Errorf("restore fs.pipe-max-size to %d: %v", old, err)
		}
	})
}

// TestMigrateInferenceLazyMode moves the inference workload mid-stream in lazy (post-copy)
// mode: the destination resumes before its memory arrived, the pages follow on demand and in
// the background. Every session must continue with exactly the tokens of an uninterrupted run
// (the weights checksum too: every page arrived intact), the source must be gone once every
// page arrived, and nothing of the lazy stream may be left in the destination's checkpoint root.
func TestMigrateInferenceLazyMode(t *testing.T) {
	c := needCluster(t)
	lazyPipes(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	stampDirExists(t, dst)
	before := fltDstState(t, ctx, dst)
	rep, err := scenario.MoveInference(ctx, c, src, dst, scenario.InferenceOptions{
		ID: "infer-lazy", WeightsMiB: 64, Sessions: 3, Tokens: 120, MoveAfter: 30, DelayMs: 15, Out: os.Stderr,
		MigrateArgs: []string{"--lazy"},
	})
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), "infer-lazy")
		_ = dst.Remove(context.Background(), "infer-lazy-moved")
	})
	if err != nil {
		t.Fatal(err)
	}
	assertMovedInference(t, rep)
	if !strings.Contains(rep.MigrateOutput, "all pages arrived") {
		t.Errorf("migrate reported no time for all pages to arrive:\n%s", rep.MigrateOutput)
	}
	// the summary counts the pages that came after the resume: the 64 MiB of weights at least
	if m := regexp.MustCompile(`\+ ([0-9.]+) MiB pages after the resume = `).FindStringSubmatch(rep.MigrateOutput); m == nil {
		t.Errorf("migrate's summary does not count the lazy pages:\n%s", rep.MigrateOutput)
	} else if mib, _ := strconv.ParseFloat(m[1], 64); mib < 64 {
		t.Errorf("migrate's summary counts %s MiB of lazy pages; want the 64 MiB of weights at least:\n%s", m[1], rep.MigrateOutput)
	}
	for _, e := range fltList(t, dst.CheckpointRoot) {
		if !before.root[e] {
			t.Errorf("destination root holds %s after the lazy move (the checkpoint holds no memory; its daemon's directory is temporary)", e)
		}
	}
	for _, e := range fltList(t, filepath.Join(dst.CheckpointRoot, checkpoint.StampDir)) {
		if strings.HasPrefix(e, "infer-lazy-") {
			t.Errorf("destination root holds the stamp %s of the removed lazy checkpoint", e)
		}
	}
	requireNoLazyTLS(t, filepath.Join(src.Dir, "outgoing"))
	t.Logf("migrate (lazy mode) took %v:\n%s", rep.MigrateWall, rep.MigrateOutput)
}

// requireNoLazyTLS fails the test if migrate's work directory still holds the TLS identity of a
// lazy dump's page server (checkpoint.LazyTLSDir: ".lazytls-NAME"): it is removed once the
// relay connected, or by the shim when the dump ended.
func requireNoLazyTLS(t *testing.T, workDir string) {
	t.Helper()
	left, _ := filepath.Glob(filepath.Join(workDir, ".lazytls-*"))
	if len(left) > 0 {
		t.Errorf("the lazy page server's TLS identity is left in the work directory: %v", left)
	}
}

// TestMigrateRedisLazyMode is TestMigrateRedis in lazy mode: every key, by Redis's own digest.
func TestMigrateRedisLazyMode(t *testing.T) {
	lazyPipes(t)
	migrateRedis(t, "redis-lazy", "--lazy")
}

// TestLazyModeRefusedWithSmallPipes: with fs.pipe-max-size below what CRIU's lazy page server
// needs (and no CAP_SYS_RESOURCE, as here), migrate --lazy refuses before anything is paused,
// naming the value and the sysctl that fixes it; the source runs on untouched.
func TestLazyModeRefusedWithSmallPipes(t *testing.T) {
	c := needCluster(t)
	setPipeMaxSize(t, 1<<20, true)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	w := copyFaultWorkload(t, ctx, src, "lazy-refused", 16)
	before := fltDstState(t, ctx, dst)
	out, err := fltBerthctl(ctx, c, "migrate", "--lazy", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--root", dst.CheckpointRoot, "--id", "lazy-refused-moved", "lazy-refused")
	fltRequireErr(t, "berthctl migrate --lazy", out, err, "nothing was paused", "fs.pipe-max-size is 1048576", "sysctl -w fs.pipe-max-size=4194304")
	w.requireServing(t, ctx)
	fltRequireDstClean(t, ctx, dst, before, []string{"lazy-refused-moved"})
}

// stampDirExists makes the receivers' stamp directory (checkpoint.StampDir) in n's checkpoint
// root, which the first checkpoint received there creates and which stays: a test that wants no
// new entry in the root compares against a root that has it.
func stampDirExists(t *testing.T, n *node.Node) {
	t.Helper()
	fltNoErr(t, os.MkdirAll(filepath.Join(n.CheckpointRoot, checkpoint.StampDir), 0o700))
}

// lazyProxy forwards connections to target; once n bytes went from a client to target on one
// connection, at is called once (the connections keep going).
func lazyProxy(t *testing.T, target string, n int64, at func()) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	fltNoErr(t, err)
	var once sync.Once
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			go func() { _, _ = io.Copy(in, out); in.Close() }()
			go func() {
				if k, _ := io.CopyN(out, in, n); k == n {
					once.Do(at)
					_, _ = io.Copy(out, in)
				}
				out.Close()
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln.Addr().String()
}

// findProc returns the PIDs of processes whose NUL-separated command line holds every one of
// words, in /proc.
func findProc(words ...string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		ok := true
		for _, w := range words {
			found := false
			for _, a := range args {
				if a == w || strings.HasSuffix(a, "/"+w) || strings.Contains(a, w) && strings.Contains(w, "/") {
					found = true
				}
			}
			ok = ok && found
		}
		if ok {
			out = append(out, pid)
		}
	}
	return out
}

// childrenOf returns pid's children.
func childrenOf(pid int) []int {
	var out []int
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		for _, s := range strings.Fields(string(b)) {
			if k, err := strconv.Atoi(s); err == nil {
				out = append(out, k)
			}
		}
	}
	return out
}

// killSourceCRIU kills the CRIU that runc's checkpoint of container id runs (the process that
// dumps, or serves the pages of, id), by PID; it reports how many it killed.
func killSourceCRIU(t *testing.T, id string) int {
	n := 0
	for _, runc := range findProc("runc", "checkpoint", id) {
		for _, kid := range childrenOf(runc) {
			if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", kid)); strings.TrimSpace(string(b)) == "criu" {
				if syscall.Kill(kid, syscall.SIGKILL) == nil {
					n++
				}
			}
		}
	}
	t.Logf("killed %d CRIU process(es) of runc checkpoint %s", n, id)
	return n
}

// TestLazyModeFaults breaks lazy moves while the pages stream, after the destination resumed:
// the link to the destination cut after 16 MiB of pages, the destination's receiver (and with
// it the lazy-pages daemon's connection) killed after 16 MiB, the lazy-pages daemon itself
// killed, and the source's CRIU (which serves the pages) killed. In each the move fails saying
// that the destination task was killed and the source resumes; the source is the same process,
// running, weights intact, still streaming; the destination holds no container, no checkpoint
// and no lazy-pages directory; the source's work directory is empty.
func TestLazyModeFaults(t *testing.T) {
	c := needCluster(t)
	lazyPipes(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const at = 16 << 20
	for _, tc := range []struct {
		name string
		// receiver returns the receiver address to use, arranging the fault on the way
		receiver func(t *testing.T, id, name string) string
		want     string
	}{
		{"link-cut", func(t *testing.T, id, name string) string {
			rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			return fltCutProxy(t, rcv.addr, at, nil)
		}, "page stream"},
		{"destination-killed", func(t *testing.T, id, name string) string {
			rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			return lazyProxy(t, rcv.addr, at, func() { go rcv.kill() })
		}, "page stream"},
		{"lazy-daemon-killed", func(t *testing.T, id, name string) string {
			rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			return lazyProxy(t, rcv.addr, at, func() {
				pids := findProc("criu", "lazy-pages", "/.lazy-"+name)
				for _, p := range pids {
					_ = syscall.Kill(p, syscall.SIGKILL)
				}
				t.Logf("killed lazy-pages daemon(s) %v", pids)
			})
		}, "criu lazy-pages"},
		{"source-criu-killed", func(t *testing.T, id, name string) string {
			rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			return lazyProxy(t, rcv.addr, at, func() { killSourceCRIU(t, id) })
		}, "page stream"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "lazyflt-" + tc.name
			w := copyFaultWorkload(t, ctx, src, id, 256)
			work := t.TempDir()
			stampDirExists(t, dst)
			before := fltDstState(t, ctx, dst)
			target, name := id+"-moved", id+"-ck"
			t.Cleanup(func() { _ = dst.Remove(context.Background(), target) })
			receiver := tc.receiver(t, id, name)
			out, err := fltBerthctl(ctx, c, "migrate", "--lazy", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
				"--receiver", receiver, "--id", target, "--work-dir", work, "--name", name, id)
			// a receiver started again on the root removes what a killed one left
			again := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			again.kill()
			fltRequireErr(t, "berthctl migrate --lazy", out, err, "migrate "+id, "lazy move failed before every page arrived",
				"was killed and removed, and the source resumes", tc.want)
			w.requireServing(t, ctx)
			fltRequireEmptyDir(t, work)
			fltRequireDstClean(t, ctx, dst, before, []string{target}, name, ".lazy-"+name)
			if left := findProc("criu", "lazy-pages", "/.lazy-"+name); len(left) > 0 {
				t.Errorf("lazy-pages daemon(s) %v still run", left)
			}
		})
	}
}

// TestMigrateGPUInferenceLazyMode is TestMigrateGPUInference in lazy mode: the fake GPU's device
// memory, checkpointed into host memory before CRIU, is restored on node2's GPU from pages that
// arrive lazily (the GPU restore touches them first). The source's GPUs are not given back
// after the dump (only a failed move needs that), so no source-side gpu-restore phase appears.
func TestMigrateGPUInferenceLazyMode(t *testing.T) {
	c := needCluster(t)
	lazyPipes(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), "gpu-lazy")
		_ = dst.Remove(context.Background(), "gpu-lazy-moved")
	})
	rep, err := scenario.MoveInference(ctx, c, src, dst, scenario.InferenceOptions{
		ID: "gpu-lazy", WeightsMiB: 32, Sessions: 2, Tokens: 100, MoveAfter: 25, DelayMs: 15, Out: os.Stderr, GPU: true,
		MigrateArgs: []string{"--lazy"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.MatchingSessions != len(rep.Streams) {
		t.Errorf("%d of %d sessions continued exactly", rep.MatchingSessions, len(rep.Streams))
	}
	if rep.PrefillsAfter != rep.PrefillsBefore || rep.WeightsChecksumAfter != rep.WeightsChecksumBefore {
		t.Errorf("prefills %d -> %d, weights %s -> %s", rep.PrefillsBefore, rep.PrefillsAfter, rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	}
	if rep.GPUsBefore != "GPU-node1-0" || rep.GPUsAfter != "GPU-node2-0" {
		t.Errorf("workload GPUs %q before, %q after; want GPU-node1-0 -> GPU-node2-0", rep.GPUsBefore, rep.GPUsAfter)
	}
	if !strings.Contains(rep.MigrateOutput, "checkpoint/shim/gpu-checkpoint") {
		t.Errorf("no GPU checkpoint phase:\n%s", rep.MigrateOutput)
	}
	if strings.Contains(rep.MigrateOutput, "checkpoint/shim/gpu-restore") {
		t.Errorf("the source's GPUs were restored although the move succeeded:\n%s", rep.MigrateOutput)
	}
	t.Logf("migrate (lazy mode):\n%s", rep.MigrateOutput)
}
