package e2e

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	berthoci "github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// The Kubernetes path of issue 5, timed phase by phase next to berthctl's direct path. Pod,
// container and checkpoint names start with "bk8s-"; everything created is removed again.

// k8sSample is what one size measured on the Kubernetes path (two restore variants) and on the
// direct path.
type k8sSample struct {
	mib   int
	order string // which path ran first
	load  [2]string

	// Kubernetes path, node1: crictl checkpoint --export (criuDump: the shim's CRIU dump inside
	// it, from the archive's checkpoint/berth.json), crictl stop of the source, berthctl push.
	archiveBytes   int64
	criCheckpoint  time.Duration
	criCRIUDump    time.Duration
	criStopSource  time.Duration
	push           time.Duration
	pushSummary    string
	pushedDigest   string
	registryBytes  int64
	oci, local     k8sRestore
	direct         time.Duration // berthctl migrate's wall time
	directPhases   []phase
	directSummary  string
	directReady    time.Duration // from migrate's exit to /healthz answering
	directCRIURest time.Duration // the destination shim's restore_ms
}

// k8sRestore is one restore on node2 through CRI: pull (in the shim for oci://, berthctl pull
// before the pod for the local variant), pod sandbox (crictl runp), crictl create, crictl start
// (which restores: for oci:// it holds the shim's pull), and /healthz answering after it.
type k8sRestore struct {
	pull        time.Duration // berthctl pull (local) or the shim's "checkpoint pulled and verified" ms (oci)
	pullSummary string
	pod         time.Duration
	create      time.Duration
	start       time.Duration
	criuRestore time.Duration // the shim's restore_ms (runc/CRIU restore in Start)
	ready       time.Duration
}

// total of the restore side, the pull included (for oci:// the pull is inside start).
func (r k8sRestore) total(pullInStart bool) time.Duration {
	t := r.pod + r.create + r.start + r.ready
	if !pullInStart {
		t += r.pull
	}
	return t
}

func (s k8sSample) k8sFront() time.Duration { return s.criCheckpoint + s.criStopSource + s.push }
func (s k8sSample) k8sOCI() time.Duration   { return s.k8sFront() + s.oci.total(true) }
func (s k8sSample) k8sLocal() time.Duration { return s.k8sFront() + s.local.total(false) }
func (s k8sSample) directTotal() time.Duration {
	return s.direct + s.directReady
}

// BenchmarkKubernetesPath times each phase of the Kubernetes walkthrough (issue 5) for the
// inference workload holding N MiB (BERTH_BENCH_MIB, default 256 and 1024): on node1 a CRI pod
// of the berth runtime handler, crictl checkpoint --export (the kubelet's checkpoint API), the
// source stopped, berthctl push --plain-http to a distribution registry on loopback; on node2 a
// pod whose container carries berth.dev/restore-from, crictl start until /healthz answers. The
// restore runs twice: from oci://REF (the shim pulls; its log gives the pull's share) and, for a
// clean split of pull and restore, after `berthctl pull REF` into the checkpoint root, from that
// local path. Next to it, the same workload (a ctr-created container) moved by berthctl migrate.
// It prints the phases side by side with totals and ratios; it never asserts on times.
func BenchmarkKubernetesPath(b *testing.B) {
	c := needCluster(b)
	if _, err := os.Stat(c.Stack.Tool("registry")); err != nil {
		b.Skipf("no registry in the stack: %v", err)
	}
	prewarm := prewarmMemory(b)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Minute)
	defer cancel()
	bk8sWorkloadImage(b, ctx, c)
	var results []k8sSample
	for i, mib := range benchSizes(b) {
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			needResources(b, c, mib)
			var s k8sSample
			for range b.N {
				s = benchK8sSize(ctx, b, c, mib, i%2 == 1)
			}
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(s.k8sOCI().Seconds(), "k8s-oci-s")
			b.ReportMetric(s.k8sLocal().Seconds(), "k8s-local-s")
			b.ReportMetric(s.directTotal().Seconds(), "direct-s")
			b.ReportMetric(ratio(s.k8sOCI(), s.directTotal()), "k8s-oci/direct")
			b.ReportMetric(ratio(s.k8sLocal(), s.directTotal()), "k8s-local/direct")
			results = append(results, s)
		})
	}
	if len(results) > 0 {
		fmt.Println()
		fmt.Println(prewarm)
		printK8sTable(os.Stdout, results)
	}
}

