package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
)

// wire returns dir's header line (as name) and tar stream, as Send would write them.
func wire(t testing.TB, dir, name string) (line, stream []byte) {
	t.Helper()
	a, err := archive.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(dir, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	line, err = json.Marshal(header{Magic: Magic, Name: name, TotalBytes: a.Size(), Manifest: raw})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := a.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	return append(line, '\n'), buf.Bytes()
}

// trickle writes data to conn one byte every interval until it is all out, the connection
// fails or stop is closed.
func trickle(conn net.Conn, data []byte, interval time.Duration, stop <-chan struct{}) {
	for _, b := range data {
		select {
		case <-stop:
			return
		case <-time.After(interval):
		}
		if _, err := conn.Write([]byte{b}); err != nil {
			return
		}
	}
}

// sendRetryingBusy sends dir as name, trying again after each ErrBusy; any other error fails
// the test. It returns how many times the receiver answered busy.
func sendRetryingBusy(t *testing.T, addr string, cfg *tls.Config, dir, name string) int {
	t.Helper()
	for busy := 0; ; busy++ {
		_, err := sendTo(t, addr, cfg, dir, name)
		if err == nil {
			return busy
		}
		if !errors.Is(err, ErrBusy) {
			t.Fatalf("send (after %d busy answers): %v", busy, err)
		}
		if busy > 1000 {
			t.Fatalf("still busy after %d tries: %v", busy, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBusy: a connection beyond MaxConns is answered busy at once, over plain TCP and TLS,
// instead of waiting in the listener's backlog.
func TestBusy(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	for _, withTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", withTLS), func(t *testing.T) {
			var srv, cli *tls.Config
			if withTLS {
				srv, cli = serverTLS(t, recvFiles), clientTLS(t, sendFiles)
			}
			root := t.TempDir()
			addr, out := serve(t, &Receiver{Root: root, NoSync: true, MaxConns: 1}, srv)

			holder, err := Dial(context.Background(), addr, cli) // takes the only slot, sends nothing
			if err != nil {
				t.Fatal(err)
			}
			_, err = Dial(context.Background(), addr, cli)
			if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), addr) {
				t.Fatalf("second sender: %v; want ErrBusy naming %s", err, addr)
			}
			d := next(t, out)
			if !errors.Is(d.err, ErrBusy) {
				t.Errorf("receiver: %v, want ErrBusy", d.err)
			}
			if withTLS && !strings.Contains(d.peer.String(), "CN=node-b") {
				t.Errorf("busy peer %v: want its identity", d.peer)
			}
			// Send reports busy the same way.
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			if withTLS {
				c := cli.Clone()
				c.ServerName = "localhost"
				conn = tls.Client(conn, c)
			}
			if _, err := Send(context.Background(), conn, src, "x", nil); !errors.Is(err, ErrBusy) {
				t.Errorf("Send to a busy receiver: %v", err)
			}
			conn.Close()
			next(t, out)

			holder.Close()
			if d := next(t, out); d.err == nil {
				t.Error("holder: no error for a connection closed before its header")
			}
			if _, err := sendTo(t, addr, cli, src, "after"); err != nil {
				t.Fatalf("after the slot was freed: %v", err)
			}
			if d := next(t, out); d.err != nil {
				t.Fatal(d.err)
			}
			assertRootClean(t, root, "after")
		})
	}
}

