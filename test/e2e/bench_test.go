package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/criu"
	berthoci "github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// The benchmarks measure in one run and print ratios (`make bench`: -benchtime 1x). They never
// assert on times: the machines they run on are small and noisy. Container ids start with
// "bench-" (nodes on one host share runc's state root); everything created is removed.

const (
	runcRuntime  = "io.containerd.runc.v2"
	berthRuntime = "io.containerd.berth.v2"
	inferListen  = "127.0.0.1:8080"
)

// benchSizes are the memory sizes (MiB of model weights held by the workload) of BenchmarkMigrate;
// BERTH_BENCH_MIB (comma-separated MiB) replaces them, e.g. for a quick run.
func benchSizes(b *testing.B) []int {
	v := os.Getenv("BERTH_BENCH_MIB")
	if v == "" {
		return []int{256, 1024}
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			b.Fatalf("BERTH_BENCH_MIB=%q: want comma-separated sizes in MiB", v)
		}
		out = append(out, n)
	}
	return out
}

// phase is one named duration.
type phase struct {
	name string
	d    time.Duration
}

func sumPhases(ps []phase) time.Duration {
	var t time.Duration
	for _, p := range ps {
		t += p.d
	}
	return t
}

func phaseOf(ps []phase, name string) time.Duration {
	for _, p := range ps {
		if p.name == name {
			return p.d
		}
	}
	return 0
}

// migrateResult is what one size measured on the three paths.
type migrateResult struct {
	mib int
	// raw CRIU on one node: `ctr tasks checkpoint --image-path` and a restore of that directory.
	rawDump, rawRestore time.Duration
	rawBytes            int64
	rawStats            berthoci.CRIUStats
	// digestPass is one oci.DigestDir over the raw dump (page cache hot); copySync is a copy of
	// it with fsync: what one sha256 pass and one durable write of the image cost on this machine.
	digestPass, copySync time.Duration
	// berth: berthctl migrate's wall time, its printed phases (checkpoint/* are the manifest's,
	// the others migrate's own), its first output line.
	berthWall    time.Duration
	berthPhases  []phase
	berthSummary string
	berthReady   time.Duration // from migrate's exit to /healthz answering on the destination
	// ctr: checkpoint, stop-source, export, import, restore.
	ctrPhases []phase
	ctrBytes  int64
}

func (r migrateResult) rawSum() time.Duration { return r.rawDump + r.rawRestore }

// BenchmarkMigrate moves the inference workload holding 256 MiB and 1 GiB between two local
// nodes, measuring raw CRIU on one node, berthctl migrate, and the ctr checkpoint/export/import/
// restore path, and prints a table with berth/raw and ctr/berth.
func BenchmarkMigrate(b *testing.B) {
	c := needCluster(b)
	var results []migrateResult
	for _, mib := range benchSizes(b) {
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			needResources(b, c, mib)
			var r migrateResult
			for i := 0; i < b.N; i++ {
				r = benchMigrateSize(b, c, mib)
			}
			b.ReportMetric(0, "ns/op") // the iteration includes setup: report the phases instead
			b.ReportMetric(r.rawSum().Seconds(), "raw-s")
			b.ReportMetric(r.berthWall.Seconds(), "berth-s")
			b.ReportMetric(sumPhases(r.ctrPhases).Seconds(), "ctr-s")
			b.ReportMetric(ratio(r.berthWall, r.rawSum()), "berth/raw")
			b.ReportMetric(ratio(sumPhases(r.ctrPhases), r.berthWall), "ctr/berth")
			results = append(results, r)
		})
	}
	if len(results) > 0 {
		printMigrateTable(os.Stdout, results)
	}
}

