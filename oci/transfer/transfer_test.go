package transfer

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// makeCheckpoint writes a checkpoint of about size bytes (a few CRIU-like files) under dir and
// its berth.json.
func makeCheckpoint(t testing.TB, dir string, size int) {
	t.Helper()
	var key [32]byte
	key[0] = byte(size)
	rng := rand.NewChaCha8(key)
	files := map[string]int{
		"checkpoint/pages-1.img":    size * 3 / 4,
		"checkpoint/pages-2.img":    size - size*3/4 - 4096,
		"checkpoint/core-1.img":     4096,
		"checkpoint/inventory.img":  0,
		"spec.dump":                 0,
		"checkpoint/sub/mm-1.img":   0,
		"checkpoint/sub/fdinfo.img": 0,
	}
	for p, n := range files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o700); err != nil {
			t.Fatal(err)
		}
		data := make([]byte, max(n, 0))
		_, _ = rng.Read(data)
		if err := os.WriteFile(full, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1"}}); err != nil {
		t.Fatal(err)
	}
}

type outcome struct {
	path string
	err  error
}

// startReceiver serves r on a loopback listener and returns its address and a channel with the
// outcome of every connection.
func startReceiver(t testing.TB, r *Receiver) (string, <-chan outcome) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan outcome, 16)
	r.OnDone = func(_ net.Addr, path string, err error) { out <- outcome{path, err} }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln.Addr().String(), out
}

func dial(t testing.TB, addr string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func wait(t testing.TB, out <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-out:
		return o
	case <-time.After(20 * time.Second):
		t.Fatal("receiver did not finish")
		return outcome{}
	}
}