// TestSlowPeers: four peers that trickle one byte every 100 ms hold every slot only until
// their handshake or header deadline; a real sender meanwhile gets busy answers, never hangs,
// and then gets through.
func TestSlowPeers(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 256<<10)
	line, _ := wire(t, src, "slow")
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	for _, withTLS := range []bool{false, true} {
		t.Run(fmt.Sprintf("tls=%v", withTLS), func(t *testing.T) {
			var srv, cli *tls.Config
			if withTLS {
				srv, cli = serverTLS(t, recvFiles), clientTLS(t, sendFiles)
			}
			root := t.TempDir()
			r := &Receiver{Root: root, NoSync: true, MaxConns: 4, IdleTimeout: time.Minute,
				HandshakeTimeout: 300 * time.Millisecond, HeaderTimeout: 600 * time.Millisecond}
			addr, out := serve(t, r, srv)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			t.Cleanup(func() { close(stop); wg.Wait() })
			holders := 0
			for i := range 4 {
				var conn net.Conn
				var err error
				var data []byte
				if withTLS && i%2 == 0 {
					// never completes its TLS handshake: a ClientHello one byte at a time
					conn, err = net.Dial("tcp", addr)
					data = bytes.Repeat([]byte{0x16}, 1<<10)
				} else {
					// greeted (and authenticated), then trickles its header
					conn, err = Dial(context.Background(), addr, cli)
					data = line
				}
				if errors.Is(err, ErrBusy) && !withTLS && i == 3 {
					// four plain connections from loopback are one peer, which may hold 3 of
					// the 4 slots (MaxConnsPerPeer): its fourth is answered busy
					next(t, out)
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				holders++
				wg.Go(func() { defer conn.Close(); trickle(conn, data, 100*time.Millisecond, stop) })
			}

			busy := sendRetryingBusy(t, addr, cli, src, "real")
			t.Logf("the real sender got %d busy answers first", busy)
			var deadlines, stored int
			for deadlines < holders || stored < 1 {
				d := next(t, out)
				switch {
				case d.err == nil:
					stored++
				case errors.Is(d.err, ErrDeadline):
					deadlines++
					if !strings.Contains(d.err.Error(), "HandshakeTimeout") && !strings.Contains(d.err.Error(), "HeaderTimeout") {
						t.Errorf("slow peer: %v; want the limit named", d.err)
					}
				case errors.Is(d.err, ErrBusy):
				default:
					t.Errorf("unexpected outcome: %v", d.err)
				}
			}
			assertRootClean(t, root, "real")
		})
	}
}