// bk8sWorkloadImage makes the workload image available to CRI (namespace k8s.io) on every node,
// and removes it again afterwards from the nodes where it was not there before.
func bk8sWorkloadImage(tb testing.TB, ctx context.Context, c *node.Cluster) {
	tb.Helper()
	for _, n := range c.Nodes {
		out, err := n.Ctr(ctx, "-n", "k8s.io", "images", "ls", "-q")
		if err != nil {
			tb.Fatal(err)
		}
		if slicesContainsLine(out, image.WorkloadRef) {
			continue
		}
		if err := n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]); err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() {
			_, _ = n.Ctr(context.Background(), "-n", "k8s.io", "images", "rm", "--sync", image.WorkloadRef)
		})
	}
}

func slicesContainsLine(out, line string) bool {
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) == line {
			return true
		}
	}
	return false
}

// bk8sPod runs a pod sandbox with the berth runtime handler (as criPod, for tests and
// benchmarks) and returns its id and config path; a cleanup removes it if it is still there.
func bk8sPod(tb testing.TB, ctx context.Context, n *node.Node, dir, name, ns string) (id, config string) {
	tb.Helper()
	cfg := fmt.Sprintf(`{"metadata": {"name": %q, "namespace": %q, "uid": "%s-uid", "attempt": 0}, "log_directory": %q, "linux": {}}`,
		name, ns, name, filepath.Join(dir, name+"-logs"))
	config = filepath.Join(dir, name+".json")
	if err := os.WriteFile(config, []byte(cfg), 0o644); err != nil {
		tb.Fatal(err)
	}
	id, err := n.Crictl(ctx, "runp", "--runtime", "berth", config)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { // unless removed already (stopp on a removed pod logs an error in containerd)
		bg := context.Background()
		if left, err := n.Crictl(bg, "pods", "-q", "--id", id); err != nil || left != "" {
			n.RemovePod(bg, id)
		}
	})
	return id, config
}

// bk8sContainer creates (not starts) the inference workload holding mib MiB in pod, in its own
// PID namespace as the kubelet does, and returns the container id.
func bk8sContainer(tb testing.TB, ctx context.Context, n *node.Node, dir, pod, podConfig, podName string, mib int, annotations map[string]string) string {
	tb.Helper()
	cfg := map[string]any{
		"metadata":    map[string]any{"name": "infer"},
		"image":       map[string]any{"image": image.WorkloadRef},
		"command":     inferArgs(mib),
		"annotations": annotations,
		"log_path":    "infer.log",
		"linux":       map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"pid": 1}}},
	}
	body, _ := json.Marshal(cfg)
	p := filepath.Join(dir, podName+"-ctr.json")
	if err := os.WriteFile(p, body, 0o644); err != nil {
		tb.Fatal(err)
	}
	id, err := n.Crictl(ctx, "create", pod, p, podConfig)
	if err != nil {
		tb.Fatal(err)
	}
	return id
}

func bk8sPID(tb testing.TB, ctx context.Context, n *node.Node, id string) uint32 {
	tb.Helper()
	in, err := n.Inspect(ctx, id)
	if err != nil {
		tb.Fatal(err)
	}
	if in.PID <= 0 {
		tb.Fatalf("crictl inspect %s on %s: no pid", id, n.Name)
	}
	return uint32(in.PID)
}

// timed runs fn and returns how long it took; it fails b with what on error.
func timed(b *testing.B, what string, fn func() error) time.Duration {
	b.Helper()
	t := time.Now()
	if err := fn(); err != nil {
		b.Fatalf("%s: %v", what, err)
	}
	return time.Since(t)
}

// berthctlJSON runs berthctl with args and -o json and decodes what it prints into v. The
// error holds its stdout and stderr.
func berthctlJSON(ctx context.Context, c *node.Cluster, v any, args ...string) error {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, c.Berthctl(), append(args, "-o", "json")...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("berthctl %s: %w\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	if err := json.Unmarshal(stdout.Bytes(), v); err != nil {
		return fmt.Errorf("berthctl %s: output is not JSON: %w\n%s", strings.Join(args, " "), err, stdout.String())
	}
	return nil
}

