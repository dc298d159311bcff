package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/shim"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/scenario"
	"github.com/berth-dev/berth/test/workload/client"
)

// kubeMoveSample is one round of BenchmarkKubeMove: the same workload moved by berthctl migrate
// between two containerd nodes and by berthctl move (kubectl berth move) between two kubelets.
type kubeMoveSample struct {
	migrateWall, migrateReady time.Duration // berthctl migrate, then /healthz answering on the destination
	migratePhases             []phase
	moveWall, moveReady       time.Duration // berthctl move (the restore pod Ready), then /healthz answering
	movePhases                []phase
	moveBytes                 int64
	moveMode                  string
	// migrate in the mode that is not its default, for the table
	migrateOtherWall, migrateOtherReady time.Duration
	// moveDetail splits the move's checkpoint and restore phases: what berth's shim recorded
	// (the checkpoint's manifest, the restore report in the restore pod's bundle) and the rest
	// (the kubelet, containerd's CRI, scheduling, the sandbox)
	moveDetail []phase
}

func (s kubeMoveSample) migrateTotal() time.Duration { return s.migrateWall + s.migrateReady }
func (s kubeMoveSample) moveTotal() time.Duration    { return s.moveWall + s.moveReady }
func (s kubeMoveSample) migrateOtherTotal() time.Duration {
	return s.migrateOtherWall + s.migrateOtherReady
}

// migrateDefaultMode returns the mode `berthctl migrate` uses without --mode, from its help
// (`(default "stored")`), and the other of copy and stored.
func migrateDefaultMode(b *testing.B, berthctl string) (def, other string) {
	out, err := exec.Command(berthctl, "migrate", "--help").CombinedOutput()
	if err != nil {
		b.Fatalf("berthctl migrate --help: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if !strings.Contains(l, "--mode string") {
			continue
		}
		if _, v, ok := strings.Cut(l, `(default "`); ok {
			def, _, _ = strings.Cut(v, `"`)
		}
	}
	switch def {
	case "copy":
		return def, "stored"
	case "stored":
		return def, "copy"
	}
	b.Fatalf("berthctl migrate --help: no default of --mode copy or stored in:\n%s", out)
	return "", ""
}

// kubeMoveBenchMiB is the size BenchmarkKubeMove moves: BERTH_BENCH_MIB's first size if set,
// else 1 GiB if memory allows (both clusters run at once), else 256 MiB, saying so.
func kubeMoveBenchMiB(b *testing.B) (int, string) {
	if os.Getenv("BERTH_BENCH_MIB") != "" {
		return benchSizes(b)[0], ""
	}
	// the pod and its restore hold 2x, the page cache of the archive and its copy about 2x more
	const mib, need = 1024, 5*1024 + 2048
	if avail := memAvailableMiB(); avail > 0 && avail < need {
		return 256, fmt.Sprintf("only %d MiB of memory available, a 1 GiB move beside the clusters needs about %d: measuring 256 MiB", avail, need)
	}
	return mib, ""
}