// TestFreeSpace: an announced size that does not fit the free space of Root's file system,
// minus the margin and what transfers in progress have yet to write, is refused before anything
// is written.
func TestFreeSpace(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 1<<20)
	_, stream := wire(t, src, "fits")
	size := int64(len(stream))
	const margin = 1 << 20

	// the header of a 512 GiB checkpoint, sent alone: the refusal must come without the stream
	const huge = 512 << 30
	hugeManifest := fmt.Sprintf(`{"version":1,"imageSize":%d,"files":[{"path":"checkpoint/pages-1.img","size":%d,"digest":"sha256:%s"}]}`,
		huge, huge, strings.Repeat("0", 64))
	hugeLine, _ := json.Marshal(header{Magic: Magic, Name: "huge", TotalBytes: huge + 4096, Manifest: []byte(hugeManifest)})

	errStatfs := errors.New("statfs broke")
	cases := []struct {
		name     string
		free     uint64
		freeErr  error
		header   []byte // sent alone when set; otherwise Send sends the checkpoint
		want     error
		wantText []string
	}{
		{name: "fits exactly", free: uint64(size + margin)},
		{name: "one byte short", free: uint64(size + margin - 1), want: ErrNoSpace,
			wantText: []string{fmt.Sprintf("%d bytes announced", size), fmt.Sprintf("%d bytes free", size+margin-1), fmt.Sprintf("margin %d bytes", margin)}},
		{name: "far beyond free space", free: 10 << 30, header: append(hugeLine, '\n'), want: ErrNoSpace,
			wantText: []string{fmt.Sprintf("%d bytes announced", huge+4096), fmt.Sprintf("%d bytes free", 10<<30)}},
		{name: "free space unknown", freeErr: errStatfs, want: errStatfs, wantText: []string{"statfs broke"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			var asked []string
			var mu sync.Mutex
			r := &Receiver{Root: root, NoSync: true, ReserveBytes: margin, FreeBytes: func(p string) (uint64, error) {
				mu.Lock()
				defer mu.Unlock()
				asked = append(asked, p)
				return tc.free, tc.freeErr
			}}
			addr, out := serve(t, r, nil)
			var sendErr error
			if tc.header != nil {
				conn, err := Dial(context.Background(), addr, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				if _, err := conn.Write(tc.header); err != nil {
					t.Fatal(err)
				}
				v, err := readVerdict(conn)
				if err != nil {
					t.Fatalf("no verdict without the stream: %v", err)
				}
				if v.OK {
					t.Fatal("accepted")
				}
				sendErr = fmt.Errorf("%w: %s", ErrRejected, v.Error)
				conn.Close() // the receiver need not linger for a stream
			} else {
				_, sendErr = sendTo(t, addr, nil, src, "fits")
			}
			d := next(t, out)
			mu.Lock()
			if len(asked) != 1 || asked[0] != root {
				t.Errorf("FreeBytes asked about %q, want [%s]", asked, root)
			}
			mu.Unlock()
			if tc.want == nil {
				if sendErr != nil || d.err != nil {
					t.Fatalf("sender %v, receiver %v", sendErr, d.err)
				}
				assertRootClean(t, root, "fits")
				return
			}
			if !errors.Is(sendErr, ErrRejected) || !errors.Is(d.err, tc.want) {
				t.Fatalf("sender %v, receiver %v; want ErrRejected and %v", sendErr, d.err, tc.want)
			}
			for _, w := range tc.wantText {
				if !strings.Contains(d.err.Error(), w) || !strings.Contains(sendErr.Error(), w) {
					t.Errorf("errors do not say %q:\nreceiver: %v\nsender:   %v", w, d.err, sendErr)
				}
			}
			assertRootClean(t, root)
		})
	}

	// What a transfer in progress has yet to write counts against the next one.
	t.Run("transfer in progress", func(t *testing.T) {
		root := t.TempDir()
		free := uint64(size + size/2 + margin) // room for one and a half checkpoints
		r := &Receiver{Root: root, NoSync: true, ReserveBytes: margin, FreeBytes: func(string) (uint64, error) { return free, nil }}
		addr, out := serve(t, r, nil)
		first, err := Dial(context.Background(), addr, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer first.Close()
		firstLine, firstStream := wire(t, src, "first")
		if _, err := first.Write(append(firstLine, firstStream[:1024]...)); err != nil {
			t.Fatal(err)
		}
		waitStaging(t, root)
		_, err = sendTo(t, addr, nil, src, "second")
		if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), "still to come for 1 transfers in progress") {
			t.Fatalf("second sender: %v; want ErrRejected for lack of space", err)
		}
		if d := next(t, out); !errors.Is(d.err, ErrNoSpace) {
			t.Errorf("receiver: %v", d.err)
		}
		if _, err := first.Write(firstStream[1024:]); err != nil {
			t.Fatal(err)
		}
		if v, err := readVerdict(first); err != nil || !v.OK {
			t.Fatalf("first: %+v, %v", v, err)
		}
		next(t, out)
		if _, err := sendTo(t, addr, nil, src, "second"); err != nil { // the first is done: room again
			t.Fatal(err)
		}
		next(t, out)
		assertRootClean(t, root, "first", "second")
	})
}

// waitStaging waits until a staging directory exists under root: a transfer is past its
// header.
func waitStaging(t *testing.T, root string) {
	t.Helper()
	for start := time.Now(); time.Since(start) < 20*time.Second; time.Sleep(10 * time.Millisecond) {
		entries, _ := os.ReadDir(root)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), StagingPrefix) {
				return
			}
		}
	}
	t.Fatal("no transfer started")
}