// pushResult is what `berthctl checkpoint push -o json` prints; pullResult what `checkpoint pull -o json` does.
type pushResult struct {
	Source, Reference, Digest string
	Ms                        float64
}

type pullResult struct {
	Reference, Dir string
	Files          int
	Bytes          int64
	Ms             float64
}

// benchK8sSize measures one size: the Kubernetes path and the direct path, in that order or
// (directFirst) the other.
func benchK8sSize(ctx context.Context, b *testing.B, c *node.Cluster, mib int, directFirst bool) k8sSample {
	s := k8sSample{mib: mib, order: "Kubernetes path, then direct"}
	if directFirst {
		s.order = "direct, then Kubernetes path"
	}
	work := filepath.Join(filepath.Dir(c.Nodes[0].Dir), fmt.Sprintf("bk8s-%d", mib))
	if err := os.MkdirAll(work, 0o700); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(work) })
	s.load[0] = loadAvg()
	if directFirst {
		benchK8sDirect(ctx, b, c, mib, work, &s)
		benchK8sCRI(ctx, b, c, mib, work, &s)
	} else {
		benchK8sCRI(ctx, b, c, mib, work, &s)
		benchK8sDirect(ctx, b, c, mib, work, &s)
	}
	s.load[1] = loadAvg()
	os.RemoveAll(work)
	return s
}

// benchK8sCRI: the walkthrough through CRI and a registry (see BenchmarkKubernetesPath).
func benchK8sCRI(ctx context.Context, b *testing.B, c *node.Cluster, mib int, work string, s *k8sSample) {
	src, dst := c.Nodes[0], c.Nodes[1]
	dir := filepath.Join(work, "cri")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		b.Fatal(err)
	}
	reg, err := node.StartRegistry(c.Stack.Tool("registry"), filepath.Join(work, "registry"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { reg.Stop(); os.RemoveAll(reg.Dir) })
	restoreCfg, err := dst.AppendShimConfig(fmt.Sprintf("allowed_registries = [%q]\nregistry_plain_http = [%q]\n", reg.Addr, reg.Addr))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = restoreCfg() })

	// node1: the workload in a pod of the berth handler
	srcPod, srcPodCfg := bk8sPod(b, ctx, src, dir, fmt.Sprintf("bk8s-src-%d", mib), "default")
	cid := bk8sContainer(b, ctx, src, dir, srcPod, srcPodCfg, fmt.Sprintf("bk8s-src-%d", mib), mib, nil)
	if _, err := src.Crictl(ctx, "start", cid); err != nil {
		b.Fatal(err)
	}
	if err := waitHealthz(ctx, bk8sPID(b, ctx, src, cid), 3*time.Minute); err != nil {
		b.Fatalf("source pod on %s: %v", src.Name, err)
	}

	// the kubelet's checkpoint call, then the source goes (the kubelet leaves it running)
	archive := filepath.Join(work, fmt.Sprintf("bk8s-%d.tar", mib))
	s.criCheckpoint = timed(b, "crictl checkpoint", func() error {
		_, err := src.Crictl(ctx, "checkpoint", "--export="+archive, cid)
		return err
	})
	if fi, err := os.Stat(archive); err == nil {
		s.archiveBytes = fi.Size()
	}
	s.criCRIUDump = archivePhase(archive, "criu-dump")
	s.criStopSource = timed(b, "stop the source", func() error {
		_, err := src.Crictl(ctx, "stop", "-t", "0", cid)
		return err
	})
	src.RemovePod(ctx, srcPod)

	// berthctl push (verifies the CRI archive's images, signs it whole, uploads)
	ref := reg.Ref(fmt.Sprintf("berth/bk8s-infer-%d:v1", mib))
	var p pushResult
	s.push = timed(b, "berthctl checkpoint push", func() error {
		return berthctlJSON(ctx, c, &p, "checkpoint", "push", "--plain-http", archive, ref)
	})
	s.pushSummary = fmt.Sprintf("pushed %s to %s@%s (%.1f s)", p.Source, p.Reference, p.Digest, p.Ms/1000)
	if !strings.HasPrefix(p.Digest, "sha256:") {
		b.Fatalf("berthctl checkpoint push reported no digest: %+v", p)
	}
	s.pushedDigest = p.Digest
	s.registryBytes = dirBytes(filepath.Join(reg.Dir, "storage"))
	os.Remove(archive)

	// node2, variant 1: restore-from oci://REF; the shim pulls into <root>/.oci/sha256-<hex>
	pulled := filepath.Join(dst.CheckpointRoot, ".oci", strings.Replace(s.pushedDigest, ":", "-", 1))
	removePulled := func() {
		os.RemoveAll(pulled)
		_ = checkpoint.RemoveStamp(pulled)
		os.Remove(filepath.Join(dst.CheckpointRoot, ".oci", checkpoint.StampDir)) // only when empty
		os.Remove(filepath.Join(dst.CheckpointRoot, ".oci"))
	}
	if _, err := os.Stat(pulled); err == nil {
		b.Fatalf("%s exists before the restore: the shim would reuse it instead of pulling", pulled)
	}
	b.Cleanup(removePulled)
	s.oci = benchK8sRestore(ctx, b, dst, dir, fmt.Sprintf("bk8s-oci-%d", mib), mib, "oci://"+ref, nil)
	removePulled()

	// node2, variant 2: berthctl pull into the checkpoint root, then restore-from that path
	name := fmt.Sprintf("bk8s-pulled-%d", mib)
	local := filepath.Join(dst.CheckpointRoot, name)
	b.Cleanup(func() { os.RemoveAll(local); _ = checkpoint.RemoveStamp(local) })
	s.local = benchK8sRestore(ctx, b, dst, dir, fmt.Sprintf("bk8s-local-%d", mib), mib, name, func(r *k8sRestore) {
		var p pullResult
		r.pull = timed(b, "berthctl checkpoint pull", func() error {
			return berthctlJSON(ctx, c, &p, "checkpoint", "pull", "--plain-http", ref, local)
		})
		r.pullSummary = fmt.Sprintf("pulled %s into %s (%d files, %d MiB, verified; %.1f s)", p.Reference, p.Dir, p.Files, p.Bytes>>20, p.Ms/1000)
	})
	os.RemoveAll(local)
	_ = checkpoint.RemoveStamp(local)
	reg.Stop()
	os.RemoveAll(reg.Dir)
	_ = restoreCfg()
}