// BenchmarkKubeMove moves the inference workload holding 1 GiB (see kubeMoveBenchMiB) with
// berthctl migrate between the two containerd nodes, and as a pod of RuntimeClass berth with
// `kubectl berth move` (berthctl move: the kubelet checkpoint API through the API server, the
// archive sent node to node by the berth agents, a restore pod Ready, the source deleted)
// between the two kubelets of the Kubernetes cluster (its default mode, stored: the agents'
// image has no CRIU for copy mode's page server), and, for the table, migrate in the mode that is
// not its default, in rotating order, BERTH_BENCH_ROUNDS rounds (default 3). Each total runs
// until the workload answers /healthz on the destination. It reports the medians, move/migrate
// against migrate's default mode (read from its --help) and move/migrate-OTHER; it never asserts
// on times.
func BenchmarkKubeMove(b *testing.B) {
	c := needCluster(b)
	kc := needKube(b)
	mib, note := kubeMoveBenchMiB(b)
	needResources(b, c, mib)
	prewarm := prewarmMemory(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	const ns = "bench-kmove"
	if _, err := kc.Kubectl(ctx, "create", "namespace", ns); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = kc.Kubectl(context.Background(), "delete", "namespace", ns, "--timeout=120s") })
	work := filepath.Join(filepath.Dir(c.Nodes[0].Dir), fmt.Sprintf("bench-kmove-%d", mib))
	if err := os.MkdirAll(work, 0o700); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(work) })
	defMode, otherMode := migrateDefaultMode(b, c.Berthctl())
	var samples []kubeMoveSample
	for range b.N {
		samples = nil
		for round := range benchRounds(b) {
			var s kubeMoveSample
			paths := []func(){
				func() {
					var m sample
					// round ids of their own: BenchmarkMigrate's may run in the same process
					benchBerth(ctx, b, c, mib, 100+round, work, &m)
					s.migrateWall, s.migrateReady, s.migratePhases = m.berthWall, m.berthReady, m.berthPhases
				},
				func() { benchKubeMove(ctx, b, kc, ns, mib, round, &s) },
				func() {
					s.migrateOtherWall, s.migrateOtherReady = benchMigrateMode(ctx, b, c, mib, 200+round, work, otherMode)
				},
			}
			for i := range paths {
				paths[(round+i)%len(paths)]()
			}
			samples = append(samples, s)
		}
	}
	med := func(f func(kubeMoveSample) time.Duration) time.Duration {
		var ds []time.Duration
		for _, s := range samples {
			ds = append(ds, f(s))
		}
		return median(ds)
	}
	migrate, move := med(kubeMoveSample.migrateTotal), med(kubeMoveSample.moveTotal)
	b.ReportMetric(0, "ns/op") // an iteration includes setup and rounds: report the medians instead
	b.ReportMetric(float64(mib), "MiB")
	b.ReportMetric(migrate.Seconds(), "migrate-s")
	b.ReportMetric(move.Seconds(), "move-s")
	b.ReportMetric(ratio(move, migrate), "move/migrate")
	b.ReportMetric(ratio(move, med(kubeMoveSample.migrateOtherTotal)), "move/migrate-"+otherMode)

	fmt.Println()
	if note != "" {
		fmt.Println(note)
	}
	fmt.Println(prewarm)
	printKubeMoveTable(os.Stdout, mib, samples, defMode, otherMode)
}

// benchMigrateMode moves the workload with berthctl migrate --mode mode between the two
// containerd nodes and returns the command's wall time and the time until the workload answered
// /healthz on the destination after it.
func benchMigrateMode(ctx context.Context, b *testing.B, c *node.Cluster, mib, round int, work, mode string) (wall, ready time.Duration) {
	src, dst := c.Nodes[0], c.Nodes[1]
	id := fmt.Sprintf("bench-kmm-%s-%d-%d", mode, mib, round)
	destID, name := id+"-moved", id+"-ckpt"
	startInfer(ctx, b, src, id, berthRuntime, mib)
	b.Cleanup(func() {
		_ = dst.Remove(context.Background(), destID)
		os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
	})
	wall, _, _, _ = benchMigrate(ctx, b, c, src, dst, id, destID, name, work, "--mode", mode)
	pid, _, err := dst.TaskPID(ctx, destID)
	if err != nil {
		b.Fatal(err)
	}
	t := time.Now()
	if err := waitHealthz(ctx, pid, time.Minute); err != nil {
		b.Fatalf("%s on %s after the %s-mode move: %v", destID, dst.Name, mode, err)
	}
	ready = time.Since(t)
	_ = dst.Remove(ctx, destID)
	_ = src.Remove(ctx, id)
	os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
	return wall, ready
}

// benchKubeMove runs the workload as a pod on kube1, moves it to kube2 with kubectl berth move
// -o json, waits for /healthz on the restore pod, and removes the pods and the archives.
func benchKubeMove(ctx context.Context, b *testing.B, kc *node.KubeCluster, ns string, mib, round int, s *kubeMoveSample) {
	benchKubeMoveArgs(ctx, b, kc, ns, mib, round, s)
}