// TestDeadlines: a peer that keeps the connection alive with a byte every 50 ms (never idle)
// still loses it at HeaderTimeout or TransferTimeout, is told so, and leaves nothing behind.
func TestDeadlines(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 256<<10)
	line, stream := wire(t, src, "slow")
	cases := []struct {
		name     string
		header   time.Duration // Receiver.HeaderTimeout
		transfer time.Duration // Receiver.TransferTimeout
		upfront  []byte        // written at once
		trickled []byte        // then one byte every 50 ms
		limit    string
	}{
		{"header", 300 * time.Millisecond, 0, nil, line, "HeaderTimeout 300ms"},
		{"whole transfer", 0, 500 * time.Millisecond, append(line, stream[:4096]...), stream[4096:], "TransferTimeout 500ms"},
		{"transfer shorter than header", 0, 300 * time.Millisecond, nil, line, "TransferTimeout 300ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			r := &Receiver{Root: root, NoSync: true, IdleTimeout: time.Minute, HeaderTimeout: tc.header, TransferTimeout: tc.transfer}
			addr, out := serve(t, r, nil)
			conn, err := Dial(context.Background(), addr, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Write(tc.upfront); err != nil {
				t.Fatal(err)
			}
			stop := make(chan struct{})
			defer close(stop)
			go trickle(conn, tc.trickled, 50*time.Millisecond, stop)
			v, err := readVerdict(conn)
			if err != nil || v.OK || !strings.Contains(v.Error, tc.limit) {
				t.Errorf("verdict %+v, %v; want a refusal naming %q", v, err, tc.limit)
			}
			d := next(t, out)
			var ne net.Error
			if !errors.Is(d.err, ErrDeadline) || !errors.As(d.err, &ne) || !ne.Timeout() || !strings.Contains(d.err.Error(), tc.limit) {
				t.Errorf("receiver: %v; want ErrDeadline naming %q", d.err, tc.limit)
			}
			assertRootClean(t, root)
		})
	}
}

// TestVerifyHook: the receiver calls Verify on the complete, digest-checked staging directory;
// a refusal removes it and reaches the sender.
func TestVerifyHook(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 256<<10)
	errUntrusted := errors.New("signed by nobody we know")
	unsignedPolicy, err := signature.LoadPolicy(signature.TrustConfig{})
	if err != nil {
		t.Fatal(err)
	}
	labPolicy, err := signature.LoadPolicy(signature.TrustConfig{AllowUnsigned: true})
	if err != nil {
		t.Fatal(err)
	}
	policyHook := func(p *signature.Policy) func(context.Context, string) error {
		return func(ctx context.Context, dir string) error { _, err := p.Verify(ctx, dir, ""); return err }
	}
	cases := []struct {
		name   string
		verify func(ctx context.Context, dir string) error
		want   error
	}{
		{"refused", func(context.Context, string) error { return errUntrusted }, errUntrusted},
		{"policy: unsigned", policyHook(unsignedPolicy), signature.ErrUnsigned},
		{"policy: unsigned allowed", policyHook(labPolicy), nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			var seen string
			r := &Receiver{Root: root, NoSync: true, Verify: func(ctx context.Context, dir string) error {
				seen = dir
				if _, ok := ctx.Deadline(); !ok {
					t.Error("Verify's ctx has no deadline")
				}
				if filepath.Dir(dir) != root || !strings.HasPrefix(filepath.Base(dir), StagingPrefix) {
					t.Errorf("Verify called on %s, want a staging directory under %s", dir, root)
				}
				if m, err := checkpoint.ReadManifest(dir); err != nil || checkpoint.Verify(dir, m) != nil {
					t.Errorf("Verify called on an incomplete checkpoint: %v", err)
				}
				return tc.verify(ctx, dir)
			}}
			addr, out := serve(t, r, nil)
			_, err := sendTo(t, addr, nil, src, "hooked")
			d := next(t, out)
			if seen == "" {
				t.Fatal("Verify not called")
			}
			if tc.want == nil {
				if err != nil || d.err != nil {
					t.Fatalf("sender %v, receiver %v", err, d.err)
				}
				assertRootClean(t, root, "hooked")
				return
			}
			if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), tc.want.Error()) {
				t.Errorf("sender: %v; want ErrRejected saying %q", err, tc.want)
			}
			if !errors.Is(d.err, tc.want) {
				t.Errorf("receiver: %v; want %v", d.err, tc.want)
			}
			assertRootClean(t, root)
		})
	}
}

// TestHandshakeAnswers: what a sender makes of each first line a peer may send.
func TestHandshakeAnswers(t *testing.T) {
	cases := []struct {
		name string
		sent string
		want error // nil: greeted
		text string
	}{
		{"ready", Greeting, nil, ""},
		{"busy", busyLine, ErrBusy, "all its transfer slots in use"},
		{"refused", refusal("not you\nreally"), ErrRefused, "not you really"},
		{"another protocol", "SSH-2.0-OpenSSH_9.6\r\n", ErrProtocol, `"SSH-2.0-OpenSSH_9.6\r\n"`},
		{"other version", "berth-transfer/0 ready\n", ErrProtocol, "another protocol version"},
		{"endless line", strings.Repeat("x", maxGreetingBytes+10), ErrProtocol, "longer than"},
		{"closes mid-line", Magic, ErrProtocol, "EOF"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c := net.Pipe()
			defer c.Close()
			go func() { _, _ = s.Write([]byte(tc.sent)); s.Close() }()
			_, err := Handshake(c)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("got %v; want %v saying %q", err, tc.want, tc.text)
			}
		})
	}
}

