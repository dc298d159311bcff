package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// BenchmarkStream measures the downtime of a move as the workload's own client sees it: the gap
// between the last token streamed from the source and the first streamed from the destination.
// One session streams (5 ms between tokens) while the workload, holding 256 MiB and 1 GiB of
// weights (BERTH_BENCH_MIB; 4 GiB too where memory and disk allow, needResources says why
// not), is moved six ways, one run each, and at 1 GiB (every size with BERTH_BENCH_CTR=1) a
// seventh:
//
//	raw     CRIU alone on one node: `criu dump --tcp-close` of the workload run as a plain
//	        process, images in a directory, then `criu restore` (the A)
//	ps      CRIU's page server: `criu page-server` on the "destination", `criu dump --page-server`,
//	        the non-memory images copied beside the pages, `criu restore` (B)
//	postcopy  CRIU's post-copy: `criu dump --lazy-pages` (the source frozen, serving its pages),
//	        the non-memory images copied, `criu lazy-pages --page-server` and `criu restore
//	        --lazy-pages` (C); fs.pipe-max-size raised as for lazy
//	stored  berthctl migrate --mode stored between two containerd nodes
//	copy    berthctl migrate --mode copy
//	lazy    berthctl migrate --mode lazy (post-copy; fs.pipe-max-size raised to 4 MiB for it and
//	        put back after)
//	ctr     containerd without berth, with the runc shim (io.containerd.runc.v2) as in
//	        BenchmarkMigrate: the task checkpointed into a checkpoint image and ended (what
//	        `ctr containers checkpoint --task --rw --image` does, with containerd's
//	        WithCheckpointTaskExit: that command resumes the task and has no flag to end it), the
//	        source removed, `ctr images export`, `ctr images import` on the destination, `ctr
//	        containers restore --live --rw`, the restored task's loopback set up with nsenter and
//	        ip (runc's restore leaves it down; berth's shim sets it up) (benchStreamCtr)
//
// The client notices the source stalled (no token for 20 ms), then polls the destination every
// 5 ms and resumes the session there at the next token. Metrics per size: each path's downtime
// in ms, copy-downtime/raw, lazy-downtime/raw, stored-downtime/raw, ps-downtime/raw,
// postcopy-downtime/raw, postcopy-all-pages-ms (C: from the dump's start until the lazy-pages
// daemon has every page and exits), berth's own
// view of the copy move (migrate's downtimeMs, and afterMs: the source's teardown, off the
// critical path) and of the lazy one (lazy-pages-ms: from the destination's resume until every
// page arrived, the source frozen meanwhile). Where ctr ran: ctr-downtime-ms, ctr/berth (its
// downtime / copy mode's, copy being berth's default) and ctr/berth-lazy (/ lazy mode's); its own
// sub-benchmark reports each step's wall time (checkpoint-ms, stop-source-ms, export-ms,
// import-ms, restore-ms, loopback-up-ms). The printed table has a ctr column ("-" where it did not
// run) and the plot draws each path measured at one size only as a point.
func BenchmarkStream(b *testing.B) {
	c := needCluster(b)
	prewarm := prewarmMemory(b)
	infer := filepath.Join(b.TempDir(), "infer")
	if out, err := exec.Command("go", "build", "-o", infer, image.WorkloadPackage).CombinedOutput(); err != nil {
		b.Fatalf("build the workload for the raw CRIU paths: %v\n%s", err, out)
	}
	var rows []streamRow
	for _, mib := range streamSizes(b) {
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			needResources(b, c, mib)
			r := benchStreamSize(b, c, infer, mib)
			// a benchmark with sub-benchmarks reports nothing itself: the ratios are a leaf of their own
			b.Run("summary", func(b *testing.B) {
				b.ReportMetric(0, "ns/op")
				b.ReportMetric(ratio(r.copy, r.raw), "copy-downtime/raw")
				b.ReportMetric(ratio(r.lazy, r.raw), "lazy-downtime/raw")
				b.ReportMetric(r.lazyPages, "lazy-pages-ms")
				b.ReportMetric(ratio(r.stored, r.raw), "stored-downtime/raw")
				b.ReportMetric(ratio(r.ps, r.raw), "ps-downtime/raw")
				b.ReportMetric(ratio(r.postcopy, r.raw), "postcopy-downtime/raw")
				b.ReportMetric(r.postcopyAll, "postcopy-all-pages-ms")
				b.ReportMetric(ratio(r.lazy, r.postcopy), "lazy-downtime/postcopy")
				b.ReportMetric(ratio(r.copy, r.stored), "copy-downtime/stored")
				b.ReportMetric(r.copyReported, "copy-migrate-downtime-ms")
				b.ReportMetric(r.copyAfter, "copy-teardown-ms")
				b.ReportMetric(r.copyCPU/(float64(r.mib)/1024), "copy-berthctl-cpu-s/GiB")
				if r.ctrRun {
					b.ReportMetric(float64(r.ctr.Microseconds())/1000, "ctr-downtime-ms")
					b.ReportMetric(ratio(r.ctr, r.copy), "ctr/berth")
					b.ReportMetric(ratio(r.ctr, r.lazy), "ctr/berth-lazy")
				}
			})
			rows = append(rows, r)
		})
	}
	if len(rows) > 0 {
		fmt.Println()
		fmt.Println(prewarm)
		fmt.Println("downtime seen by the workload's client (last token from the source -> first from the destination), one run:")
		fmt.Printf("%8s %9s %9s %11s %9s %9s %9s %9s %10s %10s %12s %10s %10s %14s %14s %12s %12s %15s\n", "MiB", "raw ms", "ps ms", "postcopy ms", "stored ms", "copy ms", "lazy ms", "ctr ms",
			"copy/raw", "lazy/raw", "stored/raw", "ps/raw", "ctr/berth", "ctr/berth-lazy", "copy migrate", "teardown", "lazy pages", "postcopy pages")
		for _, r := range rows {
			ctrMs, ctrCopy, ctrLazy := "-", "-", "-"
			if r.ctrRun {
				ctrMs, ctrCopy, ctrLazy = ms(r.ctr), fmt.Sprintf("%.2f", ratio(r.ctr, r.copy)), fmt.Sprintf("%.2f", ratio(r.ctr, r.lazy))
			}
			fmt.Printf("%8d %9s %9s %11s %9s %9s %9s %9s %10.2f %10.2f %12.2f %10.2f %10s %14s %11.0f ms %9.0f ms %9.0f ms %12.0f ms\n", r.mib, ms(r.raw), ms(r.ps), ms(r.postcopy), ms(r.stored), ms(r.copy), ms(r.lazy), ctrMs,
				ratio(r.copy, r.raw), ratio(r.lazy, r.raw), ratio(r.stored, r.raw), ratio(r.ps, r.raw), ctrCopy, ctrLazy, r.copyReported, r.copyAfter, r.lazyPages, r.postcopyAll)
		}
		fmt.Println("(ctr: checkpoint, export, import, restore with containerd's ctr and the runc shim; ctr/berth: its downtime / berth copy mode's, ctr/berth-lazy: / lazy mode's; \"-\": not run at that size, BERTH_BENCH_CTR=1 runs it at every size)")
		fmt.Println("(lazy pages: from the destination's resume until every page arrived; postcopy pages: from the dump's start until the lazy-pages daemon exits)")
		// the curve, drawn from these results: BERTH_BENCH_PLOT names the file (default
		// _output/bench-stream.png in the repository)
		plotPath := os.Getenv("BERTH_BENCH_PLOT")
		if plotPath == "" {
			plotPath = filepath.Join("..", "..", "_output", "bench-stream.png")
		}
		if err := plotStream(rows, plotPath); err != nil {
			b.Logf("no plot: %v", err)
		} else {
			fmt.Println("plot:", plotPath)
		}
	}
}

