package e2e

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestLazyPageServerServesOnlyItsRelay is a hostile local process against lazy mode: while
// `berthctl migrate --lazy` sends the checkpoint (stalled by a proxy), the source's CRIU listens
// on 127.0.0.1 with the frozen task's memory, and its relay has not connected yet. A stranger on
// the node (a hostNetwork pod, a local user) connects first and asks, in CRIU's page-server
// protocol, for a page of the task's memory that is really there. CRIU must serve it nothing
// (berth has it speak TLS with a certificate only the mover's relay can answer): no page-server
// answer, at most a TLS alert. The move then fails (the stranger cost it its one client), and
// the source serves on, the destination holding nothing.
func TestLazyPageServerServesOnlyItsRelay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	type probe struct {
		addr string
		got  []byte
		err  error
	}
	probed := make(chan probe, 1)
	m := startLazyStall(t, ctx, "lazy-stranger", false, func(m *lazyStall) {
		p := probe{}
		defer func() {
			probed <- p
			_ = m.cmd.Process.Signal(syscall.SIGKILL)
		}()
		var err error
		if p.addr, err = m.criuListener(); err != nil {
			p.err = err
			return
		}
		req, err := pageRequest(m.id, int(m.w.pid))
		if err != nil {
			p.err = err
			return
		}
		p.got, p.err = askAsStranger(p.addr, req)
	})
	var p probe
	select {
	case p = <-probed:
	case <-ctx.Done():
		t.Fatalf("the checkpoint's send never reached the proxy's stall:\n%s", m.out.String())
	}
	m.wait(t)
	if p.err != nil {
		t.Fatalf("probing CRIU's lazy page server: %v", p.err)
	}
	if len(p.got) >= 4 && binary.LittleEndian.Uint32(p.got)&0xffff == psIOVAddF {
		t.Fatalf("CRIU's lazy page server at %s served a stranger: %d bytes (a page-server answer and the page) answered its request for a page of the frozen task", p.addr, len(p.got))
	}
	if len(p.got) > 0 && p.got[0] != 0x15 {
		t.Fatalf("CRIU's lazy page server at %s answered a stranger with %d bytes that are not a TLS alert (first %#x)", p.addr, len(p.got), p.got[0])
	}
	t.Logf("the stranger got %d bytes (a TLS alert or nothing) from %s", len(p.got), p.addr)
	m.requireRecovered(t, ctx, "the lazy dump failed on the stranger's connection; the source should have been resumed")
}

// TestLazyPageServerHeldByStranger: a local process that connects to CRIU's lazy page server
// first and then holds the connection without a word (its TLS handshake never begun) cannot
// keep the source frozen. The mover's relay finds CRIU no longer listening, and the move fails
// saying so and that the source resumes; the source's shim, asked to resume it, kills that CRIU
// once its grace (5 s) passed, and the source serves again while the stranger still holds its
// connection. (Before, CRIU waited on the stranger, and the resume with it, for as long as the
// stranger liked.)
func TestLazyPageServerHeldByStranger(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	h := newSilentStranger()
	m := startLazyStall(t, ctx, "lazy-held", true, h.take)
	stranger := h.connected(t, ctx, m)
	defer stranger.Close()
	ended := make(chan error, 1)
	go func() { ended <- m.cmd.Wait() }()
	select {
	case err := <-ended:
		if err == nil {
			t.Fatalf("berthctl migrate succeeded although a stranger held CRIU's one connection:\n%s", m.out.String())
		}
	case <-time.After(90 * time.Second):
		t.Fatalf("berthctl migrate still runs 90 s after a stranger took CRIU's one connection and held it: the source stays frozen for as long as the stranger likes:\n%s", m.out.String())
	}
	for _, want := range []string{"no longer listens", "another local process connected first", "the source resumes"} {
		if !strings.Contains(m.out.String(), want) {
			t.Errorf("migrate's error does not say %q:\n%s", want, m.out.String())
		}
	}
	requireSourceRunning(t, ctx, m.src, m.id, "the shim should have killed the CRIU a stranger held, once the move gave up")
	m.w.requireServing(t, ctx)
	if _, err := stranger.Write([]byte{0}); err != nil {
		t.Logf("the stranger's connection: %v (CRIU, killed, closed it)", err)
	}
	stranger.Close()
	m.requireRecovered(t, ctx, "the shim killed the CRIU a stranger held")
}

// TestLazyPageServerHeldMoverKilled is TestLazyPageServerHeldByStranger with the mover
// killed once the stranger took CRIU's connection: then no Resume comes, and the source's
// pause lease (3 s) ends; the shim abandons the dump at the lease's end, kills the CRIU the
// stranger holds 5 s later, and the lease resumes the source while the stranger still holds its
// connection. (Found by review: before, the source stayed frozen, even its State timing out.)
func TestLazyPageServerHeldMoverKilled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	h := newSilentStranger()
	m := startLazyStall(t, ctx, "lazy-held-killed", false, func(m *lazyStall) {
		defer func() { _ = m.cmd.Process.Signal(syscall.SIGKILL) }()
		h.take(m)
	})
	stranger := h.connected(t, ctx, m)
	defer stranger.Close()
	m.wait(t)
	requireSourceRunning(t, ctx, m.src, m.id, "the lease's end should have abandoned the dump a stranger holds, killing its CRIU")
	m.w.requireServing(t, ctx)
	stranger.Close()
	m.requireRecovered(t, ctx, "the lease's end abandoned the dump")
}