func ratio(a, b time.Duration) float64 {
	if b <= 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// needResources skips the size when the disk under the cluster or the memory cannot hold it: in
// flight, a move of N MiB holds about 4N on disk (raw dump and its copy, or the ctr tar and
// two content stores) and 2N of memory (source and restored copy) plus the page cache.
func needResources(b *testing.B, c *node.Cluster, mib int) {
	b.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(c.Nodes[0].Dir, &st); err != nil {
		b.Fatal(err)
	}
	freeMiB := int64(st.Bavail) * int64(st.Bsize) >> 20
	if need := int64(5*mib + 1024); freeMiB < need {
		b.Skipf("%d MiB free under %s, a %d MiB move needs about %d", freeMiB, c.Nodes[0].Dir, mib, need)
	}
	if avail := memAvailableMiB(); avail > 0 && avail < int64(3*mib+1024) {
		b.Skipf("%d MiB of memory available, a %d MiB move needs about %d", avail, mib, 3*mib+1024)
	}
}

func memAvailableMiB() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var kb int64
		if _, err := fmt.Sscanf(sc.Text(), "MemAvailable: %d kB", &kb); err == nil {
			return kb >> 10
		}
	}
	return 0
}

func inferArgs(mib int) []string {
	return []string{image.WorkloadBinary, "-listen", inferListen, "-weights-mib", strconv.Itoa(mib), "-seed", "7", "-delay-ms", "0"}
}

// startInfer runs the workload on n with runtime and waits until its /healthz answers.
func startInfer(ctx context.Context, b *testing.B, n *node.Node, id, runtime string, mib int) uint32 {
	b.Helper()
	pid, err := n.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, Args: inferArgs(mib), Runtime: runtime,
		LogPath: filepath.Join(n.Dir, id+".log")})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	if err := waitHealthz(ctx, pid, 3*time.Minute); err != nil {
		b.Fatalf("%s on %s: %v", id, n.Name, err)
	}
	return pid
}

func waitHealthz(ctx context.Context, pid uint32, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return client.WaitReady(ctx, client.Target{BaseURL: "http://" + inferListen, DialContext: node.NetnsDialer(int(pid))}, 20*time.Millisecond)
}

func benchMigrateSize(b *testing.B, c *node.Cluster, mib int) migrateResult {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	r := migrateResult{mib: mib}
	work := filepath.Join(filepath.Dir(c.Nodes[0].Dir), fmt.Sprintf("bench-%d", mib))
	if err := os.MkdirAll(work, 0o700); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(work) })
	b.StopTimer()
	benchRaw(ctx, b, c.Nodes[0], mib, work, &r)
	benchBerth(ctx, b, c, mib, work, &r)
	benchCtr(ctx, b, c.Nodes[0], c.Nodes[1], mib, work, &r)
	b.StartTimer()
	return r
}