// benchK8sRestore restores the checkpoint restoreFrom on n in a new pod of the berth handler,
// after before (the local variant's pull), and removes the pod once /healthz answered.
func benchK8sRestore(ctx context.Context, b *testing.B, n *node.Node, dir, podName string, mib int, restoreFrom string, before func(*k8sRestore)) k8sRestore {
	var r k8sRestore
	if before != nil {
		before(&r)
	}
	var pod, podCfg string
	r.pod = timed(b, "restore pod sandbox", func() error {
		pod, podCfg = bk8sPod(b, ctx, n, dir, podName, "default")
		return nil
	})
	var rid string
	r.create = timed(b, "create the restore container", func() error {
		rid = bk8sContainer(b, ctx, n, dir, pod, podCfg, podName, mib, map[string]string{berthoci.AnnotationRestoreFrom: restoreFrom})
		return nil
	})
	r.start = timed(b, "crictl start (restore from "+restoreFrom+")", func() error {
		_, err := n.Crictl(ctx, "start", rid)
		return err
	})
	if strings.HasPrefix(restoreFrom, "oci://") {
		r.pull = shimLogMs(n.Log, `msg="checkpoint pulled and verified"`, rid, " ms")
		r.pullSummary = "in the shim, from its log"
	}
	r.criuRestore = shimLogMs(n.Log, `msg="restored with CRIU"`, rid, "restore_ms")
	pid := bk8sPID(b, ctx, n, rid)
	r.ready = timed(b, "/healthz of the restored pod", func() error { return waitHealthz(ctx, pid, time.Minute) })
	n.RemovePod(ctx, pod)
	return r
}