// silentStranger is a local process that takes CRIU's lazy page server's one connection during
// a lazyStall and holds it without a word.
type silentStranger struct {
	held   chan net.Conn
	failed chan error
}

func newSilentStranger() *silentStranger {
	return &silentStranger{held: make(chan net.Conn, 1), failed: make(chan error, 1)}
}

// take is a lazyStall's at: it connects to CRIU's lazy page server, and says nothing.
func (h *silentStranger) take(m *lazyStall) {
	addr, err := m.criuListener()
	if err != nil {
		h.failed <- err
		return
	}
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		h.failed <- err
		return
	}
	h.held <- c
}

// connected returns the stranger's connection once take made it, and fails the test if it could
// not.
func (h *silentStranger) connected(t *testing.T, ctx context.Context, m *lazyStall) net.Conn {
	t.Helper()
	select {
	case c := <-h.held:
		return c
	case err := <-h.failed:
		t.Fatalf("the stranger could not take CRIU's lazy page server: %v", err)
	case <-ctx.Done():
		t.Fatalf("the checkpoint's send never reached the proxy:\n%s", m.out.String())
	}
	return nil
}

// criuListener returns the address of CRIU's lazy page server: the one root listener on
// 127.0.0.1 that was not there before the move.
func (m *lazyStall) criuListener() (string, error) {
	var fresh []string
	for a := range rootLoopbackListeners() {
		if !m.listeners[a] {
			fresh = append(fresh, a)
		}
	}
	if len(fresh) != 1 {
		return "", fmt.Errorf("want one new root listener on 127.0.0.1 (CRIU's lazy page server), have %v", fresh)
	}
	return fresh[0], nil
}

// CRIU's page-server commands (criu/page-xfer.c): the lazy-pages daemon asks for pages with
// PS_IOV_GET, and the answer is PS_IOV_ADD_F (its flags in the upper 16 bits) and the pages.
const (
	psIOVGet  = 7
	psIOVAddF = 6
)

// pageRequest is a PS_IOV_GET, as CRIU's lazy-pages daemon sends it, for one page of the
// memory of task id (its init's pid on the host: the task's status cannot be asked while CRIU
// holds it) that is present (from /proc/PID/pagemap: its largest private writable mapping's
// first present page): struct page_server_iov, u32 cmd, 4 bytes of padding, u64 nr_pages,
// vaddr, and dst_id (for a GET, the task's pid in its pid namespace, as it is).
func pageRequest(id string, pid int) ([]byte, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	var vpid uint64
	for _, l := range strings.Split(string(status), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" {
			vpid, _ = strconv.ParseUint(f[len(f)-1], 10, 64)
		}
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil, err
	}
	var lo, hi uint64
	for _, l := range strings.Split(string(maps), "\n") {
		f := strings.Fields(l)
		if len(f) < 5 || f[1] != "rw-p" || len(f) > 5 {
			continue // private, writable, anonymous
		}
		var a, b uint64
		if _, err := fmt.Sscanf(f[0], "%x-%x", &a, &b); err == nil && b-a > hi-lo {
			lo, hi = a, b
		}
	}
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, err
	}
	defer pm.Close()
	const page = 4096
	var e [8]byte
	for va := lo; va < hi; va += page {
		if _, err := pm.ReadAt(e[:], int64(va/page*8)); err != nil {
			return nil, err
		}
		if binary.LittleEndian.Uint64(e[:])&(1<<63) == 0 {
			continue
		}
		req := make([]byte, 32)
		binary.LittleEndian.PutUint32(req[0:], psIOVGet)
		binary.LittleEndian.PutUint64(req[8:], 1)
		binary.LittleEndian.PutUint64(req[16:], va)
		binary.LittleEndian.PutUint64(req[24:], vpid)
		return req, nil
	}
	return nil, fmt.Errorf("task %s (pid %d): no present page in its largest anonymous mapping %x-%x", id, pid, lo, hi)
}

// askAsStranger connects to addr, sends req and returns what came back within 5 s.
func askAsStranger(addr string, req []byte) ([]byte, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if _, err := c.Write(req); err != nil {
		return nil, nil // refused before the request: nothing served
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var got []byte
	buf := make([]byte, 64<<10)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			return got, nil
		}
	}
}

// rootLoopbackListeners returns the ADDR:PORT of every TCP socket of root's listening on
// 127.0.0.1 (/proc/net/tcp: state 0A, uid 0); none when that file cannot be read.
func rootLoopbackListeners() map[string]bool {
	out := map[string]bool{}
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 8 || fl[3] != "0A" || fl[7] != "0" || !strings.HasPrefix(fl[1], "0100007F:") {
			continue
		}
		port, err := strconv.ParseUint(strings.TrimPrefix(fl[1], "0100007F:"), 16, 16)
		if err == nil {
			out[fmt.Sprintf("127.0.0.1:%d", port)] = true
		}
	}
	return out
}