// streamSizes are BenchmarkStream's sizes in MiB: BERTH_BENCH_MIB's, or issue 12's 256 MiB,
// 1 GiB and 4 GiB (each skipped, saying why, where memory or disk is short: needResources).
func streamSizes(b *testing.B) []int {
	if os.Getenv("BERTH_BENCH_MIB") != "" {
		return benchSizes(b)
	}
	return []int{256, 1024, 4096}
}

type streamRow struct {
	mib                                   int
	raw, ps, postcopy, stored, copy, lazy time.Duration
	ctr                                   time.Duration // the ctr path (benchStreamCtr); 0 where it failed or did not run
	ctrRun                                bool          // the ctr path ran at this size (streamCtrAt)
	postcopyAll                           float64       // C: ms from the dump's start until every page arrived
	copyReported, copyAfter               float64       // migrate's own downtimeMs and afterMs, copy mode
	copyCPU                               float64       // berthctl migrate's CPU time (user+system, its page server's included), s, copy mode
	storedReported, storedAfter           float64
	lazyPages                             float64 // migrate's pagesMs, lazy mode
}

func benchStreamSize(b *testing.B, c *node.Cluster, infer string, mib int) streamRow {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	work := filepath.Join(filepath.Dir(c.Nodes[0].Dir), fmt.Sprintf("bench-stream-%d", mib))
	if err := os.MkdirAll(work, 0o700); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(work) })
	r := streamRow{mib: mib}
	// each path in its own sub-benchmark: one that fails leaves the others' figures (0 for it)
	report := func(b *testing.B, d time.Duration) {
		b.ReportMetric(0, "ns/op")
		b.ReportMetric(float64(d.Microseconds())/1000, "downtime-ms")
	}
	b.Run("raw", func(b *testing.B) { r.raw, _ = benchStreamRaw(ctx, b, infer, mib, work, "raw"); report(b, r.raw) })
	b.Run("ps", func(b *testing.B) { r.ps, _ = benchStreamRaw(ctx, b, infer, mib, work, "ps"); report(b, r.ps) })
	b.Run("postcopy", func(b *testing.B) {
		setPipeMaxSize(b, criu.MinLazyPipeMaxSize, false)
		var all time.Duration
		r.postcopy, all = benchStreamRaw(ctx, b, infer, mib, work, "postcopy")
		r.postcopyAll = float64(all.Microseconds()) / 1000
		report(b, r.postcopy)
		b.ReportMetric(r.postcopyAll, "all-pages-ms")
	})
	b.Run("stored", func(b *testing.B) {
		var f migrateFigures
		r.stored, f = benchStreamBerth(ctx, b, c, mib, work, "stored")
		r.storedReported, r.storedAfter = f.DowntimeMs, f.AfterMs
		report(b, r.stored)
	})
	b.Run("copy", func(b *testing.B) {
		var f migrateFigures
		r.copy, f = benchStreamBerth(ctx, b, c, mib, work, "copy")
		r.copyReported, r.copyAfter, r.copyCPU = f.DowntimeMs, f.AfterMs, f.CPUs
		report(b, r.copy)
	})
	b.Run("lazy", func(b *testing.B) {
		setPipeMaxSize(b, criu.MinLazyPipeMaxSize, false)
		var f migrateFigures
		r.lazy, f = benchStreamBerth(ctx, b, c, mib, work, "lazy")
		r.lazyPages = f.PagesMs
		report(b, r.lazy)
	})
	if r.ctrRun = streamCtrAt(mib); r.ctrRun {
		b.Run("ctr", func(b *testing.B) {
			var steps []time.Duration
			r.ctr, steps = benchStreamCtr(ctx, b, c, mib, work)
			report(b, r.ctr)
			for i, d := range steps {
				b.ReportMetric(float64(d.Microseconds())/1000, ctrStepNames[i]+"-ms")
			}
		})
	}
	return r
}