// benchRaw: `ctr tasks checkpoint --image-path` of a runc.v2 container, then a new container on
// the same node whose task is restored by runc/CRIU from that directory (containerd's
// WithRestoreImagePath: no content store, no archive, no digests).
func benchRaw(ctx context.Context, b *testing.B, n *node.Node, mib int, work string, r *migrateResult) {
	id := fmt.Sprintf("bench-raw-%d", mib)
	rid := id + "-r"
	startInfer(ctx, b, n, id, runcRuntime, mib)
	images, dumpWork, restoreWork := filepath.Join(work, "raw-images"), filepath.Join(work, "raw-dump-work"), filepath.Join(work, "raw-restore-work")
	for _, d := range []string{images, dumpWork, restoreWork} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			b.Fatal(err)
		}
	}
	t := time.Now()
	_, err := n.Ctr(ctx, "-n", node.Namespace, "tasks", "checkpoint", "--image-path", images, "--work-path", dumpWork, id)
	r.rawDump = time.Since(t)
	if err != nil {
		b.Fatal(err)
	}
	if r.rawStats, err = criu.ReadDumpStats(dumpWork); err != nil {
		r.rawStats, _ = criu.ReadDumpStats(images)
	}
	r.rawBytes = dirBytes(images)

	cl, err := n.Client()
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	nctx := namespaces.WithNamespace(ctx, node.Namespace)
	img, err := cl.GetImage(nctx, image.WorkloadRef)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = n.Remove(context.Background(), rid) })
	t = time.Now()
	ctr, err := cl.NewContainer(nctx, rid, containerd.WithImage(img), containerd.WithNewSnapshot(rid, img),
		containerd.WithRuntime(runcRuntime, nil),
		containerd.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs(inferArgs(mib)...)))
	if err != nil {
		b.Fatal(err)
	}
	task, err := ctr.NewTask(nctx, cio.NullIO, containerd.WithRestoreImagePath(images), containerd.WithRestoreWorkPath(restoreWork))
	if err != nil {
		b.Fatalf("raw restore of %s: %v (restore log %s)", id, err, filepath.Join(restoreWork, "restore.log"))
	}
	if err := task.Start(nctx); err != nil {
		b.Fatalf("raw restore of %s: %v (restore log %s)", id, err, filepath.Join(restoreWork, "restore.log"))
	}
	r.rawRestore = time.Since(t)
	if st, err := task.Status(nctx); err != nil || st.Status != containerd.Running {
		b.Fatalf("raw restore of %s: task is %v (%v)", id, st.Status, err)
	}
	_ = n.Remove(ctx, rid)
	_ = n.Remove(ctx, id)

	// What one sha256 pass and one durable copy of this image cost here (to attribute berth's phases).
	t = time.Now()
	if _, _, err := berthoci.DigestDir(images); err != nil {
		b.Fatal(err)
	}
	r.digestPass = time.Since(t)
	cp := filepath.Join(work, "raw-copy")
	t = time.Now()
	if err := copyTreeSync(images, cp); err != nil {
		b.Fatal(err)
	}
	r.copySync = time.Since(t)
	os.RemoveAll(cp)
	os.RemoveAll(images)
	os.RemoveAll(dumpWork)
	os.RemoveAll(restoreWork)
}

var phaseLine = regexp.MustCompile(`^\s+(\S+)\s+([0-9.]+) ms$`)