// TestUnauthenticatedFlood: peers without a certificate of the cluster's CA, however many open
// connections and never finish their TLS handshake, hold none of the transfer slots: an
// authenticated sender gets through at once, without a busy answer; beyond MaxHandshakes
// connections in their handshake, new ones are closed unanswered.
func TestUnauthenticatedFlood(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	root := t.TempDir()
	// one source may hold every handshake place here: the global bound is what is tested
	r := &Receiver{Root: root, NoSync: true, MaxConns: 2, MaxHandshakes: 16, MaxHandshakesPerSource: 16, HandshakeTimeout: 5 * time.Second}
	addr, out := serve(t, r, serverTLS(t, recvFiles))
	var flood []net.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	for range 12 { // more than MaxConns, fewer than MaxHandshakes: silent, no ClientHello
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		flood = append(flood, c)
	}
	time.Sleep(100 * time.Millisecond) // all accepted
	if _, err := sendTo(t, addr, clientTLS(t, sendFiles), src, "real"); err != nil {
		t.Fatalf("an authenticated sender beside %d silent connections: %v", len(flood), err)
	}
	for d := next(t, out); ; d = next(t, out) {
		if d.err == nil {
			break
		}
		if errors.Is(d.err, ErrBusy) {
			t.Fatalf("a connection was answered busy while only unauthenticated peers waited: %v", d.err)
		}
	}
	// beyond MaxHandshakes: closed unanswered, the receiver stays up
	for range 8 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		flood = append(flood, c)
	}
	closedUnanswered := false
	for !closedUnanswered {
		d := next(t, out)
		closedUnanswered = errors.Is(d.err, ErrBusy) && strings.Contains(d.err.Error(), "in their TLS handshake")
	}
	assertRootClean(t, root, "real")
}

// TestHandshakeFloodOneSource: one source that opens more connections than MaxHandshakes and
// never starts their TLS handshake holds only MaxHandshakesPerSource of them (the others are
// closed unanswered at once, naming the source); a sender from another address still gets
// through, without a busy answer, while the flood's connections are held open.
func TestHandshakeFloodOneSource(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	root := t.TempDir()
	r := &Receiver{Root: root, NoSync: true, MaxConns: 2, MaxHandshakes: 16, HandshakeTimeout: 10 * time.Second}
	addr, out := serve(t, r, serverTLS(t, recvFiles))
	// the flood comes from 127.0.0.2 (every 127/8 address is the loopback's), the sender from
	// 127.0.0.1
	flooder := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	var flood []net.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	const n = 40 // more than MaxHandshakes
	for range n {
		c, err := flooder.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		flood = append(flood, c)
	}
	closed := 0
	for closed < n-DefaultMaxHandshakesPerSource {
		d := next(t, out)
		if !errors.Is(d.err, ErrBusy) || !strings.Contains(d.err.Error(), "from 127.0.0.2 in their TLS handshake") {
			t.Fatalf("flood connection %d: %v, want closed unanswered for its source", closed, d.err)
		}
		closed++
	}
	if _, err := sendTo(t, addr, clientTLS(t, sendFiles), src, "real"); err != nil {
		t.Fatalf("a sender from another address beside %d handshakes from one: %v", n, err)
	}
	if d := next(t, out); d.err != nil {
		t.Fatalf("sender beside the flood: %v", d.err)
	}
	assertRootClean(t, root, "real")
}

