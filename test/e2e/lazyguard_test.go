package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	apievents "github.com/containerd/containerd/api/events"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"google.golang.org/protobuf/proto"

	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// stallProxy forwards connections to target; once n bytes went from a client to target on
// one connection, that direction of that connection stalls (nothing more is forwarded; the
// connection is closed once the client closed it) and at is called once, in its own goroutine.
func stallProxy(t *testing.T, target string, n int64, at func()) string {
	return proxyAfter(t, target, n, at, true)
}

// proxyAfter is stallProxy with stall; without, once n bytes went from a client to target on
// one connection, at is called (once) and that direction waits for it to return, then goes on.
func proxyAfter(t *testing.T, target string, n int64, at func(), stall bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	fltNoErr(t, err)
	var once sync.Once
	var held []net.Conn
	var mu sync.Mutex
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
			mu.Lock()
			held = append(held, in, out)
			mu.Unlock()
			go func() { _, _ = io.Copy(in, out); in.Close() }()
			go func() {
				k, _ := io.CopyN(out, in, n)
				switch {
				case k < n:
				case stall:
					once.Do(func() { go at() })
					// stalled: nothing more is forwarded; the client's end still ends the
					// connection (a killed client is a cut link, as without the proxy)
					_, _ = io.Copy(io.Discard, in)
				default:
					once.Do(at)
					_, _ = io.Copy(out, in)
				}
				out.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// TestLazyModeBerthctlKilled kills the mover during the lazy window: the destination task was
// restored and runs while its pages still come from the frozen source, and the page stream is
// stalled (deterministically, by a proxy after 16 MiB of pages) so that most of the 256 MiB
// are missing. Then `berthctl migrate` is SIGKILLed (and, in the second case, the destination's
// `berthctl receive` too, which runs the lazy-pages daemon's guard). The daemon's guard must
// kill the destination task before the daemon loses its input: a request to the destination
// task made in the window (it reads the weights, mostly missing pages) never answers with a
// wrong checksum (missing pages read as zeros), the destination holds no container, checkpoint,
// lazy-pages directory, daemon or guard afterwards, its containerd log holds the shim's report,
// and the source, resumed by its pause lease, is the same process with its weights intact,
// still streaming.
func TestLazyModeBerthctlKilled(t *testing.T) {
	c := needCluster(t)
	lazyPipes(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const at = 16 << 20
	for _, tc := range []struct {
		name         string
		killReceiver bool
	}{
		{"migrate-killed", false},
		{"migrate-and-receiver-killed", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "lazykill-" + tc.name
			w := copyFaultWorkload(t, ctx, src, id, 256)
			stampDirExists(t, dst)
			before := fltDstState(t, ctx, dst)
			work := t.TempDir()
			target, name := id+"-moved", id+"-ck"
			t.Cleanup(func() { _ = dst.Remove(context.Background(), target) })
			logBefore, _ := os.ReadFile(dst.Log)
			rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
			exits := watchExits(t, ctx, dst, target)
			taskLog := filepath.Join(t.TempDir(), "moved.log")
			cmd := exec.CommandContext(ctx, c.Berthctl(), "migrate", "--lazy", "--pause-lease", "5s", "--log", taskLog,
				"--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
				"--id", target, "--work-dir", work, "--name", name, id)
			var out strings.Builder
			cmd.Stdout, cmd.Stderr = &out, &out
			type probe struct {
				sum string
				err error
			}
			probed := make(chan probe, 1)
			var waited <-chan containerd.ExitStatus // the destination task's exit, from its shim's Wait
			killed := make(chan struct{})
			addr := stallProxy(t, rcv.addr, at, func() {
				defer close(killed)
				// the destination task runs (restored lazily) while the stream is stalled
				var pid uint32
				deadline := time.Now().Add(30 * time.Second)
				for time.Now().Before(deadline) {
					p, st, err := dst.TaskPID(ctx, target)
					if err == nil && st == containerd.Running {
						pid = p
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				if pid == 0 {
					t.Errorf("the destination task %s did not run within 30s of the stall", target)
				} else {
					if ch, err := waitTaskExit(ctx, dst, target); err != nil {
						t.Errorf("wait for the destination task %s: %v", target, err)
					} else {
						waited = ch
					}
					go func() {
						pctx, pcancel := context.WithTimeout(ctx, 60*time.Second)
						defer pcancel()
						st, err := client.Stats(pctx, client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))})
						probed <- probe{st.WeightsChecksum, err}
					}()
					time.Sleep(500 * time.Millisecond) // the request is in, blocked on missing pages
				}
				_ = cmd.Process.Signal(syscall.SIGKILL)
				t.Logf("SIGKILLed berthctl migrate %d", cmd.Process.Pid)
				if tc.killReceiver {
					rcv.kill()
					t.Logf("SIGKILLed berthctl receive")
				}
			})
			cmd.Args = append(cmd.Args[:len(cmd.Args)-1], "--receiver", addr, id)
			fltNoErr(t, cmd.Start())
			err := cmd.Wait()
			<-killed
			if err == nil {
				t.Fatalf("berthctl migrate ended successfully although it was killed mid-stream:\n%s", out.String())
			}
			t.Logf("berthctl migrate: %v\n%s", err, out.String())
			select {
			case p := <-probed:
				if p.err == nil && p.sum != w.checksum {
					t.Errorf("the destination task answered with weights checksum %s, the source's is %s: it ran with missing pages read as zeros", p.sum, w.checksum)
				}
				t.Logf("request to the destination task in the window: checksum %q, %v", p.sum, p.err)
			case <-time.After(90 * time.Second):
				t.Errorf("the request to the destination task neither answered nor failed in 90s (the task still blocked on missing pages?)")
			}
			// the guard works on: wait until it and the daemon are gone
			deadline := time.Now().Add(60 * time.Second)
			for time.Now().Before(deadline) && len(findProc("lazy-guard", "/"+name))+len(findProc("criu", "lazy-pages", "/.lazy-"+name)) > 0 {
				time.Sleep(100 * time.Millisecond)
			}
			if left := findProc("criu", "lazy-pages", "/.lazy-"+name); len(left) > 0 {
				t.Errorf("lazy-pages daemon(s) %v still run", left)
			}
			if left := findProc("lazy-guard", "/"+name); len(left) > 0 {
				t.Errorf("lazy guard(s) %v still run", left)
			}
			if !tc.killReceiver {
				rcv.kill()
			}
			fltRequireDstClean(t, ctx, dst, before, []string{target}, name, ".lazy-"+name)
			// killed by the guard (SIGKILL: 137), not crashed on zeroed memory (a Go runtime
			// reading zeros dies with a fatal error, exit status 2, or a signal other than KILL)
			// killed by the guard (SIGKILL: 137), not crashed on zeroed memory (a Go runtime
			// reading zeros dies with a fatal error, exit status 2, or a signal other than KILL):
			// the shim's answer to Wait, asked while the task ran
			if waited != nil {
				select {
				case st := <-waited:
					if code, _, err := st.Result(); err != nil || code != 128+uint32(syscall.SIGKILL) {
						t.Errorf("the destination task's exit status %d (%v), want 137 (killed by the guard)", code, err)
					}
				case <-time.After(30 * time.Second):
					t.Errorf("the destination task's Wait did not return 30s after the guard was gone")
				}
			}
			// and containerd's /tasks/exit events, which may trail the container's removal
			got := exits()
			for end := time.Now().Add(10 * time.Second); len(got) == 0 && time.Now().Before(end); got = exits() {
				time.Sleep(100 * time.Millisecond)
			}
			switch {
			case len(got) == 0:
				logNow, _ := os.ReadFile(dst.Log)
				t.Logf("no /tasks/exit event for the destination task arrived (its Wait answered); the destination's containerd log about %s:\n%s",
					target, linesAbout(logNow[min(len(logBefore), len(logNow)):], target, 30))
			case len(got) != 1 || got[0] != 128+uint32(syscall.SIGKILL):
				t.Errorf("the destination task's exit events %v, want [137] (killed by the guard)", got)
			}
			if b, _ := os.ReadFile(taskLog); strings.Contains(string(b), "fatal error") || strings.Contains(string(b), "panic") || strings.Contains(string(b), "SIGSEGV") {
				t.Errorf("the destination task crashed (it read missing pages?):\n%s", b)
			}
			logAfter, _ := os.ReadFile(dst.Log)
			if news := string(logAfter[min(len(logBefore), len(logAfter)):]); !strings.Contains(news, "memory pages stopped coming before all arrived") {
				t.Errorf("the destination's containerd log (%s) holds no report of the killed lazy task", dst.Log)
			}
			// the source's pause lease (5s) resumes it
			requireSourceRunning(t, ctx, src, id, "its pause lease should have resumed it")
			w.requireServing(t, ctx)
			// the mover's own work directory (the non-memory images) stays: nothing outlives
			// the mover on the source to remove it
			t.Logf("left in the killed mover's work directory: %v", fltList(t, work))
		})
	}
}

// waitTaskExit asks n's containerd for the exit of task id through the task's Wait (an answer
// from its shim, not the event stream) and returns the channel that gets it.
func waitTaskExit(ctx context.Context, n *node.Node, id string) (<-chan containerd.ExitStatus, error) {
	cl, err := n.Client()
	if err != nil {
		return nil, err
	}
	ctx = namespaces.WithNamespace(ctx, node.Namespace)
	ctr, err := cl.LoadContainer(ctx, id)
	if err != nil {
		cl.Close()
		return nil, err
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		cl.Close()
		return nil, err
	}
	ch, err := task.Wait(ctx)
	if err != nil {
		cl.Close()
		return nil, err
	}
	out := make(chan containerd.ExitStatus, 1)
	go func() {
		defer cl.Close()
		out <- <-ch
	}()
	return out, nil
}

// linesAbout is the last n lines of log that mention s, joined.
func linesAbout(log []byte, s string, n int) string {
	var out []string
	for _, l := range strings.Split(string(log), "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out[max(0, len(out)-n):], "\n")
}

// TestLazyModeMoverKilledBeforeRelay kills `berthctl migrate --lazy` after the shim's
// checkpoint returned (CRIU's lazy page server listens, the source frozen under it) but before
// the mover's relay connected to it: during the checkpoint's send to the receiver, stalled by a
// proxy. CRIU would wait for a client for good; the source's pause lease (3 s) ends, hangs up on
// CRIU's lazy page server, and once the failed dump let go the source is resumed: it runs and
// serves, and the destination holds nothing of the move.
func TestLazyModeMoverKilledBeforeRelay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m := startLazyStall(t, ctx, "lazykill-before-relay", false, func(m *lazyStall) {
		_ = m.cmd.Process.Signal(syscall.SIGKILL)
		t.Logf("SIGKILLed berthctl migrate %d during the checkpoint's send", m.cmd.Process.Pid)
	})
	m.wait(t)
	m.requireRecovered(t, ctx, "its pause lease should have abandoned the lazy dump (the mover died before its relay connected) and resumed it")
}

// lazyStall is a `berthctl migrate --lazy` (pause lease 3 s, its own --work-dir) of a 64 MiB
// workload from node 0 to node 1, whose checkpoint's send to the destination's receiver stalls
// after 64 KiB (stallProxy): the source's CRIU then serves the frozen task's pages on 127.0.0.1,
// and the mover's relay has not connected to it yet.
type lazyStall struct {
	src, dst                  *node.Node
	id, target, name, workDir string
	w                         *fltWorkload
	before                    fltState
	rcv                       *fltReceive
	cmd                       *exec.Cmd
	out                       strings.Builder
	listeners                 map[string]bool // root's listeners on 127.0.0.1 before the move
}

// startLazyStall starts a lazyStall of a workload named id; at runs once, in its own goroutine,
// when the send stalls, and must end the mover (SIGKILL), or it waits for good. With gate, the
// send only waits for at to return, then goes on (proxyAfter).
func startLazyStall(t *testing.T, ctx context.Context, id string, gate bool, at func(*lazyStall)) *lazyStall {
	t.Helper()
	c := needCluster(t)
	lazyPipes(t)
	m := &lazyStall{src: c.Nodes[0], dst: c.Nodes[1], id: id, target: id + "-moved", name: id + "-ck", workDir: t.TempDir()}
	m.w = copyFaultWorkload(t, ctx, m.src, id, 64)
	stampDirExists(t, m.dst)
	m.before = fltDstState(t, ctx, m.dst)
	m.rcv = fltStartReceive(t, ctx, c, m.dst.CheckpointRoot)
	m.cmd = exec.CommandContext(ctx, c.Berthctl(), "migrate", "--lazy", "--pause-lease", "3s",
		"--from", m.src.Socket, "--to", m.dst.Socket, "-n", node.Namespace,
		"--id", m.target, "--work-dir", m.workDir, "--name", m.name)
	m.cmd.Stdout, m.cmd.Stderr = &m.out, &m.out
	ready := make(chan struct{})
	addr := proxyAfter(t, m.rcv.addr, 64<<10, func() { <-ready; at(m) }, !gate)
	m.listeners = rootLoopbackListeners()
	m.cmd.Args = append(m.cmd.Args, "--receiver", addr, id)
	fltNoErr(t, m.cmd.Start())
	close(ready)
	return m
}

// wait waits for the mover, which must not have succeeded.
func (m *lazyStall) wait(t *testing.T) {
	t.Helper()
	if err := m.cmd.Wait(); err == nil {
		t.Fatalf("berthctl migrate ended successfully although it was killed:\n%s", m.out.String())
	}
}

// requireRecovered requires what a failed lazy move promises: the source runs again (why says
// why it should) and serves with its weights intact, the lazy page server's TLS identity is gone
// from the work directory (the shim removed it when the dump ended), and the destination holds
// nothing of the move.
func (m *lazyStall) requireRecovered(t *testing.T, ctx context.Context, why string) {
	t.Helper()
	requireSourceRunning(t, ctx, m.src, m.id, why)
	m.w.requireServing(t, ctx)
	requireNoLazyTLS(t, m.workDir)
	m.rcv.kill()
	fltRequireDstClean(t, ctx, m.dst, m.before, []string{m.target}, m.name, ".lazy-"+m.name)
}

// requireSourceRunning waits up to 60 s after a mover died for n's task id to run again, and
// fails the test saying why it should have (why) if it does not.
func requireSourceRunning(t *testing.T, ctx context.Context, n *node.Node, id, why string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := srcStatus(ctx, n, id)
		if err == nil && st == containerd.Running {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the source %s is %q (%v) 60s after the mover died; %s", id, st, err, why)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// srcStatus is the status of n's task id.
func srcStatus(ctx context.Context, n *node.Node, id string) (containerd.ProcessStatus, error) {
	_, st, err := n.TaskPID(ctx, id)
	return st, err
}

// watchExits records the exit statuses of the init process of n's container id (containerd's
// /tasks/exit events) until the test ends; the returned function lists them so far.
func watchExits(t *testing.T, ctx context.Context, n *node.Node, id string) func() []uint32 {
	t.Helper()
	cl, err := n.Client()
	fltNoErr(t, err)
	ctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	var exits []uint32
	ch, errs := cl.Subscribe(ctx, fmt.Sprintf(`namespace==%q,topic=="/tasks/exit"`, node.Namespace))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case env := <-ch:
				if env == nil || env.Event == nil {
					continue
				}
				var e apievents.TaskExit
				if proto.Unmarshal(env.Event.GetValue(), &e) == nil && e.ContainerID == id && e.ID == id {
					mu.Lock()
					exits = append(exits, e.ExitStatus)
					mu.Unlock()
				}
			case <-errs:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cl.Close() })
	return func() []uint32 {
		mu.Lock()
		defer mu.Unlock()
		return append([]uint32(nil), exits...)
	}
}