// benchKubeMoveArgs is benchKubeMove with more arguments to kubectl berth move.
func benchKubeMoveArgs(ctx context.Context, b *testing.B, kc *node.KubeCluster, ns string, mib, round int, s *kubeMoveSample, args ...string) {
	src, dst := kc.Nodes[0], kc.Nodes[1]
	pod := fmt.Sprintf("bkm-%d-%d", mib, round)
	restored := pod + "-moved"
	entries := func(dir string) []string {
		es, _ := os.ReadDir(dir)
		var names []string
		for _, e := range es {
			names = append(names, e.Name())
		}
		return names
	}
	hadSrc, hadDst := entries(src.CheckpointDir), entries(dst.CheckpointRoot)
	cleanup := func() {
		bg := context.Background()
		_, _ = kc.Kubectl(bg, "-n", ns, "delete", "pod", pod, restored, "--ignore-not-found", "--timeout=120s")
		for _, d := range []struct {
			dir string
			had []string
		}{{src.CheckpointDir, hadSrc}, {dst.CheckpointRoot, hadDst}} {
			for _, e := range entries(d.dir) {
				if !slices.Contains(d.had, e) {
					os.RemoveAll(filepath.Join(d.dir, e))
				}
			}
		}
	}
	b.Cleanup(cleanup)
	if _, err := kc.KubectlIn(ctx, strings.NewReader(scenario.InferPodYAML(ns, pod, src.Name, mib, 0)), "apply", "-f", "-"); err != nil {
		b.Fatal(err)
	}
	if _, err := kc.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod/"+pod, "--timeout=300s"); err != nil {
		desc, _ := kc.Kubectl(ctx, "-n", ns, "describe", "pod", pod)
		b.Fatalf("pod %s not Ready: %v\n%s", pod, err, desc)
	}
	healthz := func(name string, d time.Duration) {
		b.Helper()
		ip, err := kc.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status.podIP}")
		if err != nil {
			b.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		if err := client.WaitReady(wctx, client.Target{BaseURL: "http://" + ip + ":8080"}, 20*time.Millisecond); err != nil {
			b.Fatalf("pod %s: %v", name, err)
		}
	}
	healthz(pod, 3*time.Minute)

	cmd, err := scenario.KubectlBerth(ctx, kc, append(append([]string{"move", "-n", ns, pod, "--to", dst.Name, "--name", restored, "-o", "json"},
		scenario.KubeMoveArgs(kc)...), args...)...)
	if err != nil {
		b.Fatal(err)
	}
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	t := time.Now()
	err = cmd.Run()
	s.moveWall = time.Since(t)
	if err != nil {
		b.Fatalf("kubectl berth move: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	var res kubeMoveResult
	if err := json.Unmarshal([]byte(stdout.String()), &res); err != nil {
		b.Fatalf("move -o json: %v\n%s", err, stdout.String())
	}
	for _, p := range res.Phases {
		s.movePhases = append(s.movePhases, phase{p.Name, time.Duration(p.Ms * float64(time.Millisecond))})
	}
	s.moveBytes, s.moveMode = res.Bytes, res.Mode
	t = time.Now()
	healthz(restored, time.Minute)
	s.moveReady = time.Since(t)
	s.moveDetail = kubeMoveDetail(b, src, dst, res, s.movePhases)
	cleanup()
}

// kubeMoveDetail splits the move's checkpoint and restore phases into the shim's steps (from the
// received checkpoint's checkpoint/berth.json and the restore pod's berth-restore.json) and the
// rest of each phase.
func kubeMoveDetail(b *testing.B, src, dst *node.KubeNode, res kubeMoveResult, phases []phase) []phase {
	var out []phase
	var shimCkpt time.Duration
	// the shim digests the CRIU images and writes its manifest after the manifest's phases end:
	// its log says how long that took (manifest_ms of the last "checkpoint written")
	if raw, err := os.ReadFile(src.Log); err == nil {
		lines := strings.Split(string(raw), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			if !strings.Contains(lines[i], `msg="checkpoint written"`) {
				continue
			}
			if _, v, ok := strings.Cut(lines[i], "manifest_ms="); ok {
				if ms, err := strconv.ParseFloat(strings.Fields(v)[0], 64); err == nil {
					d := time.Duration(ms * float64(time.Millisecond))
					shimCkpt += d
					out = append(out, phase{"checkpoint: shim digest, manifest", d})
				}
			}
			break
		}
	}
	if m, err := checkpoint.ReadManifest(filepath.Join(dst.CheckpointRoot, res.Checkpoint, checkpoint.ImagesDir)); err != nil {
		b.Logf("checkpoint phases: %v", err)
	} else {
		for _, p := range m.Phases {
			d := time.Duration(p.Ms * float64(time.Millisecond))
			shimCkpt += d
			out = append(out, phase{"checkpoint: shim " + p.Name, d})
		}
	}
	out = append(out, phase{"checkpoint: kubelet, containerd (rest)", phaseOf(phases, "checkpoint") - shimCkpt})
	reports, _ := filepath.Glob(filepath.Join(dst.Dir, "state", "io.containerd.runtime.v2.task", "k8s.io", "*", shim.RestoreReportFile))
	var newest string
	var newestMod time.Time
	for _, r := range reports {
		if fi, err := os.Stat(r); err == nil && fi.ModTime().After(newestMod) {
			newest, newestMod = r, fi.ModTime()
		}
	}
	var rep shim.RestoreReport
	if raw, err := os.ReadFile(newest); err != nil || json.Unmarshal(raw, &rep) != nil {
		b.Logf("restore report %q: %v", newest, err)
	}
	var shimRestore time.Duration
	for _, p := range rep.Phases {
		d := time.Duration(p.Ms * float64(time.Millisecond))
		shimRestore += d
		out = append(out, phase{"restore: shim " + p.Name, d})
	}
	out = append(out, phase{"restore: create, verify, schedule (rest)", phaseOf(phases, "restore") - shimRestore})
	return out
}

// printKubeMoveTable prints the medians of both paths' phases and totals.
func printKubeMoveTable(w io.Writer, mib int, samples []kubeMoveSample, defMode, otherMode string) {
	if len(samples) == 0 {
		return
	}
	med := func(f func(kubeMoveSample) time.Duration) time.Duration {
		var ds []time.Duration
		for _, s := range samples {
			ds = append(ds, f(s))
		}
		return median(ds)
	}
	medPhases := func(f func(kubeMoveSample) []phase) []phase {
		var out []phase
		for _, p := range f(samples[0]) {
			out = append(out, phase{p.name, med(func(s kubeMoveSample) time.Duration { return phaseOf(f(s), p.name) })})
		}
		return out
	}
	fmt.Fprintf(w, "%d MiB of weights, median of %d rounds (seconds); move in %s mode, archive %.1f MiB\n", mib, len(samples),
		samples[0].moveMode, float64(samples[0].moveBytes)/(1<<20))
	fmt.Fprintf(w, "berthctl migrate (two containerd nodes), its default mode (%s):\n", defMode)
	for _, p := range medPhases(func(s kubeMoveSample) []phase { return s.migratePhases }) {
		fmt.Fprintf(w, "  %-34s %8s\n", p.name, sec(p.d))
	}
	fmt.Fprintf(w, "  %-34s %8s\n", "wall", sec(med(func(s kubeMoveSample) time.Duration { return s.migrateWall })))
	fmt.Fprintf(w, "  %-34s %8s\n", "then /healthz on the destination", sec(med(func(s kubeMoveSample) time.Duration { return s.migrateReady })))
	fmt.Fprintf(w, "  %-34s %8s\n", "total", sec(med(kubeMoveSample.migrateTotal)))
	fmt.Fprintln(w, "kubectl berth move (two kubelets, the kubelet checkpoint API):")
	for _, p := range medPhases(func(s kubeMoveSample) []phase { return s.movePhases }) {
		fmt.Fprintf(w, "  %-34s %8s\n", p.name, sec(p.d))
	}
	for _, p := range medPhases(func(s kubeMoveSample) []phase { return s.moveDetail }) {
		fmt.Fprintf(w, "    %-42s %8s\n", p.name, sec(p.d))
	}
	fmt.Fprintf(w, "  %-34s %8s\n", "wall", sec(med(func(s kubeMoveSample) time.Duration { return s.moveWall })))
	fmt.Fprintf(w, "  %-34s %8s\n", "then /healthz on the restore pod", sec(med(func(s kubeMoveSample) time.Duration { return s.moveReady })))
	fmt.Fprintf(w, "  %-34s %8s\n", "total", sec(med(kubeMoveSample.moveTotal)))
	fmt.Fprintf(w, "berthctl migrate --mode %s: wall %s, total %s\n", otherMode,
		sec(med(func(s kubeMoveSample) time.Duration { return s.migrateOtherWall })), sec(med(kubeMoveSample.migrateOtherTotal)))
	fmt.Fprintf(w, "move/migrate (migrate's default, %s): %.2f (per round:", defMode, ratio(med(kubeMoveSample.moveTotal), med(kubeMoveSample.migrateTotal)))
	for _, s := range samples {
		fmt.Fprintf(w, " %.2f", ratio(s.moveTotal(), s.migrateTotal()))
	}
	fmt.Fprintln(w, ")")
	fmt.Fprintf(w, "move/migrate --mode %s: %.2f\n", otherMode, ratio(med(kubeMoveSample.moveTotal), med(kubeMoveSample.migrateOtherTotal)))
}