// assertRootClean fails if root holds anything but the names in keep (no staging directory,
// no partial checkpoint).
func assertRootClean(t testing.TB, root string, keep ...string) {
	t.Helper()
	entries, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() == checkpoint.StampDir { // stamps of received checkpoints: checked below
			stamps, err := os.ReadDir(filepath.Join(root, checkpoint.StampDir))
			if err != nil {
				t.Fatal(err)
			}
			for _, st := range stamps {
				if !contains(keep, strings.TrimSuffix(st.Name(), ".json")) {
					t.Errorf("stamp left for a checkpoint that is not there: %s", st.Name())
				}
			}
			continue
		}
		if !contains(keep, e.Name()) {
			t.Errorf("left under root: %s", e.Name())
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func sameTree(t testing.TB, a, b string) {
	t.Helper()
	fa, _, err := checkpoint.DigestDir(a)
	if err != nil {
		t.Fatal(err)
	}
	fb, _, err := checkpoint.DigestDir(b)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(fa) != fmt.Sprint(fb) {
		t.Errorf("trees differ:\n%v\n%v", fa, fb)
	}
	ma, err := os.ReadFile(filepath.Join(a, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	mb, err := os.ReadFile(filepath.Join(b, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ma, mb) {
		t.Error("berth.json differs")
	}
}

func TestRoundTripTCP(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 6<<20)
	root := filepath.Join(t.TempDir(), "recv", "root") // created by the receiver
	addr, out := startReceiver(t, &Receiver{Root: root})

	var calls [][2]int64
	res, err := Send(context.Background(), dial(t, addr), src, "ckpt-1", func(sent, total int64) {
		calls = append(calls, [2]int64{sent, total})
	})
	if err != nil {
		t.Fatal(err)
	}
	o := wait(t, out)
	if o.err != nil {
		t.Fatal(o.err)
	}
	want := filepath.Join(root, "ckpt-1")
	if res.Path != want || o.path != want {
		t.Errorf("paths: sender %q, receiver %q, want %q", res.Path, o.path, want)
	}
	a, _ := archive.New(src)
	if res.Bytes != a.Size() || res.Elapsed <= 0 {
		t.Errorf("result %+v, want %d bytes", res, a.Size())
	}
	sameTree(t, src, want)
	m, err := checkpoint.ReadManifest(want)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.Verify(want, m); err != nil {
		t.Error(err)
	}
	for _, p := range []string{root, want} {
		if info, err := os.Stat(p); err != nil || info.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %v, %v; want 0700", p, info.Mode().Perm(), err)
		}
	}
	assertRootClean(t, root, "ckpt-1")

	// Progress: starts at 0, never goes back, ends at total.
	if len(calls) < 2 || calls[0][0] != 0 || calls[len(calls)-1][0] != res.Bytes {
		t.Fatalf("progress calls %v", calls)
	}
	for i, c := range calls {
		if c[1] != res.Bytes || (i > 0 && c[0] < calls[i-1][0]) {
			t.Errorf("progress call %d: %v", i, c)
		}
	}
}

func TestRoundTripPipe(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 2<<20)
	root := t.TempDir()
	s, c := net.Pipe()
	defer s.Close()
	defer c.Close()
	r := &Receiver{Root: root, NoSync: true}
	done := make(chan outcome, 1)
	go func() {
		p, err := r.Handle(context.Background(), s)
		done <- outcome{p, err}
	}()
	res, err := Send(context.Background(), c, src, "piped", nil)
	if err != nil {
		t.Fatal(err)
	}
	o := <-done
	if o.err != nil || o.path != res.Path {
		t.Fatalf("receiver: %+v, sender %+v", o, res)
	}
	sameTree(t, src, res.Path)
}

// cutConn closes the connection after limit bytes have been written.
type cutConn struct {
	net.Conn
	mu    sync.Mutex
	limit int64
}

func (c *cutConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if int64(len(p)) < c.limit {
		n, err := c.Conn.Write(p)
		c.limit -= int64(n)
		return n, err
	}
	n, _ := c.Conn.Write(p[:c.limit])
	c.limit = 0
	c.Conn.Close()
	return n, net.ErrClosed
}

func TestConnectionCut(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 4<<20)
	a, err := archive.New(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, cut := range []int64{10, 600, 5000, a.Size() / 2, a.Size() - 700} {
		t.Run(fmt.Sprint(cut), func(t *testing.T) {
			root := t.TempDir()
			addr, out := startReceiver(t, &Receiver{Root: root})
			conn := &cutConn{Conn: dial(t, addr), limit: cut}
			if _, err := Send(context.Background(), conn, src, "cut", nil); err == nil {
				t.Fatal("Send succeeded over a cut connection")
			}
			o := wait(t, out)
			if o.err == nil || o.path != "" {
				t.Fatalf("receiver: %+v, want an error", o)
			}
			t.Log(o.err)
			assertRootClean(t, root)
		})
	}
}

func TestTamperedFileRejected(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 3<<20)
	victim := filepath.Join(src, "checkpoint", "core-1.img")
	data, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	data[100] ^= 1
	if err := os.WriteFile(victim, data, 0o600); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	addr, out := startReceiver(t, &Receiver{Root: root})
	conn := dial(t, addr)
	_, err = Send(context.Background(), conn, src, "tampered", nil)
	conn.Close()
	if !errors.Is(err, ErrRejected) {
		t.Fatalf("got %v, want ErrRejected", err)
	}
	for _, s := range []string{"checkpoint/core-1.img", "digest mismatch", "manifest sha256:", "file sha256:"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not contain %q", err, s)
		}
	}
	o := wait(t, out)
	if !errors.Is(o.err, checkpoint.ErrDigestMismatch) {
		t.Errorf("receiver: %v, want checkpoint.ErrDigestMismatch", o.err)
	}
	assertRootClean(t, root)
}