// benchK8sDirect: the same workload, a ctr-created container, moved by berthctl migrate (as
// benchBerth does).
func benchK8sDirect(ctx context.Context, b *testing.B, c *node.Cluster, mib int, work string, s *k8sSample) {
	src, dst := c.Nodes[0], c.Nodes[1]
	id := fmt.Sprintf("bk8s-direct-%d", mib)
	destID := id + "-moved"
	name := id + "-ckpt"
	ckpt := filepath.Join(dst.CheckpointRoot, name)
	startInfer(ctx, b, src, id, berthRuntime, mib)
	cleanup := func() {
		bg := context.Background()
		_ = dst.Remove(bg, destID)
		_ = src.Remove(bg, id)
		os.RemoveAll(ckpt)
		_ = checkpoint.RemoveStamp(ckpt)
		os.Remove(filepath.Join(dst.CheckpointRoot, checkpoint.StampDir)) // only when empty
		os.Remove(filepath.Join(dst.Dir, destID+".log"))
		os.Remove(filepath.Join(src.Dir, id+".log"))
	}
	b.Cleanup(cleanup)
	s.direct, s.directSummary, s.directPhases, s.directCRIURest = benchMigrate(ctx, b, c, src, dst, id, destID, name, work)
	pid, _, err := dst.TaskPID(ctx, destID)
	if err != nil {
		b.Fatal(err)
	}
	s.directReady = timed(b, "/healthz after migrate", func() error { return waitHealthz(ctx, pid, time.Minute) })
	cleanup()
}