// downtimeWatch streams one session from src and, once moved is closed and the source stalled,
// resumes it on whatever dst returns (nil while the destination is not there yet).
type downtimeWatch struct {
	mu       sync.Mutex
	last     time.Time // arrival of the last token from the source
	lastIdx  int
	first    time.Time // arrival of the first token from the destination
	done     chan struct{}
	err      error
	started  chan struct{}
	startOne sync.Once
}

const watchTokens = 1 << 20

func watchDowntime(ctx context.Context, src client.Target, dst func(context.Context) *client.Target, moved <-chan struct{}) *downtimeWatch {
	w := &downtimeWatch{done: make(chan struct{}), started: make(chan struct{}), lastIdx: -1}
	ctx, cancel := context.WithCancel(ctx)
	req := client.Request{Session: "dt", Prompt: "measure the downtime", N: watchTokens, Delay: 5 * time.Millisecond, IdleTimeout: -1,
		OnToken: func(i int, _ string) {
			w.mu.Lock()
			w.last, w.lastIdx = time.Now(), i
			w.mu.Unlock()
			if i >= 20 {
				w.startOne.Do(func() { close(w.started) })
			}
		}}
	go func() { _, _ = client.Stream(ctx, src, req) }()
	go func() {
		defer close(w.done)
		defer cancel()
		select {
		case <-moved:
		case <-ctx.Done():
			w.err = ctx.Err()
			return
		}
		for ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
			w.mu.Lock()
			stalled, from := time.Since(w.last) > 20*time.Millisecond, w.lastIdx+1
			w.mu.Unlock()
			if !stalled {
				continue
			}
			t := dst(ctx)
			if t == nil {
				continue
			}
			got := make(chan struct{})
			var once sync.Once
			sctx, scancel := context.WithCancel(ctx)
			r2 := client.Request{Session: "dt", N: watchTokens, From: from, Delay: 5 * time.Millisecond, IdleTimeout: 10 * time.Second,
				OnToken: func(int, string) {
					once.Do(func() {
						w.mu.Lock()
						w.first = time.Now()
						w.mu.Unlock()
						close(got)
						scancel()
					})
				}}
			_, _ = client.Stream(sctx, *t, r2)
			scancel()
			select {
			case <-got:
				return
			default:
			}
		}
		w.err = ctx.Err()
	}()
	return w
}