// benchBerth: berthctl migrate from node1 to node2 (berth runtime), as test/scenario does.
func benchBerth(ctx context.Context, b *testing.B, c *node.Cluster, mib int, work string, r *migrateResult) {
	src, dst := c.Nodes[0], c.Nodes[1]
	id := fmt.Sprintf("bench-berth-%d", mib)
	destID := id + "-moved"
	name := id + "-ckpt"
	startInfer(ctx, b, src, id, berthRuntime, mib)
	b.Cleanup(func() {
		_ = dst.Remove(context.Background(), destID)
		os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
	})
	args := []string{"migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--to-root", dst.CheckpointRoot, "--target-id", destID, "--work-dir", filepath.Join(work, "outgoing"),
		"--name", name, "--log", filepath.Join(dst.Dir, destID+".log"), id}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, c.Berthctl(), args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	t := time.Now()
	err := cmd.Run()
	r.berthWall = time.Since(t)
	if err != nil {
		b.Fatalf("berthctl %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	r.berthSummary = lines[0]
	criuDumps := 0
	for _, l := range lines[1:] {
		m := phaseLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		ms, _ := strconv.ParseFloat(m[2], 64)
		nm := m[1]
		if nm == "checkpoint/criu-dump" { // the first is migrate's (the shim's call), the second the shim's own
			criuDumps++
			if criuDumps == 2 {
				nm = "checkpoint/shim-criu-dump"
			}
		}
		r.berthPhases = append(r.berthPhases, phase{nm, time.Duration(ms * float64(time.Millisecond))})
	}
	pid, _, err := dst.TaskPID(ctx, destID)
	if err != nil {
		b.Fatal(err)
	}
	t = time.Now()
	if err := waitHealthz(ctx, pid, time.Minute); err != nil {
		b.Fatalf("%s on %s after the move: %v", destID, dst.Name, err)
	}
	r.berthReady = time.Since(t)
	_ = dst.Remove(ctx, destID)
	_ = src.Remove(ctx, id) // the task is gone; the container record stays on the source
	os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
}

// benchCtr: containerd's own path, as /work/shared/reference/03-ctr-migrate.sh: ctr containers
// checkpoint into node1's content store, stop the source (the same id is restored on node2, and
// the nodes share runc's state root), images export, images import on node2, ctr containers
// restore --live --rw (the checkpoint names the runtime, runc.v2; the base image is on node2).
func benchCtr(ctx context.Context, b *testing.B, src, dst *node.Node, mib int, work string, r *migrateResult) {
	id := fmt.Sprintf("bench-ctr-%d", mib)
	ref := fmt.Sprintf("localhost/berth/ckpt-%s:1", id)
	tar := filepath.Join(work, id+".tar")
	startInfer(ctx, b, src, id, runcRuntime, mib)
	cleanup := func() {
		bg := context.Background()
		_ = dst.Remove(bg, id)
		_, _ = src.Ctr(bg, "-n", node.Namespace, "images", "rm", "--sync", ref)
		_, _ = dst.Ctr(bg, "-n", node.Namespace, "images", "rm", "--sync", ref)
		os.Remove(tar)
		for _, n := range []*node.Node{src, dst} {
			ms, _ := filepath.Glob(filepath.Join(n.XDG, "ctrd-checkpoint*"))
			for _, m := range ms {
				os.RemoveAll(m)
			}
		}
	}
	b.Cleanup(cleanup)
	step := func(name string, fn func() error) {
		t := time.Now()
		if err := fn(); err != nil {
			b.Fatalf("ctr path, %s: %v", name, err)
		}
		r.ctrPhases = append(r.ctrPhases, phase{name, time.Since(t)})
	}
	ns := []string{"-n", node.Namespace}
	step("checkpoint", func() error {
		_, err := src.Ctr(ctx, append(ns, "containers", "checkpoint", "--task", "--rw", "--image", id, ref)...)
		return err
	})
	step("stop-source", func() error { return src.Remove(ctx, id) })
	step("export", func() error {
		_, err := src.Ctr(ctx, append(ns, "images", "export", "--skip-manifest-json", tar, ref)...)
		return err
	})
	if st, err := os.Stat(tar); err == nil {
		r.ctrBytes = st.Size()
	}
	step("import", func() error {
		_, err := dst.Ctr(ctx, append(ns, "images", "import", tar)...)
		return err
	})
	step("restore", func() error {
		_, err := dst.Ctr(ctx, append(ns, "containers", "restore", "--live", "--rw", id, ref)...)
		return err
	})
	if _, st, err := dst.TaskPID(ctx, id); err != nil || st != containerd.Running {
		b.Fatalf("ctr path: restored %s on %s is %q (%v)", id, dst.Name, st, err)
	}
	cleanup()
}

func dirBytes(dir string) int64 {
	var n int64
	_ = filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// copyTreeSync copies the regular files of src (flat or nested) to dst and fsyncs each.
func copyTreeSync(src, dst string) error {
	return filepath.Walk(src, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		out := filepath.Join(dst, rel)
		if fi.IsDir() {
			return os.MkdirAll(out, 0o700)
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		in, err := os.Open(p)
		if err != nil {
			return err
		}
		defer in.Close()
		f, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return err
		}
		if _, err := io.Copy(f, in); err != nil {
			f.Close()
			return err
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	})
}

func ms(d time.Duration) string  { return fmt.Sprintf("%.0f", float64(d.Microseconds())/1000) }
func sec(d time.Duration) string { return fmt.Sprintf("%.2f", d.Seconds()) }

func printMigrateTable(w io.Writer, rs []migrateResult) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Moving a running container (one run; seconds; 2-core VM, noisy: read the ratios)")
	fmt.Fprintln(w, "| size | raw dump | raw restore | raw sum | berth migrate (wall) | ctr path (sum) | berth/raw (target <= 2) | ctr/berth (target >= 10) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
	for _, r := range rs {
		fmt.Fprintf(w, "| %d MiB | %s | %s | %s | %s | %s | %.2f | %.2f |\n", r.mib, sec(r.rawDump), sec(r.rawRestore), sec(r.rawSum()),
			sec(r.berthWall), sec(sumPhases(r.ctrPhases)), ratio(r.berthWall, r.rawSum()), ratio(sumPhases(r.ctrPhases), r.berthWall))
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Phases (ms)")
	for _, r := range rs {
		fmt.Fprintf(w, "%d MiB:\n", r.mib)
		fmt.Fprintf(w, "  raw:   dump %s (CRIU frozen %.0f, memdump %.0f, memwrite %.0f; %d MiB of images), restore %s\n",
			ms(r.rawDump), float64(r.rawStats.FrozenTimeUs)/1000, float64(r.rawStats.MemdumpTimeUs)/1000,
			float64(r.rawStats.MemwriteTimeUs)/1000, r.rawBytes>>20, ms(r.rawRestore))
		fmt.Fprintf(w, "  this machine, on that image: one sha256 pass (oci.DigestDir, cache hot) %s, one copy with fsync %s\n",
			ms(r.digestPass), ms(r.copySync))
		fmt.Fprintf(w, "  berth: %s\n", r.berthSummary)
		var parts []string
		for _, p := range r.berthPhases {
			parts = append(parts, fmt.Sprintf("%s %s", p.name, ms(p.d)))
		}
		fmt.Fprintf(w, "         %s\n", strings.Join(parts, ", "))
		fmt.Fprintf(w, "         derived: %s\n", berthDerived(r))
		fmt.Fprintf(w, "         wall %s (berthctl start and client connects: %s over the phases); destination /healthz answered %s after exit\n",
			ms(r.berthWall), ms(r.berthWall-phaseOf(r.berthPhases, "total")), ms(r.berthReady))
		parts = parts[:0]
		for _, p := range r.ctrPhases {
			parts = append(parts, fmt.Sprintf("%s %s", p.name, ms(p.d)))
		}
		fmt.Fprintf(w, "  ctr:   %s; sum %s; exported tar %d MiB\n", strings.Join(parts, ", "), ms(sumPhases(r.ctrPhases)), r.ctrBytes>>20)
	}
}

// berthDerived splits berth's checkpoint phase using the printed phases: the migrate-side
// criu-dump includes the shim's CRIU call, its fingerprint and the shim's manifest (a sha256 pass
// over the images); the checkpoint phase's rest is the outer manifest (a second sha256 pass).
func berthDerived(r migrateResult) string {
	p := func(n string) time.Duration { return phaseOf(r.berthPhases, n) }
	outerDump := p("checkpoint/criu-dump")
	shimManifest := outerDump - p("checkpoint/shim-criu-dump") - p("checkpoint/fingerprint")
	outerManifest := p("checkpoint") - p("checkpoint/pause") - outerDump - p("checkpoint/rootfs-diff")
	return fmt.Sprintf("CRIU (shim) %s, shim manifest digest %s, outer manifest digest %s; transfer (stream+verify+fsync) %s, restore (create+verify+CRIU) %s",
		ms(p("checkpoint/shim-criu-dump")), ms(shimManifest), ms(outerManifest), ms(p("transfer")), ms(p("restore")))
}

// BenchmarkStart compares container start latency (create, task create, start through the Go
// client) with berth's shim and runc's, N alternating runs each after one warm-up, medians; and
// the resident memory of the two shims, each serving one container.
func BenchmarkStart(b *testing.B) {
	c := needCluster(b)
	n := c.Nodes[0]
	const runs = 10
	var berthMed, runcMed time.Duration
	var berthRSS, runcRSS int64
	for i := 0; i < b.N; i++ {
		berthMed, runcMed, berthRSS, runcRSS = benchStart(b, n, runs)
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(float64(berthMed.Microseconds())/1000, "berth-start-ms")
	b.ReportMetric(float64(runcMed.Microseconds())/1000, "runc-start-ms")
	b.ReportMetric(ratio(berthMed, runcMed), "start-berth/runc")
	b.ReportMetric(float64(berthRSS), "berth-shim-rss-KiB")
	b.ReportMetric(float64(runcRSS), "runc-shim-rss-KiB")
	b.ReportMetric(float64(berthRSS)/float64(runcRSS), "rss-berth/runc")
	fmt.Println()
	fmt.Printf("Container start (sleep 1000 in %s, create+task+start via the Go client, median of %d alternating, after a warm-up)\n", image.WorkloadRef, runs)
	fmt.Println("| shim | start median (ms) | shim VmRSS (KiB) |")
	fmt.Println("|---|---|---|")
	fmt.Printf("| containerd-shim-berth-v2 | %s | %d |\n", ms(berthMed), berthRSS)
	fmt.Printf("| containerd-shim-runc-v2 | %s | %d |\n", ms(runcMed), runcRSS)
	fmt.Printf("| berth/runc | %.3f (target within 5%%) | %.2f |\n", ratio(berthMed, runcMed), float64(berthRSS)/float64(runcRSS))
}

func benchStart(b *testing.B, n *node.Node, runs int) (berthMed, runcMed time.Duration, berthRSS, runcRSS int64) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	rts := []struct{ short, name string }{{"berth", berthRuntime}, {"runc", runcRuntime}}
	times := map[string][]time.Duration{}
	pids := map[string]uint32{}
	seq := 0
	start := func(short, rt string, keep bool) time.Duration {
		seq++
		id := fmt.Sprintf("bench-start-%s-%d", short, seq)
		b.Cleanup(func() { _ = n.Remove(context.Background(), id) })
		t := time.Now()
		pid, err := n.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, Args: []string{"sleep", "1000"}, Runtime: rt})
		d := time.Since(t)
		if err != nil {
			b.Fatal(err)
		}
		if keep {
			pids[short] = pid
		} else if err := n.Remove(ctx, id); err != nil {
			b.Fatal(err)
		}
		return d
	}
	for _, rt := range rts { // warm-up: binaries and image layers in the page cache
		start(rt.short, rt.name, false)
	}
	for i := 0; i < runs; i++ {
		order := rts
		if i%2 == 1 {
			order = []struct{ short, name string }{rts[1], rts[0]}
		}
		for _, rt := range order {
			times[rt.short] = append(times[rt.short], start(rt.short, rt.name, i == runs-1))
		}
	}
	time.Sleep(2 * time.Second) // let both shims settle
	rss := func(short string) int64 {
		shim, err := parentPID(pids[short])
		if err != nil {
			b.Fatal(err)
		}
		exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", shim))
		if want := "containerd-shim-" + short + "-v2"; filepath.Base(exe) != want {
			b.Fatalf("parent of the %s container's init (pid %d) is %s, not %s", short, shim, exe, want)
		}
		kb, err := vmRSS(shim)
		if err != nil {
			b.Fatal(err)
		}
		return kb
	}
	berthRSS, runcRSS = rss("berth"), rss("runc")
	return median(times["berth"]), median(times["runc"]), berthRSS, runcRSS
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func procStatus(pid int, key string) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("/proc/%d/status has no %s", pid, key)
}

func parentPID(pid uint32) (int, error) {
	v, err := procStatus(int(pid), "PPid")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(v)
}

func vmRSS(pid int) (int64, error) {
	v, err := procStatus(pid, "VmRSS")
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
}