func TestInvalidNames(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	for _, name := range []string{"", ".", "..", "../x", "a/b", "a/../b", ".hidden", ".incoming-x", "a..b", "sp ace", "nul\x00", strings.Repeat("a", MaxNameLen+1)} {
		t.Run(fmt.Sprintf("%q", name), func(t *testing.T) {
			if err := ValidName(name); !errors.Is(err, ErrInvalidName) {
				t.Errorf("ValidName: %v", err)
			}
			// Send refuses before writing anything.
			s, c := net.Pipe()
			defer s.Close()
			defer c.Close()
			if _, err := Send(context.Background(), c, src, name, nil); !errors.Is(err, ErrInvalidName) {
				t.Errorf("Send: got %v, want ErrInvalidName", err)
			}
			// A receiver refuses such a header from a non-berth sender.
			root := t.TempDir()
			r := &Receiver{Root: root}
			v, herr := rawExchange(t, r, header{Magic: Magic, Name: name, TotalBytes: 1024, Manifest: []byte(`{"version":1}`)})
			if v.OK || !errors.Is(herr, ErrInvalidName) || !strings.Contains(v.Error, "invalid checkpoint name") {
				t.Errorf("receiver: verdict %+v, error %v", v, herr)
			}
			assertRootClean(t, root)
		})
	}
	for _, name := range []string{"a", "ckpt-2025.01.02_x", "A.b-c_d", strings.Repeat("z", MaxNameLen)} {
		if err := ValidName(name); err != nil {
			t.Errorf("ValidName(%q): %v", name, err)
		}
	}
}

// rawExchange sends hdr (and nothing else) to r.Handle over a pipe and returns the verdict and
// Handle's error.
func rawExchange(t *testing.T, r *Receiver, hdr header) (verdict, error) {
	t.Helper()
	s, c := net.Pipe()
	defer c.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := r.Handle(context.Background(), s)
		s.Close()
		errc <- err
	}()
	if _, err := Handshake(c); err != nil {
		t.Fatal(err)
	}
	line, _ := json.Marshal(hdr)
	if _, err := c.Write(append(line, '\n')); err != nil {
		t.Fatal(err)
	}
	v, err := readVerdict(c)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	return v, <-errc
}

func TestExistingNameRejected(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 16<<20) // larger than socket buffers: the refusal comes mid-stream
	root := t.TempDir()
	existing := filepath.Join(root, "taken")
	if err := os.Mkdir(existing, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(existing, "keep"), []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr, out := startReceiver(t, &Receiver{Root: root})
	start := time.Now()
	conn := dial(t, addr)
	_, err := Send(context.Background(), conn, src, "taken", nil)
	conn.Close()
	if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("got %v, want ErrRejected (already exists)", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Errorf("refusal took %v", time.Since(start))
	}
	if o := wait(t, out); !errors.Is(o.err, ErrExists) {
		t.Errorf("receiver: %v, want ErrExists", o.err)
	}
	if data, err := os.ReadFile(filepath.Join(existing, "keep")); err != nil || string(data) != "mine" {
		t.Errorf("existing checkpoint touched: %q, %v", data, err)
	}
	assertRootClean(t, root, "taken")

	// An empty directory of that name counts as existing too.
	if err := os.Mkdir(filepath.Join(root, "empty"), 0o700); err != nil {
		t.Fatal(err)
	}
	conn = dial(t, addr)
	if _, err := Send(context.Background(), conn, src, "empty", nil); !errors.Is(err, ErrRejected) {
		t.Errorf("empty existing dir: got %v", err)
	}
	conn.Close()
	wait(t, out)
}

// TestHandshake: the sender waits for the receiver's greeting before it sends anything, and
// refuses a peer that sends another version's greeting, something else, or nothing.
func TestHandshake(t *testing.T) {
	if !strings.HasPrefix(Greeting, Magic+" ") {
		t.Fatalf("Greeting %q does not carry the protocol version %q", Greeting, Magic)
	}
	old := HandshakeTimeout
	HandshakeTimeout = 200 * time.Millisecond
	defer func() { HandshakeTimeout = old }()
	cases := []struct {
		name, peer string // what the peer sends; "" nothing
		inMsg      string // "" when the handshake must succeed
	}{
		{"receiver", Greeting, ""},
		{"version 1 receiver", "berth-transfer/1 ready\n", "another protocol version"},
		{"another service", "SSH-2.0-OpenSSH_9.6 Debian\r\n", "is not a berth receiver"},
		{"silent peer", "", "no berth receiver greeting"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, c := net.Pipe()
			defer s.Close()
			defer c.Close()
			if tc.peer != "" {
				go func() { _, _ = s.Write([]byte(tc.peer)) }()
			}
			g, err := Handshake(c)
			if tc.inMsg == "" {
				if err != nil {
					t.Fatal(err)
				}
				if again, err := Handshake(g); err != nil || again != g {
					t.Fatalf("Handshake on a greeted connection: %v, %v", again, err)
				}
				return
			}
			if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.inMsg) {
				t.Fatalf("Handshake = %v, want ErrProtocol containing %q", err, tc.inMsg)
			}
		})
	}
	t.Run("receiver greets first", func(t *testing.T) {
		root := t.TempDir()
		s, c := net.Pipe()
		done := make(chan struct{})
		go func() { _, _ = (&Receiver{Root: root}).Handle(context.Background(), s); s.Close(); close(done) }()
		buf := make([]byte, len(Greeting))
		_, err := io.ReadFull(c, buf)
		c.Close() // the receiver, waiting for a header, fails
		<-done
		if err != nil || string(buf) != Greeting {
			t.Fatalf("receiver's first bytes %q, %v; want %q", buf, err, Greeting)
		}
		assertRootClean(t, root)
	})
}