// TestHandshakeFloodManySources: peers on several addresses that together hold every handshake
// place (each within MaxHandshakesPerSource) and never start their TLS handshake cannot keep a
// sender out: its connection takes the place of the oldest one of a source holding the most,
// which is closed (ErrBusy, naming why), and the sender gets through.
func TestHandshakeFloodManySources(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	root := t.TempDir()
	const sources, perSource = 8, 2
	r := &Receiver{Root: root, NoSync: true, MaxConns: 2, MaxHandshakes: sources * perSource, MaxHandshakesPerSource: perSource, HandshakeTimeout: time.Minute}
	addr, out := serve(t, r, serverTLS(t, recvFiles))
	var flood []net.Conn
	t.Cleanup(func() {
		for _, c := range flood {
			c.Close()
		}
	})
	// from 127.0.0.2 to 127.0.0.9, each one connection more than it may hold: its refusal says
	// that the ones before it hold their places
	for i := range sources {
		ip := net.IPv4(127, 0, 0, byte(2+i))
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}}
		for range perSource + 1 {
			c, err := d.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			flood = append(flood, c)
		}
		if d := next(t, out); !errors.Is(d.err, ErrBusy) || !strings.Contains(d.err.Error(), "from "+ip.String()+" in their TLS handshake") {
			t.Fatalf("source %s: %v, want its third connection closed unanswered", ip, d.err)
		}
	}
	if _, err := sendTo(t, addr, clientTLS(t, sendFiles), src, "real"); err != nil {
		t.Fatalf("a sender beside %d sources holding every handshake place: %v", sources, err)
	}
	var displaced, sent int
	for range 2 {
		switch d := next(t, out); {
		case d.err == nil:
			sent++
		case errors.Is(d.err, ErrBusy) && strings.Contains(d.err.Error(), "closed for a newer connection"):
			displaced++
		default:
			t.Fatalf("beside the flood: %v", d.err)
		}
	}
	if displaced != 1 || sent != 1 {
		t.Fatalf("%d flood connections displaced, %d checkpoints received; want 1 and 1", displaced, sent)
	}
	assertRootClean(t, root, "real")
}