// archivePhase returns the duration of the named phase in a CRI archive's checkpoint/berth.json
// (the shim's manifest of the CRIU images); 0 when it is not there.
func archivePhase(archive, name string) time.Duration {
	f, err := os.Open(archive)
	if err != nil {
		return 0
	}
	defer f.Close()
	tr := tar.NewReader(f)
	want := checkpoint.ImagesDir + "/" + checkpoint.ManifestFile
	for {
		h, err := tr.Next()
		if err != nil {
			return 0
		}
		if strings.TrimPrefix(h.Name, "./") != want {
			continue
		}
		var m checkpoint.Manifest
		if err := json.NewDecoder(io.LimitReader(tr, 16<<20)).Decode(&m); err != nil {
			return 0
		}
		for _, p := range m.Phases {
			if p.Name == name {
				return time.Duration(p.Ms * float64(time.Millisecond))
			}
		}
		return 0
	}
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func printK8sTable(w io.Writer, rs []k8sSample) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Kubernetes path (CRI checkpoint, push, pull, restore through CRI) against berthctl migrate (seconds, one run;")
	fmt.Fprintln(w, "noisy shared VM: read the ratios). Kubernetes totals: checkpoint + stop source + push + pull + pod + create + start + /healthz;")
	fmt.Fprintln(w, "direct: migrate's wall time (which includes stopping the source) + /healthz.")
	fmt.Fprintln(w, "| size | direct: berthctl migrate | K8s, restore-from oci:// (shim pulls) | K8s, berthctl pull + local path | oci:// / direct | pull+local / direct |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for _, s := range rs {
		fmt.Fprintf(w, "| %d MiB | %s | %s | %s | %.2f | %.2f |\n", s.mib, sec(s.directTotal()), sec(s.k8sOCI()), sec(s.k8sLocal()),
			ratio(s.k8sOCI(), s.directTotal()), ratio(s.k8sLocal(), s.directTotal()))
	}
	for _, s := range rs {
		dp := func(n string) time.Duration { return phaseOf(s.directPhases, n) }
		fmt.Fprintln(w)
		fmt.Fprintf(w, "%d MiB, per phase (ms). Order: %s. Load average before %s, after %s. CRI archive %d MiB, registry storage %d MiB.\n",
			s.mib, s.order, s.load[0], s.load[1], s.archiveBytes>>20, s.registryBytes>>20)
		fmt.Fprintln(w, "| phase | direct: berthctl migrate | K8s: restore-from oci:// | K8s: berthctl pull + local path |")
		fmt.Fprintln(w, "|---|---|---|---|")
		ck := fmt.Sprintf("crictl checkpoint --export %s (CRIU dump %s)", ms(s.criCheckpoint), ms(s.criCRIUDump))
		directDump := dp("checkpoint/shim/criu-dump")
		if directDump == 0 {
			directDump = dp("checkpoint/criu-dump")
		}
		fmt.Fprintf(w, "| checkpoint | %s (CRIU dump %s) | %s | same |\n", ms(dp("checkpoint")), ms(directDump), ck)
		fmt.Fprintf(w, "| stop source | %s (after the restore) | crictl stop %s | same |\n", ms(dp("stop-source")), ms(s.criStopSource))
		fmt.Fprintf(w, "| to node2 | transfer %s | berthctl push %s | berthctl push %s |\n", ms(dp("transfer")), ms(s.push), ms(s.push))
		fmt.Fprintf(w, "| pull | (in transfer) | %s (shim, inside start) | berthctl pull %s |\n", ms(s.oci.pull), ms(s.local.pull))
		fmt.Fprintf(w, "| pod sandbox | - | crictl runp %s | crictl runp %s |\n", ms(s.oci.pod), ms(s.local.pod))
		fmt.Fprintf(w, "| restore | restore %s (CRIU %s) | create %s + start %s less pull = %s (CRIU %s) | create %s + start %s = %s (CRIU %s) |\n",
			ms(dp("restore")), ms(s.directCRIURest),
			ms(s.oci.create), ms(s.oci.start), ms(s.oci.create+s.oci.start-s.oci.pull), ms(s.oci.criuRestore),
			ms(s.local.create), ms(s.local.start), ms(s.local.create+s.local.start), ms(s.local.criuRestore))
		fmt.Fprintf(w, "| other | berthctl start and connects %s | - | - |\n", ms(s.direct-dp("total")))
		fmt.Fprintf(w, "| /healthz answers | %s | %s | %s |\n", ms(s.directReady), ms(s.oci.ready), ms(s.local.ready))
		fmt.Fprintf(w, "| **total** | **%s** | **%s** | **%s** |\n", ms(s.directTotal()), ms(s.k8sOCI()), ms(s.k8sLocal()))
		fmt.Fprintf(w, "  direct: %s\n", s.directSummary)
		fmt.Fprintf(w, "  push:   %s\n", s.pushSummary)
		fmt.Fprintf(w, "  pull:   %s\n", s.local.pullSummary)
	}
}

// TestCheckpointctlReadsCRIArchive: checkpointctl v1.6 (the stack's, as the kubelet's users run
// it on /var/lib/kubelet/checkpoints) reads the archive CRI CheckpointContainer writes for a
// container of the berth runtime handler, and names berth's runtime and the container's image.
func TestCheckpointctlReadsCRIArchive(t *testing.T) {
	c := needCluster(t)
	tool := c.Stack.Tool("checkpointctl")
	if _, err := os.Stat(tool); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI=true but no checkpointctl in the stack: %v", err)
		}
		t.Skipf("no checkpointctl in the stack (make deps): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := c.Nodes[0]
	bk8sWorkloadImage(t, ctx, c)
	dir := t.TempDir()
	pod, podCfg := bk8sPod(t, ctx, n, dir, "bk8s-cpctl", "default")
	cid := bk8sContainer(t, ctx, n, dir, pod, podCfg, "bk8s-cpctl", 16, nil)
	if _, err := n.Crictl(ctx, "start", cid); err != nil {
		t.Fatal(err)
	}
	if err := waitHealthz(ctx, bk8sPID(t, ctx, n, cid), time.Minute); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(dir, "bk8s-cpctl.tar")
	if _, err := n.Crictl(ctx, "checkpoint", "--export="+archive, cid); err != nil {
		t.Fatalf("crictl checkpoint: %v", err)
	}
	t.Cleanup(func() { os.Remove(archive) })

	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, tool, "show", archive)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("checkpointctl show %s: exit %d\n%s%s", archive, ee.ExitCode(), stdout.String(), stderr.String())
		}
		t.Fatalf("checkpointctl show %s: %v", archive, err)
	}
	out := stdout.String()
	t.Logf("checkpointctl show:\n%s", out)
	for _, want := range []string{berthRuntime, image.WorkloadRef} {
		if !strings.Contains(out, want) {
			t.Errorf("checkpointctl show does not name %s:\n%s%s", want, out, stderr.String())
		}
	}
	if _, err := n.Crictl(ctx, "stop", "-t", "0", cid); err != nil {
		t.Error(err)
	}
}