func TestHeaderErrors(t *testing.T) {
	manifest := []byte(`{"version":1,"files":[],"imageSize":0}`)
	cases := []struct {
		name    string
		hdr     header
		lim     archive.Limits
		wantErr error
	}{
		{"magic", header{Magic: "berth-transfer/9", Name: "x", TotalBytes: 2048, Manifest: manifest}, archive.Limits{}, ErrProtocol},
		{"version 1 magic", header{Magic: "berth-transfer/1", Name: "x", TotalBytes: 2048, Manifest: manifest}, archive.Limits{}, ErrProtocol},
		{"manifest version", header{Magic: Magic, Name: "x", TotalBytes: 2048, Manifest: []byte(`{"version":2}`)}, archive.Limits{}, checkpoint.ErrUnsupportedVersion},
		{"manifest garbage", header{Magic: Magic, Name: "x", TotalBytes: 2048, Manifest: []byte(`nope`)}, archive.Limits{}, checkpoint.ErrInvalidManifest},
		{"total below content", header{Magic: Magic, Name: "x", TotalBytes: 5, Manifest: manifest}, archive.Limits{}, ErrProtocol},
		{"over limit", header{Magic: Magic, Name: "x", TotalBytes: 4096, Manifest: manifest}, archive.Limits{MaxTotalBytes: 10}, archive.ErrTotalTooLarge},
		{"size near int64 max", header{Magic: Magic, Name: "x", TotalBytes: 4096, Manifest: []byte(`{"version":1,"imageSize":9223372036854775807,"files":[{"path":"a","size":9223372036854775807,"digest":"sha256:` + strings.Repeat("0", 64) + `"}]}`)}, archive.Limits{}, archive.ErrTotalTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			v, err := rawExchange(t, &Receiver{Root: root, Limits: tc.lim}, tc.hdr)
			if v.OK || !errors.Is(err, tc.wantErr) {
				t.Fatalf("verdict %+v, error %v; want %v", v, err, tc.wantErr)
			}
			assertRootClean(t, root)
		})
	}
	t.Run("not json", func(t *testing.T) {
		root := t.TempDir()
		s, c := net.Pipe()
		defer c.Close()
		errc := make(chan error, 1)
		go func() { _, err := (&Receiver{Root: root}).Handle(context.Background(), s); s.Close(); errc <- err }()
		if _, err := Handshake(c); err != nil {
			t.Fatal(err)
		}
		go func() { _, _ = c.Write([]byte("GET / HTTP/1.1\r\n\r\n")) }()
		v, err := readVerdict(c)
		if err != nil || v.OK {
			t.Fatalf("verdict %+v, %v", v, err)
		}
		c.Close()
		if err := <-errc; !errors.Is(err, ErrProtocol) {
			t.Errorf("got %v, want ErrProtocol", err)
		}
	})
}