// TestOnePeerNeverHoldsEverySlot (issue 19, finding 5): one holder of a cluster certificate that
// opens connections and trickles its header (once one byte every 40 s, which the idle timeout
// allowed for minutes) holds at most MaxConnsPerPeer slots, each only until HeaderLineTimeout
// after its header began: another node's sender gets a slot at once, and the trickling
// connections end naming the limit.
func TestOnePeerNeverHoldsEverySlot(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 256<<10)
	line, _ := wire(t, src, "slow")
	ca := newTestCA(t, "cluster-ca")
	recvFiles, hostile, honest := ca.node(t, "node-a"), ca.node(t, "node-b"), ca.node(t, "node-c")
	root := t.TempDir()
	r := &Receiver{Root: root, NoSync: true, MaxConns: 4, IdleTimeout: time.Minute, HeaderTimeout: time.Minute,
		HeaderLineTimeout: 800 * time.Millisecond}
	addr, out := serve(t, r, serverTLS(t, recvFiles))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	t.Cleanup(func() { close(stop); wg.Wait() })
	held := 0
	for range 4 {
		conn, err := Dial(context.Background(), addr, clientTLS(t, hostile))
		if errors.Is(err, ErrBusy) {
			if d := next(t, out); !errors.Is(d.err, ErrBusy) || !strings.Contains(d.err.Error(), "as many as one peer may") {
				t.Errorf("the hostile peer's extra connection: %v", d.err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		held++
		wg.Go(func() { defer conn.Close(); trickle(conn, line, 200*time.Millisecond, stop) })
	}
	if held != DefaultMaxConnsPerPeer {
		t.Errorf("one peer holds %d slots, want %d of 4", held, DefaultMaxConnsPerPeer)
	}
	start := time.Now()
	if _, err := sendTo(t, addr, clientTLS(t, honest), src, "honest"); err != nil {
		t.Fatalf("another node's sender while one peer trickles: %v", err)
	}
	if d := next(t, out); d.err != nil {
		t.Fatal(d.err)
	}
	t.Logf("the honest sender got through in %v", time.Since(start))
	for range held {
		d := next(t, out)
		if !errors.Is(d.err, ErrDeadline) || !strings.Contains(d.err.Error(), "HeaderLineTimeout") {
			t.Errorf("trickling header: %v, want ErrDeadline naming HeaderLineTimeout", d.err)
		}
	}
	assertRootClean(t, root, "honest")
}

// dialFrom is Dial from local address src (another loopback address: another source).
func dialFrom(t *testing.T, src, addr string, cfg *tls.Config) (net.Conn, error) {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	raw, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	cfg = cfg.Clone()
	cfg.ServerName = "127.0.0.1"
	tc := tls.Client(raw, cfg)
	if err := tc.HandshakeContext(context.Background()); err != nil {
		t.Fatal(err)
	}
	g, err := Handshake(tc)
	if err != nil {
		return nil, err
	}
	return g, nil
}

// TestBodyTrickle: one certificate holder sends whole headers and then trickles the archive
// bodies, from two sources. It holds at most MaxConns-1 slots in all, the honest node gets one
// meanwhile, and each trickle ends at the first MinBodyRate window.
func TestBodyTrickle(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 256<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, hostile, honest := ca.node(t, "node-a"), ca.node(t, "node-b"), ca.node(t, "node-c")
	root := t.TempDir()
	r := &Receiver{Root: root, NoSync: true, MaxConns: 4, IdleTimeout: time.Minute, HeaderTimeout: time.Minute,
		HeaderLineTimeout: 800 * time.Millisecond, bodyRateWindow: 1500 * time.Millisecond}
	addr, out := serve(t, r, serverTLS(t, recvFiles))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	t.Cleanup(func() { close(stop); wg.Wait() })
	held := 0
	for i, from := range []string{"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.2"} {
		line, stream := wire(t, src, fmt.Sprintf("slow%d", i))
		conn, err := dialFrom(t, from, addr, clientTLS(t, hostile))
		if errors.Is(err, ErrBusy) {
			if d := next(t, out); !errors.Is(d.err, ErrBusy) || !strings.Contains(d.err.Error(), "as many as one peer may") {
				t.Errorf("the hostile identity's connection from %s: %v", from, d.err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write(line); err != nil {
			t.Fatal(err)
		}
		held++
		wg.Go(func() { defer conn.Close(); trickle(conn, stream, 100*time.Millisecond, stop) })
	}
	if held != 3 {
		t.Errorf("one identity from two sources holds %d slots, want 3 of 4", held)
	}
	if _, err := sendTo(t, addr, clientTLS(t, honest), src, "honest"); err != nil {
		t.Fatalf("another node's sender while one identity trickles: %v", err)
	}
	if d := next(t, out); d.err != nil {
		t.Fatal(d.err)
	}
	for range held {
		d := next(t, out)
		if !errors.Is(d.err, ErrDeadline) || !strings.Contains(d.err.Error(), "MinBodyRate") {
			t.Errorf("trickling body: %v, want ErrDeadline naming MinBodyRate", d.err)
		}
	}
	assertRootClean(t, root, "honest")
}

// burstReader returns one burst of n bytes at once, then waits each time before a single byte.
type burstReader struct {
	n    int
	wait time.Duration
}

func (b *burstReader) Read(p []byte) (int, error) {
	if b.n > 0 {
		k := min(b.n, len(p))
		b.n -= k
		return k, nil
	}
	time.Sleep(b.wait)
	return 1, nil
}

// TestBodyRateAverage: a sender that sends one window's minimum at once and then waits several
// windows is refused at its next read: the rate is averaged from the body's start.
func TestBodyRateAverage(t *testing.T) {
	r := &Receiver{MinBodyRate: 10000, bodyRateWindow: 100 * time.Millisecond} // 1000 bytes a window
	body := r.rateFloor(&burstReader{n: 1000, wait: 350 * time.Millisecond})
	buf := make([]byte, 4096)
	if _, err := body.Read(buf); err != nil {
		t.Fatalf("the burst: %v", err)
	}
	if _, err := body.Read(buf); !errors.Is(err, ErrDeadline) || !strings.Contains(err.Error(), "MinBodyRate") {
		t.Fatalf("after 3 windows with one window's bytes: %v, want ErrDeadline naming MinBodyRate", err)
	}
}