// wait returns the downtime once the destination streamed.
func (w *downtimeWatch) wait(ctx context.Context, b *testing.B) time.Duration {
	select {
	case <-w.done:
	case <-ctx.Done():
		b.Fatalf("no token from the destination: %v", ctx.Err())
	}
	if w.err != nil {
		b.Fatalf("downtime watch: %v", w.err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.first.Sub(w.last)
}

func (w *downtimeWatch) waitStarted(ctx context.Context, b *testing.B) {
	select {
	case <-w.started:
	case <-ctx.Done():
		b.Fatal("the session never streamed from the source")
	case <-time.After(2 * time.Minute):
		b.Fatal("the session never streamed from the source")
	}
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(b *testing.B) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// benchStreamRaw runs the workload as a plain process and moves it with CRIU alone on this
// node: to an image directory (kind "raw", A), through `criu page-server` ("ps", B), or post-copy
// ("postcopy", C). It returns the downtime the client saw and, for C, the time from the dump's
// start until the lazy-pages daemon had every page and exited.
func benchStreamRaw(ctx context.Context, b *testing.B, infer string, mib int, work, kind string) (downtime, allPages time.Duration) {
	criuBin, err := exec.LookPath("criu")
	if err != nil {
		b.Fatal(err)
	}
	dir := filepath.Join(work, kind)
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	for _, d := range []string{src, dst} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			b.Fatal(err)
		}
	}
	defer os.RemoveAll(dir)
	listen := fmt.Sprintf("127.0.0.1:%d", freePort(b))
	args := []string{"-listen", listen, "-weights-mib", strconv.Itoa(mib), "-seed", "7", "-delay-ms", "0"}
	// C restores its copy beside the source, which stays frozen serving its pages: the workload
	// runs in its own PID and network namespaces (as the first process of both and leader of its
	// own session, loopback up), so that CRIU restores the copy into new ones, with the same PID
	// and port free there
	nsed := kind == "postcopy"
	cmd := exec.Command(infer, args...)
	if nsed {
		cmd = exec.Command("unshare", append([]string{"--pid", "--net", "--fork", "sh", "-c", `ip link set lo up && exec setsid "$0" "$@"`, infer}, args...)...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // its own session: no --shell-job
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
	}()
	wpid := cmd.Process.Pid
	t := client.Target{BaseURL: "http://" + listen}
	if nsed {
		wpid = childOf(ctx, b, wpid)
		t.DialContext = node.NetnsDialer(wpid)
		defer func() { // unshare ends with its child: while unshare runs, wpid is the workload
			select {
			case <-exited:
			default:
				_ = syscall.Kill(wpid, syscall.SIGKILL)
			}
		}()
	}
	wctx, wcancel := context.WithTimeout(ctx, 3*time.Minute)
	defer wcancel()
	if err := client.WaitReady(wctx, t, 20*time.Millisecond); err != nil {
		b.Fatalf("%s workload: %v", kind, err)
	}
	moved := make(chan struct{})
	restored := make(chan struct{})
	dstT := t
	w := watchDowntime(ctx, t, func(context.Context) *client.Target {
		select {
		case <-restored:
			return &dstT
		default:
			return nil
		}
	}, moved)
	w.waitStarted(ctx, b)
	run := func(args ...string) { // args hold "-D", DIR and "-o", LOG (relative to DIR)
		if out, err := exec.CommandContext(ctx, criuBin, args...).CombinedOutput(); err != nil {
			var log []byte
			if d, l := argAfter(args, "-D"), argAfter(args, "-o"); d != "" && l != "" {
				log, _ = os.ReadFile(filepath.Join(d, l))
			}
			b.Fatalf("criu %s: %v\n%s\nlog:\n%s", strings.Join(args, " "), err, out, tail(log, 3000))
		}
	}
	pid := strconv.Itoa(wpid)
	close(moved)
	dumpStart := time.Now()
	copyImages := func() {
		ents, _ := os.ReadDir(src)
		for _, e := range ents {
			if !e.Type().IsRegular() || strings.HasSuffix(e.Name(), ".log") {
				continue
			}
			data, err := os.ReadFile(filepath.Join(src, e.Name()))
			if err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dst, e.Name()), data, 0o600); err != nil {
				b.Fatal(err)
			}
		}
	}
	var lazyPages *exec.Cmd
	lazyDone := make(chan error, 1)
	switch kind {
	case "postcopy":
		// the source is frozen and serves its pages once the dump says it is ready (status fd)
		port := strconv.Itoa(freePort(b))
		dump := exec.CommandContext(ctx, criuBin, "dump", "-t", pid, "--tcp-close", "--lazy-pages", "--address", "127.0.0.1", "--port", port,
			"-D", src, "-o", "dump.log", "--status-fd", "3")
		dumpReady := startWithStatus(b, dump)
		dumpDone := make(chan error, 1)
		go func() { dumpDone <- dump.Wait() }()
		defer func() {
			_ = dump.Process.Kill()
			<-dumpDone
		}()
		waitStatus(ctx, b, "criu dump --lazy-pages", dumpReady, dumpDone, filepath.Join(src, "dump.log"))
		copyImages()
		lazyPages = exec.CommandContext(ctx, criuBin, "lazy-pages", "--page-server", "--address", "127.0.0.1", "--port", port,
			"-D", dst, "-o", "lazy-pages.log", "--status-fd", "3")
		lpReady := startWithStatus(b, lazyPages)
		go func() { lazyDone <- lazyPages.Wait() }()
		defer func() {
			_ = lazyPages.Process.Kill()
		}()
		waitStatus(ctx, b, "criu lazy-pages", lpReady, lazyDone, filepath.Join(dst, "lazy-pages.log"))
	case "ps":
		port := strconv.Itoa(freePort(b))
		ps := exec.CommandContext(ctx, criuBin, "page-server", "--images-dir", dst, "--address", "127.0.0.1", "--port", port,
			"-o", filepath.Join(dir, "page-server.log"))
		if err := ps.Start(); err != nil {
			b.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // the page server listens (it has no readiness signal without --status-fd)
		run("dump", "-t", pid, "--tcp-close", "--page-server", "--address", "127.0.0.1", "--port", port, "-D", src, "-o", "dump.log")
		if err := ps.Wait(); err != nil {
			b.Fatalf("criu page-server: %v", err)
		}
		copyImages()
		<-exited // CRIU ended the source
	default:
		run("dump", "-t", pid, "--tcp-close", "-D", src, "-o", "dump.log")
		dst = src
		<-exited // CRIU ended the source
	}
	pidfile := filepath.Join(dir, "restored.pid")
	if kind == "postcopy" {
		run("restore", "-d", "--tcp-close", "--lazy-pages", "-D", dst, "-o", "restore.log", "--pidfile", pidfile)
	} else {
		run("restore", "-d", "--tcp-close", "-D", dst, "-o", "restore.log", "--pidfile", pidfile)
	}
	rpid := 0
	if data, err := os.ReadFile(pidfile); err == nil {
		rpid, _ = strconv.Atoi(strings.TrimSpace(string(data)))
	}
	if rpid <= 0 {
		b.Fatalf("criu restore wrote no pid to %s", pidfile)
	}
	defer func() { _ = syscall.Kill(rpid, syscall.SIGKILL) }()
	if nsed {
		dstT.DialContext = node.NetnsDialer(rpid)
	}
	close(restored)
	downtime = w.wait(ctx, b)
	if lazyPages != nil {
		select {
		case err := <-lazyDone:
			if err != nil {
				log, _ := os.ReadFile(filepath.Join(dst, "lazy-pages.log"))
				b.Fatalf("criu lazy-pages: %v\n%s", err, tail(log, 2000))
			}
			allPages = time.Since(dumpStart)
		case <-ctx.Done():
			b.Fatalf("criu lazy-pages did not finish: %v", ctx.Err())
		}
		<-exited // the frozen source ends once its pages are served
	}
	return downtime, allPages
}

// childOf waits until process pid (unshare --fork) has its child, and returns the child's PID.
func childOf(ctx context.Context, b *testing.B, pid int) int {
	for ctx.Err() == nil {
		data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		if f := strings.Fields(string(data)); len(f) > 0 {
			if c, err := strconv.Atoi(f[0]); err == nil {
				return c
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.Fatalf("process %d started no child: %v", pid, ctx.Err())
	return 0
}

// startWithStatus starts cmd (a criu command given --status-fd 3) with a pipe as fd 3 and
// returns the read end, on which criu writes once it is ready.
func startWithStatus(b *testing.B, cmd *exec.Cmd) *os.File {
	r, w, err := os.Pipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.ExtraFiles = []*os.File{w}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	w.Close()
	return r
}

// waitStatus waits until criu (what) reports ready on status, failing with its log's tail if it
// exits first (its Wait error is put back on done, buffered, for the caller's cleanup) or ctx ends.
func waitStatus(ctx context.Context, b *testing.B, what string, status *os.File, done chan error, logPath string) {
	ready := make(chan bool, 1)
	go func() {
		defer status.Close()
		var buf [1]byte
		n, _ := status.Read(buf[:])
		ready <- n == 1
	}()
	fail := func(why string) {
		log, _ := os.ReadFile(logPath)
		b.Fatalf("%s %s\n%s", what, why, tail(log, 2000))
	}
	select {
	case ok := <-ready:
		if !ok {
			fail("closed its status fd without reporting ready")
		}
	case err := <-done:
		done <- err
		fail(fmt.Sprintf("exited before it was ready: %v", err))
	case <-ctx.Done():
		fail("was not ready: " + ctx.Err().Error())
	}
}

// argAfter returns the argument after flag in args, "" when there is none.
func argAfter(args []string, flag string) string {
	for i, a := range args[:max(len(args)-1, 0)] {
		if a == flag {
			return args[i+1]
		}
	}
	return ""
}

// tail returns the last n bytes of b.
func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// migrateFigures are migrate's own figures of a move (-o json), in ms: downtime, what came after
// the destination served, and (lazy mode) the time until every page arrived.
type migrateFigures struct {
	DowntimeMs, AfterMs, PagesMs float64
	// CPUs is berthctl's CPU time, user and system, in seconds: its relay and in-process
	// receiver, and the `criu page-server` that receiver ran (reaped by it).
	CPUs float64
}

// benchStreamBerth moves the workload with berthctl migrate --mode mode and returns the
// client's downtime and migrate's own figures.
func benchStreamBerth(ctx context.Context, b *testing.B, c *node.Cluster, mib int, work, mode string) (time.Duration, migrateFigures) {
	src, dst := c.Nodes[0], c.Nodes[1]
	id := fmt.Sprintf("bench-stream-%s-%d", mode, mib)
	destID, name := id+"-moved", id+"-ckpt"
	pid := startInfer(ctx, b, src, id, berthRuntime, mib)
	b.Cleanup(func() {
		_ = dst.Remove(context.Background(), destID)
		os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
	})
	srcT := client.Target{BaseURL: "http://" + inferListen, DialContext: node.NetnsDialer(int(pid))}
	moved := make(chan struct{})
	w := watchDowntime(ctx, srcT, func(ctx context.Context) *client.Target {
		p, _, err := dst.TaskPID(ctx, destID)
		if err != nil || p == 0 {
			return nil
		}
		return &client.Target{BaseURL: "http://" + inferListen, DialContext: node.NetnsDialer(int(p))}
	}, moved)
	w.waitStarted(ctx, b)
	args := []string{"migrate", "--mode", mode, "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--root", dst.CheckpointRoot, "--id", destID, "--work-dir", filepath.Join(work, "outgoing"),
		"--name", name, "--log", filepath.Join(dst.Dir, destID+".log"), "-o", "json", id}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, c.Berthctl(), args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	close(moved)
	if err := cmd.Run(); err != nil {
		b.Fatalf("berthctl %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	d := w.wait(ctx, b)
	var res struct {
		DowntimeMs, AfterMs, PagesMs float64
		Phases                       []struct {
			Name string
			Ms   float64
		}
	}
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		b.Fatalf("migrate's JSON: %v\n%s", err, stdout.String())
	}
	var phases []string
	for _, p := range res.Phases {
		phases = append(phases, fmt.Sprintf("%s %.0f", p.Name, p.Ms))
	}
	b.Logf("%s %d MiB: client downtime %v, migrate downtimeMs %.0f afterMs %.0f; phases (ms): %s", mode, mib, d, res.DowntimeMs, res.AfterMs, strings.Join(phases, ", "))
	_ = dst.Remove(ctx, destID)
	_ = src.Remove(ctx, id)
	os.RemoveAll(filepath.Join(dst.CheckpointRoot, name))
	cpu := (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
	b.Logf("%s %d MiB: berthctl migrate CPU %.2f s (user %.2f, system %.2f)", mode, mib, cpu, cmd.ProcessState.UserTime().Seconds(), cmd.ProcessState.SystemTime().Seconds())
	return d, migrateFigures{DowntimeMs: res.DowntimeMs, AfterMs: res.AfterMs, PagesMs: res.PagesMs, CPUs: cpu}
}

// ctrStepNames are the ctr path's steps in order; each is a metric of the ctr sub-benchmark
// (NAME-ms).
var ctrStepNames = []string{"checkpoint", "stop-source", "export", "import", "restore", "loopback-up"}

// streamCtrAt reports whether BenchmarkStream moves the workload the ctr way at mib: at 1 GiB
// (issue 12's size for ctr/berth), and at every size when BERTH_BENCH_CTR=1.
func streamCtrAt(mib int) bool {
	return mib == 1024 || os.Getenv("BERTH_BENCH_CTR") == "1"
}

// benchStreamCtr moves the workload from the cluster's first node to its second the way a
// containerd user without berth would, with the runc shim (io.containerd.runc.v2, as
// BenchmarkMigrate's ctr path), and returns the downtime the client saw and each step's wall time
// (ctrStepNames' order). The steps are BenchmarkMigrate's (benchCtr), but the checkpoint ends the
// source's task: `ctr containers checkpoint --task --rw --image` (containerd 2.4) resumes the task
// after its checkpoint and has no flag to end it, so this checkpoint is what that command does
// (pause, then Container.Checkpoint with the runtime, image, rw layer and task), written with
// containerd's client and WithCheckpointTaskExit added, so that the source never serves past its
// checkpoint. The workload is started with runc's org.criu.config naming a file that says
// tcp-close (the client's session is an established connection). Then the stopped source is
// removed (the nodes share runc's state root and the same id is restored), `ctr images export
// --skip-manifest-json`, `ctr images import` on the destination and `ctr containers restore --live
// --rw` there, and the restored task's loopback set up (`nsenter -t PID -n ip link set lo up`:
// runc's restore leaves it down, criu#590, and the workload listens on 127.0.0.1). A failed step
// fails b naming the step, the node and the command's output; b's cleanup removes what the path
// made on either node (the containers and their snapshots, the checkpoint image, the tar,
// containerd's unpacked checkpoints) and fails b if any of it is still there.
func benchStreamCtr(ctx context.Context, b *testing.B, c *node.Cluster, mib int, work string) (time.Duration, []time.Duration) {
	src, dst := c.Nodes[0], c.Nodes[1]
	id := fmt.Sprintf("bench-stream-ctr-%d", mib)
	ref := fmt.Sprintf("localhost/berth/ckpt-%s:1", id)
	tar := filepath.Join(work, id+".tar")
	ns := []string{"-n", node.Namespace}
	b.Cleanup(func() {
		bg, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for _, n := range []*node.Node{src, dst} {
			_ = n.Remove(bg, id)
			_, _ = n.Ctr(bg, append(ns, "images", "rm", "--sync", ref)...)
		}
		os.Remove(tar)
		os.Remove(filepath.Join(work, id+"-criu.conf"))
		for _, n := range []*node.Node{src, dst} {
			ms, _ := filepath.Glob(filepath.Join(n.XDG, "ctrd-checkpoint*"))
			for _, m := range ms {
				os.RemoveAll(m)
			}
		}
		for _, n := range []*node.Node{src, dst} {
			if left := ctrLeftovers(bg, n, id, ref); len(left) > 0 {
				b.Errorf("ctr path left on %s: %s", n.Name, strings.Join(left, "; "))
			}
		}
		if _, err := os.Stat(tar); err == nil {
			b.Errorf("ctr path left %s", tar)
		}
	})
	// the client's session is an established TCP connection, which CRIU refuses to dump unless
	// told what to do with it: runc hands CRIU the file that the spec's org.criu.config names, on
	// checkpoint and on restore, and tcp-close closes it (as raw CRIU's --tcp-close and berth's
	// shim default); the restore reads the same path (both nodes are on this host)
	criuConf := filepath.Join(work, id+"-criu.conf")
	if err := os.WriteFile(criuConf, []byte("tcp-close\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, Args: inferArgs(mib), Runtime: runcRuntime,
		LogPath: filepath.Join(src.Dir, id+".log"), Annotations: map[string]string{oci.AnnotationCRIUConfig: criuConf}})
	if err != nil {
		b.Fatalf("ctr path, start the workload on %s: %v", src.Name, err)
	}
	if err := waitHealthz(ctx, pid, 3*time.Minute); err != nil {
		b.Fatalf("ctr path, %s on %s: %v", id, src.Name, err)
	}
	srcT := client.Target{BaseURL: "http://" + inferListen, DialContext: node.NetnsDialer(int(pid))}
	moved := make(chan struct{})
	restored := make(chan struct{})
	w := watchDowntime(ctx, srcT, func(ctx context.Context) *client.Target {
		select {
		case <-restored:
		default:
			return nil
		}
		p, _, err := dst.TaskPID(ctx, id)
		if err != nil || p == 0 {
			return nil
		}
		return &client.Target{BaseURL: "http://" + inferListen, DialContext: node.NetnsDialer(int(p))}
	}, moved)
	w.waitStarted(ctx, b)
	var steps []time.Duration
	step := func(name string, n *node.Node, fn func() error) {
		t := time.Now()
		if err := fn(); err != nil {
			b.Fatalf("ctr path, %s on %s: %v%s", name, n.Name, err, criuLogTail(err))
		}
		steps = append(steps, time.Since(t))
	}
	close(moved)
	step("checkpoint", src, func() error { return checkpointExit(ctx, src, id, ref) })
	step("stop-source", src, func() error { return src.Remove(ctx, id) })
	step("export", src, func() error {
		_, err := src.Ctr(ctx, append(ns, "images", "export", "--skip-manifest-json", tar, ref)...)
		return err
	})
	step("import", dst, func() error {
		_, err := dst.Ctr(ctx, append(ns, "images", "import", tar)...)
		return err
	})
	step("restore", dst, func() error {
		_, err := dst.Ctr(ctx, append(ns, "containers", "restore", "--live", "--rw", id, ref)...)
		return err
	})
	// runc restores a container that owns its network namespace with "lo" down
	// (checkpoint-restore/criu#590; berth's shim sets it up, shim/loopback.go): the workload,
	// listening on 127.0.0.1, serves nobody until its user sets it up by hand
	step("loopback-up", dst, func() error {
		p, st, err := dst.TaskPID(ctx, id)
		if err != nil {
			return err
		}
		if st != containerd.Running {
			return fmt.Errorf("restored %s is %q, not running", id, st)
		}
		if out, err := exec.CommandContext(ctx, "nsenter", "-t", strconv.Itoa(int(p)), "-n", "ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			return fmt.Errorf("nsenter -t %d -n ip link set lo up: %w: %s", p, err, out)
		}
		return nil
	})
	close(restored)
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer wcancel()
	d := w.wait(wctx, b)
	if _, st, err := dst.TaskPID(ctx, id); err != nil || st != containerd.Running {
		b.Fatalf("ctr path: restored %s on %s is %q (%v)", id, dst.Name, st, err)
	}
	var parts []string
	for i, s := range steps {
		parts = append(parts, fmt.Sprintf("%s %d", ctrStepNames[i], s.Milliseconds()))
	}
	var size int64
	if st, err := os.Stat(tar); err == nil {
		size = st.Size()
	}
	b.Logf("ctr %d MiB: client downtime %v; steps (ms): %s; exported tar %d MiB", mib, d, strings.Join(parts, ", "), size>>20)
	return d, steps
}

// checkpointExit checkpoints container id on n into the checkpoint image ref as `ctr containers
// checkpoint --task --rw --image ID REF` does (the task paused, then the runtime's options, the
// base image, the rw layer's diff and the task's CRIU images in one index), except that the task
// exits after its dump (containerd's WithCheckpointTaskExit; runc checkpoint without
// --leave-running). A failed checkpoint resumes the task, as ctr does. Errors name the container
// and the node.
func checkpointExit(ctx context.Context, n *node.Node, id, ref string) error {
	cl, err := n.Client()
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx = namespaces.WithNamespace(ctx, node.Namespace)
	ctr, err := cl.LoadContainer(ctx, id)
	if err != nil {
		return err
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		return err
	}
	if err := task.Pause(ctx); err != nil {
		return fmt.Errorf("pause %s on %s: %w", id, n.Name, err)
	}
	// WithCheckpointTaskExit before WithCheckpointTask, which sends the options
	if _, err := ctr.Checkpoint(ctx, ref, containerd.WithCheckpointRuntime, containerd.WithCheckpointImage,
		containerd.WithCheckpointRW, containerd.WithCheckpointTaskExit, containerd.WithCheckpointTask); err != nil {
		_ = task.Resume(ctx)
		return fmt.Errorf("checkpoint %s on %s into %s: %w", id, n.Name, ref, err)
	}
	return nil
}

// ctrLeftovers lists what the ctr path named id made and n still holds: the container, its
// snapshot, the checkpoint image ref, containerd's unpacked checkpoints under n's XDG_RUNTIME_DIR.
func ctrLeftovers(ctx context.Context, n *node.Node, id, ref string) []string {
	var left []string
	if ids, err := n.Containers(ctx); err != nil {
		left = append(left, "containers unknown: "+err.Error())
	} else if slices.Contains(ids, id) {
		left = append(left, "container "+id)
	}
	if out, err := n.Ctr(ctx, "-n", node.Namespace, "images", "ls", "-q"); err != nil {
		left = append(left, "images unknown: "+err.Error())
	} else if slices.Contains(strings.Fields(out), ref) {
		left = append(left, "image "+ref)
	}
	if out, err := n.Ctr(ctx, "-n", node.Namespace, "snapshots", "ls"); err != nil {
		left = append(left, "snapshots unknown: "+err.Error())
	} else {
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 0 && f[0] == id {
				left = append(left, "snapshot "+id)
			}
		}
	}
	if ms, _ := filepath.Glob(filepath.Join(n.XDG, "ctrd-checkpoint*")); len(ms) > 0 {
		left = append(left, "unpacked checkpoints "+strings.Join(ms, ", "))
	}
	return left
}

// criuLogTail returns the last 3000 bytes of the CRIU log that a runc error names ("criu failed:
// ... path= FILE"), under a heading; "" when err names none or it cannot be read (the task's
// bundle, where runc's shim keeps it, is gone once the task is deleted).
func criuLogTail(err error) string {
	m := regexp.MustCompile(`path= ?(\S+\.log)`).FindStringSubmatch(err.Error())
	if m == nil {
		return ""
	}
	log, rerr := os.ReadFile(m[1])
	if rerr != nil {
		return ""
	}
	return "\n" + m[1] + ":\n" + tail(log, 3000)
}