func TestManifestMismatchRejected(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	raw, err := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	other := bytes.Replace(raw, []byte(`"id": "c1"`), []byte(`"id": "c2"`), 1)
	if bytes.Equal(raw, other) {
		t.Fatal("test setup: manifest not modified")
	}
	a, err := archive.New(src)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	s, c := net.Pipe()
	defer c.Close()
	errc := make(chan error, 1)
	go func() { _, err := (&Receiver{Root: root}).Handle(context.Background(), s); s.Close(); errc <- err }()
	if _, err := Handshake(c); err != nil {
		t.Fatal(err)
	}
	go func() {
		line, _ := json.Marshal(header{Magic: Magic, Name: "swap", TotalBytes: a.Size(), Manifest: other})
		w := bufio.NewWriter(c)
		_, _ = w.Write(append(line, '\n'))
		_, _ = a.WriteTo(w)
		_ = w.Flush()
	}()
	v, err := readVerdict(c)
	if err != nil || v.OK || !strings.Contains(v.Error, "differs") {
		t.Fatalf("verdict %+v, %v", v, err)
	}
	if err := <-errc; !errors.Is(err, ErrProtocol) {
		t.Errorf("got %v, want ErrProtocol", err)
	}
	assertRootClean(t, root)
}

func TestSendHonoursContext(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 16<<20)
	// A peer that accepts but never reads: Send blocks writing until ctx ends.
	s, c := net.Pipe()
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := Send(ctx, c, src, "stuck", nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Send took %v to notice the deadline", d)
	}
}

func TestReceiverIdleTimeout(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 1<<20)
	a, err := archive.New(src)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	root := t.TempDir()
	addr, out := startReceiver(t, &Receiver{Root: root, IdleTimeout: 200 * time.Millisecond})
	conn := dial(t, addr)
	if _, err := Handshake(conn); err != nil {
		t.Fatal(err)
	}
	line, _ := json.Marshal(header{Magic: Magic, Name: "stall", TotalBytes: a.Size(), Manifest: raw})
	var buf bytes.Buffer
	if _, err := a.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	// The header and half the stream, then silence.
	if _, err := conn.Write(append(line, '\n')); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(buf.Bytes()[:buf.Len()/2]); err != nil {
		t.Fatal(err)
	}
	o := wait(t, out)
	var ne net.Error
	if !errors.As(o.err, &ne) || !ne.Timeout() {
		t.Errorf("got %v, want a timeout", o.err)
	}
	assertRootClean(t, root)
}

func TestCleanStaging(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{StagingPrefix + "a-0123", "keep"} {
		if err := os.MkdirAll(filepath.Join(root, d, "checkpoint"), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	r := &Receiver{Root: root}
	if err := r.CleanStaging(); err != nil {
		t.Fatal(err)
	}
	assertRootClean(t, root, "keep")
	if err := (&Receiver{Root: filepath.Join(root, "absent")}).CleanStaging(); err != nil {
		t.Errorf("missing root: %v", err)
	}
}

// BenchmarkSend moves a 256 MiB checkpoint over loopback TCP: stream, extraction, verification
// and (in the fsync case) syncing to disk, end to end. MB/s is the checkpoint size over the time
// Send takes, verdict included.
func BenchmarkSend(b *testing.B) {
	const size = 256 << 20
	src := b.TempDir()
	makeCheckpoint(b, src, size)
	for _, sync := range []bool{true, false} {
		b.Run(map[bool]string{true: "fsync", false: "nosync"}[sync], func(b *testing.B) {
			root := b.TempDir()
			addr, out := startReceiver(b, &Receiver{Root: root, NoSync: !sync})
			b.SetBytes(size)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				conn := dial(b, addr)
				res, err := Send(context.Background(), conn, src, fmt.Sprintf("bench-%d", i), nil)
				if err != nil {
					b.Fatal(err)
				}
				conn.Close()
				b.StopTimer()
				if o := wait(b, out); o.err != nil {
					b.Fatal(o.err)
				}
				if err := os.RemoveAll(res.Path); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// TestSignatureFirst (issue 19): a checkpoint that no trusted key signed is refused as soon as
// its berth.json and berth.sig (or the file after berth.json, when there is no berth.sig) have
// arrived, before the rest of the stream is written (once 375 of 400 MiB reached the disk
// first); a signed one is kept.
func TestSignatureFirst(t *testing.T) {
	root := t.TempDir()
	var seen []string
	unsigned := errors.New("checkpoint is not signed")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true,
		VerifySignature: func(_ context.Context, dir string) error {
			seen = nil
			_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
				if err == nil && !d.IsDir() {
					rel, _ := filepath.Rel(dir, p)
					seen = append(seen, rel)
				}
				return nil
			})
			if _, err := os.Stat(filepath.Join(dir, checkpoint.SignatureFile)); err != nil {
				return unsigned
			}
			return nil
		}})
	src := filepath.Join(t.TempDir(), "c")
	makeCheckpoint(t, src, 8<<20)
	_, err := Send(context.Background(), dial(t, addr), src, "unsigned", nil)
	if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), "refused before the rest of the stream was written") {
		t.Fatalf("unsigned: %v", err)
	}
	if o := wait(t, out); !errors.Is(o.err, unsigned) {
		t.Fatalf("receiver: %v", o.err)
	}
	if len(seen) != 2 || seen[0] != checkpoint.ManifestFile {
		t.Errorf("the signature was checked with %v on disk, want berth.json and the one file after it", seen)
	}
	assertRootClean(t, root)

	if err := os.WriteFile(filepath.Join(src, checkpoint.SignatureFile), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Send(context.Background(), dial(t, addr), src, "signed", nil); err != nil {
		t.Fatalf("signed: %v", err)
	}
	if o := wait(t, out); o.err != nil {
		t.Fatal(o.err)
	}
	if strings.Join(seen, " ") != checkpoint.ManifestFile+" "+checkpoint.SignatureFile {
		t.Errorf("the signature was checked with %v on disk, want berth.json and berth.sig only", seen)
	}
}

// TestSignatureLast: a stream of berth's layout whose berth.json comes after the other files
// is refused at its first file, before anything else is written.
func TestSignatureLast(t *testing.T) {
	root := t.TempDir()
	called := false
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true,
		VerifySignature: func(context.Context, string) error { called = true; return nil }})
	src := filepath.Join(t.TempDir(), "c")
	makeCheckpoint(t, src, 4<<20)
	raw, err := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, b []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(b)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == checkpoint.ManifestFile {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		b, err := os.ReadFile(p)
		add(filepath.ToSlash(rel), b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	add(checkpoint.ManifestFile, raw)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	hdr := header{Magic: Magic, Name: "late", TotalBytes: int64(buf.Len()), Manifest: raw}
	_, _ = sendStream(context.Background(), dial(t, addr), hdr, bytesTo(buf.Bytes()), nil)
	o := wait(t, out)
	if !errors.Is(o.err, ErrProtocol) || !strings.Contains(o.err.Error(), "first entry") {
		t.Fatalf("receiver: %v, want ErrProtocol naming the first entry", o.err)
	}
	if called {
		t.Error("VerifySignature ran: the stream was read past its first file")
	}
	assertRootClean(t, root)
}

// bytesTo is an io.WriterTo of b.
type bytesTo []byte

func (b bytesTo) WriteTo(w io.Writer) (int64, error) {
	n, err := w.Write(b)
	return int64(n), err
}

// TestFirstEntrySized: a stream whose first entry is berth.json, but larger than the header's,
// is refused before that entry is written.
func TestFirstEntrySized(t *testing.T) {
	root := t.TempDir()
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true,
		VerifySignature: func(context.Context, string) error { return nil }})
	src := filepath.Join(t.TempDir(), "c")
	makeCheckpoint(t, src, 1<<20)
	raw, err := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	big := append(slices.Clone(raw), bytes.Repeat([]byte(" "), 1<<20)...)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: checkpoint.ManifestFile, Mode: 0o600, Size: int64(len(big)), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(big); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	hdr := header{Magic: Magic, Name: "big", TotalBytes: int64(buf.Len()), Manifest: raw}
	_, _ = sendStream(context.Background(), dial(t, addr), hdr, bytesTo(buf.Bytes()), nil)
	if o := wait(t, out); !errors.Is(o.err, ErrProtocol) || !strings.Contains(o.err.Error(), "the header's") {
		t.Fatalf("receiver: %v, want ErrProtocol: berth.json larger than the header's", o.err)
	}
	assertRootClean(t, root)
}
