package transfer

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"testing/iotest"
	"time"

	"github.com/zeebo/blake3"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer/frame"
)

// fakeCRIU writes a "criu" that, as `criu page-server --images-dir D --ps-socket 3 ...`, copies
// the stream into D/pages-1.img and answers "ok" (a stand-in for CRIU's protocol answers).
func fakeCRIU(t *testing.T) string { return fakeCRIUSlow(t, 0) }

// fakeCRIUSlow is fakeCRIU answering only after delay seconds.
func fakeCRIUSlow(t *testing.T, delay float64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "criu")
	script := fmt.Sprintf("#!/bin/sh\n[ \"$1\" = page-server ] || exit 2\ncat <&3 >\"$3/pages-1.img\" && sleep %g && printf ok >&3\n", delay)
	if err := os.WriteFile(p, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	return p
}

// sendPages plays CRIU's page client: it streams data to the relay and reads the answer.
func sendPages(t *testing.T, relay *PageRelay, data []byte) string {
	t.Helper()
	c, err := net.Dial("tcp", relay.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).CloseWrite()
	var answer bytes.Buffer
	_, _ = answer.ReadFrom(c)
	return answer.String()
}

func TestPageStreamAdopted(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	root := filepath.Join(t.TempDir(), "root")
	// the page server answers after the handshake deadline: a stream may outlast it (1 GiB did)
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIUSlow(t, 0.5), HandshakeTimeout: 200 * time.Millisecond})
	relay, err := StartPageRelay(context.Background(), dial(t, addr), "c1")
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("page"), 300000)
	if got := sendPages(t, relay, data); got != "ok" {
		t.Fatalf("the page server's answer did not come back through the relay: %q (receiver: %v)", got, wait(t, out).err)
	}
	ps, err := relay.Wait(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	sum := blake3.Sum256(data) // the library's own sum, not the relay's code path
	if want := "blake3:" + hex.EncodeToString(sum[:]); ps.Digest != want || ps.Size != int64(len(data)) {
		t.Fatalf("relay digested %s (%d bytes), want %s (%d)", ps.Digest, ps.Size, want, len(data))
	}

	dir := filepath.Join(t.TempDir(), "c1")
	makeCheckpoint(t, dir, 64<<10)
	for _, p := range []string{"pages-1.img", "pages-2.img"} { // copy mode: no page images at the source
		if err := os.Remove(filepath.Join(dir, "checkpoint", p)); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1"}, PageStream: &ps}); err != nil {
		t.Fatal(err)
	}
	if _, err := Send(context.Background(), dial(t, addr), dir, "c1", nil); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if o := wait(t, out); o.err != nil {
			t.Fatal(o.err)
		}
	}
	final := filepath.Join(root, "c1")
	if b, err := os.ReadFile(filepath.Join(final, "checkpoint", "pages-1.img")); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("page image not adopted intact: %v", err)
	}
	assertRootClean(t, root, "c1")
	m, err := checkpoint.ReadManifest(final)
	if err != nil {
		t.Fatal(err)
	}
	if stamped, err := checkpoint.VerifyStamped(final, m); err != nil || !stamped {
		t.Fatalf("VerifyStamped = %v, %v; want the receiver's stamp to cover the page images", stamped, err)
	}
	if err := checkpoint.Verify(final, m); !errors.Is(err, checkpoint.ErrPagesUnverified) {
		t.Fatalf("Verify without the stamp = %v, want ErrPagesUnverified", err)
	}
	// sent on, its pages would reach a receiver that cannot verify them: refused before sending
	if _, err := Send(context.Background(), dial(t, addr), final, "c1-again", nil); !errors.Is(err, ErrPageStream) || !strings.Contains(err.Error(), "pages-1.img") {
		t.Fatalf("Send of a copy-mode checkpoint = %v, want ErrPageStream naming pages-1.img", err)
	}
	if err := os.WriteFile(filepath.Join(final, "checkpoint", "pages-1.img"), []byte("tampered"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := checkpoint.VerifyStamped(final, m); !errors.Is(err, checkpoint.ErrPagesUnverified) {
		t.Fatalf("VerifyStamped after a page image changed = %v, want ErrPagesUnverified", err)
	}
}

// TestPageStreamDigestMismatchRefused: the receiver keeps a page stream only if the signed
// manifest records its digest, in the algorithm its sender announced: pages one byte off what was
// signed, and a manifest that records a digest in another algorithm (even a correct one), are
// refused and nothing is kept.
func TestPageStreamDigestMismatchRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	data := []byte("the pages that arrived")
	tampered := bytes.Clone(data)
	tampered[4] ^= 1
	b3 := blake3.Sum256(tampered)
	s256 := sha256.Sum256(data)
	for _, tc := range []struct {
		name, signed, want string
	}{
		{"tampered byte, blake3", "blake3:" + hex.EncodeToString(b3[:]), "the signed manifest records blake3:"},
		{"sha256 signed for a blake3 stream", "sha256:" + hex.EncodeToString(s256[:]), "arrived digested with blake3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t)})
			relay, err := StartPageRelay(context.Background(), dial(t, addr), "c1")
			if err != nil {
				t.Fatal(err)
			}
			sendPages(t, relay, data)
			ps, err := relay.Wait(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			ps.Digest = tc.signed // the source signed something else
			dir := filepath.Join(t.TempDir(), "c1")
			makeCheckpoint(t, dir, 64<<10)
			if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1"}, PageStream: &ps}); err != nil {
				t.Fatal(err)
			}
			// makeCheckpoint's own pages-*.img are listed files here; the stream's would collide,
			// but the digest is checked first
			_, err = Send(context.Background(), dial(t, addr), dir, "c1", nil)
			if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Send = %v, want ErrRejected saying %q", err, tc.want)
			}
			wait(t, out)
			wait(t, out)
			assertRootClean(t, root)
		})
	}
}

// announcePages writes a page stream's header with pageDigest alg ("" for none, as senders
// before it did) on a greeted connection to addr.
func announcePages(t *testing.T, addr, name, alg string) net.Conn {
	t.Helper()
	conn := dial(t, addr)
	if _, err := Handshake(conn); err != nil {
		t.Fatal(err)
	}
	line, err := json.Marshal(header{Magic: Magic, Name: name, Pages: true, PageDigest: alg})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(append(line, '\n')); err != nil {
		t.Fatal(err)
	}
	return conn
}

// TestPageStreamUnknownAlgorithmRefused: a sender announcing a page digest algorithm this
// receiver does not know is refused before any page server starts (the stand-in would write
// pages-1.img), with the algorithm named; nothing is kept.
func TestPageStreamUnknownAlgorithmRefused(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t)})
	conn := announcePages(t, addr, "c1", "md5")
	if _, err := frame.Write(conn, bytes.NewReader([]byte("pages")), sha256.New()); err != nil && !errors.Is(err, net.ErrClosed) {
		t.Logf("writing after the refusal: %v", err)
	}
	o := wait(t, out)
	if !errors.Is(o.err, checkpoint.ErrPageDigestAlgorithm) || !errors.Is(o.err, ErrPageStream) || !strings.Contains(o.err.Error(), `"md5"`) {
		t.Fatalf("receiver: %v, want ErrPageStream and ErrPageDigestAlgorithm naming \"md5\"", o.err)
	}
	// closed with the frame unread, the receiver's end may reset the connection instead
	if b, err := io.ReadAll(conn); len(b) != 0 || (err != nil && !errors.Is(err, syscall.ECONNRESET)) {
		t.Fatalf("the refused sender got %q, %v; want the connection closed without a page server's answer", b, err)
	}
	assertRootClean(t, root)
}

// TestPageStreamSHA256SenderAdopted: a sender that announces no algorithm (berth before
// pageDigest) digested its stream with SHA-256, and the receiver still verifies and keeps it.
func TestPageStreamSHA256SenderAdopted(t *testing.T) {
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t)})
	conn := announcePages(t, addr, "c1", "")
	data := bytes.Repeat([]byte("page"), 100000)
	h := sha256.New()
	if _, err := frame.Write(conn, bytes.NewReader(data), h); err != nil {
		t.Fatal(err)
	}
	_ = conn.(*net.TCPConn).CloseWrite()
	if b, _ := io.ReadAll(conn); string(b) != "ok" {
		t.Fatalf("the page server's answer: %q", b)
	}
	ps := checkpoint.PageStream{Digest: "sha256:" + hex.EncodeToString(h.Sum(nil)), Size: int64(len(data))}
	dir := filepath.Join(t.TempDir(), "c1")
	makeCheckpoint(t, dir, 64<<10)
	for _, p := range []string{"pages-1.img", "pages-2.img"} {
		if err := os.Remove(filepath.Join(dir, "checkpoint", p)); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1"}, PageStream: &ps}); err != nil {
		t.Fatal(err)
	}
	if _, err := Send(context.Background(), dial(t, addr), dir, "c1", nil); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if o := wait(t, out); o.err != nil {
			t.Fatal(o.err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(root, "c1", "checkpoint", "pages-1.img")); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("page image not adopted intact: %v", err)
	}
}

// TestPageStreamCut cuts the relay's connection mid-stream: the relay reports the cut (the move
// fails and the source resumes), and the receiver keeps nothing.
func TestPageStreamCut(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t), IdleTimeout: 300 * time.Millisecond})
	conn := &cutConn{Conn: dial(t, addr), limit: 200 << 10}
	relay, err := StartPageRelay(context.Background(), conn, "c1")
	if err != nil {
		t.Fatal(err)
	}
	go func() { // CRIU's page client: the relay drops it when the link is cut
		if c, err := net.Dial("tcp", relay.Addr()); err == nil {
			_, _ = c.Write(bytes.Repeat([]byte("page"), 1<<20))
			c.Close()
		}
	}()
	if _, err := relay.Wait(context.Background()); !errors.Is(err, ErrPageStream) {
		t.Fatalf("relay.Wait = %v, want ErrPageStream (cut)", err)
	}
	if o := wait(t, out); o.err == nil {
		t.Fatal("receiver reported no error for a page stream nobody adopted")
	}
	assertRootClean(t, root)
}

// TestPageRelayCloseCutsLiveStream: Close during the stream (a move that failed elsewhere) cuts
// it: CRIU's page client sees its connection end, Wait returns an error, and the receiver keeps
// nothing.
func TestPageRelayCloseCutsLiveStream(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t), IdleTimeout: 300 * time.Millisecond})
	relay, err := StartPageRelay(context.Background(), dial(t, addr), "c1")
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", relay.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(bytes.Repeat([]byte("page"), 64<<10)); err != nil {
		t.Fatal(err)
	}
	relay.Close()
	ended := make(chan error, 1)
	go func() { // CRIU's page client, still sending: its connection ends
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		var err error
		for err == nil {
			_, err = c.Write(bytes.Repeat([]byte("page"), 16<<10))
		}
		ended <- err
	}()
	if err := <-ended; errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("CRIU's page client could still send 10s after Close")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := relay.Wait(ctx); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("relay.Wait after Close mid-stream = %v, want the relay's error", err)
	}
	if o := wait(t, out); o.err == nil {
		t.Fatal("receiver reported no error for a page stream that was cut")
	}
	assertRootClean(t, root)
}

// TestPageStreamTLSAnswersMidStream: over mutual TLS the relay gathers the TLS records of each
// frame into larger writes, but flushes every frame: CRIU's page client waits for the page
// server's answers mid-stream (PS_IOV_OPEN2, flushes), so a frame left in the relay's buffer
// would hang the dump. The stand-in page server answers after the first 5 bytes, and only then
// does the client send the rest.
func TestPageStreamTLSAnswersMidStream(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	p := midStreamPageServer(t)
	ca := newTestCA(t, "cluster-ca")
	addr, _ := serve(t, &Receiver{Root: t.TempDir(), NoSync: true, CRIU: p}, serverTLS(t, ca.node(t, "node-a")))
	conn, err := Dial(context.Background(), addr, clientTLS(t, ca.node(t, "node-b")))
	if err != nil {
		t.Fatal(err)
	}
	relay, err := StartPageRelay(context.Background(), conn, "c1")
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Close()
	c, err := net.Dial("tcp", relay.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, 3)
	if _, err := io.ReadFull(c, ack); err != nil || string(ack) != "ack" {
		t.Fatalf("the page server's answer to the first 5 bytes: %q, %v (a frame stuck in the relay's TLS buffer?)", ack, err)
	}
	rest := bytes.Repeat([]byte("page"), 200000)
	if _, err := c.Write(rest); err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).CloseWrite()
	if b, _ := io.ReadAll(c); string(b) != "ok" {
		t.Fatalf("the page server's last answer: %q", b)
	}
	ps, err := relay.Wait(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	sum := blake3.Sum256(append([]byte("hello"), rest...))
	if want := "blake3:" + hex.EncodeToString(sum[:]); ps.Digest != want || ps.Size != int64(5+len(rest)) {
		t.Fatalf("relay digested %s (%d bytes), want %s (%d)", ps.Digest, ps.Size, want, 5+len(rest))
	}
}

// TestReceiverPageServer: a receiver names the criu it would run for page streams, or says that
// it cannot run one (ErrPageStream, naming the binary) before anything is paused.
func TestReceiverPageServer(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "criu")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	notExe := filepath.Join(dir, "criu-noexec")
	if err := os.WriteFile(notExe, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		criu, want string
		ok         bool
	}{
		{criu: exe, want: exe, ok: true},
		{criu: filepath.Join(dir, "missing"), want: "missing"},
		{criu: notExe, want: "criu-noexec"},
	} {
		got, err := (&Receiver{CRIU: tc.criu}).PageServer()
		if tc.ok {
			if err != nil || got != tc.want {
				t.Errorf("%s: %q, %v; want %q", tc.criu, got, err, tc.want)
			}
			continue
		}
		if !errors.Is(err, ErrPageStream) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want ErrPageStream naming %s", tc.criu, err, tc.want)
		}
	}
}

// TestReadFrames: the receiver's reading of frames yields the bytes and digest that were framed,
// however its reader splits them, and a stream cut mid-frame or before its end frame is
// io.ErrUnexpectedEOF.
func TestReadFrames(t *testing.T) {
	data := make([]byte, 3<<20+12345)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	var framed bytes.Buffer
	if _, err := frame.Write(&framed, iotest.HalfReader(bytes.NewReader(data)), sha256.New()); err != nil {
		t.Fatal(err)
	}
	want := blake3.Sum256(data)
	for _, tc := range []struct {
		name string
		r    func(b []byte) io.Reader
	}{
		{"plain", func(b []byte) io.Reader { return iotest.HalfReader(bytes.NewReader(b)) }},
		{"bufio 16 B", func(b []byte) io.Reader { return bufio.NewReaderSize(bytes.NewReader(b), 16) }},
		{"bufio 64 KiB, short reads", func(b []byte) io.Reader {
			return bufio.NewReaderSize(iotest.HalfReader(bytes.NewReader(b)), 64<<10)
		}},
		{"bufio 1 MiB", func(b []byte) io.Reader { return bufio.NewReaderSize(bytes.NewReader(b), recvBufferSize) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			h := blake3.New()
			n, err := readFrames(&out, tc.r(framed.Bytes()), h)
			if err != nil || n != int64(len(data)) || !bytes.Equal(out.Bytes(), data) || !bytes.Equal(h.Sum(nil), want[:]) {
				t.Fatalf("readFrames = %d, %v; same bytes %v, same digest %v", n, err, bytes.Equal(out.Bytes(), data), bytes.Equal(h.Sum(nil), want[:]))
			}
			for _, cut := range []int{framed.Len() - 4, framed.Len() - 5, 4 + 1000, 3} {
				out.Reset()
				if _, err := readFrames(&out, tc.r(framed.Bytes()[:cut]), blake3.New()); !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Errorf("cut at %d of %d: %v, want io.ErrUnexpectedEOF", cut, framed.Len(), err)
				}
			}
		})
	}
}

// TestBridgePagesTLSAnswersMidStream: an agent's bridge gathers the TLS records of what it reads
// from the shim's socket into larger writes, but writes out everything it read before it reads
// again: the page server answers the first 5 bytes before the shim (here, the test) sends more,
// and its last answer once the rest, several frames, arrived.
func TestBridgePagesTLSAnswersMidStream(t *testing.T) {
	p := midStreamPageServer(t)
	ca := newTestCA(t, "cluster-ca")
	root := t.TempDir()
	addr, _ := serve(t, &Receiver{Root: root, NoSync: true, CRIU: p}, serverTLS(t, ca.node(t, "node-a")))
	conn, err := Dial(context.Background(), addr, clientTLS(t, ca.node(t, "node-b")))
	if err != nil {
		t.Fatal(err)
	}
	if err := AnnouncePages(conn, "c1", checkpoint.PageDigestBLAKE3, ""); err != nil {
		t.Fatal(err)
	}
	shim, agent := net.Pipe()
	bridged := make(chan error, 1)
	go func() { _, err := BridgePages(context.Background(), conn, agent); bridged <- err }()
	_ = shim.SetDeadline(time.Now().Add(10 * time.Second))
	frameOf := func(b []byte) []byte { // one frame of b, no end frame
		var f bytes.Buffer
		_, _ = frame.Write(&f, bytes.NewReader(b), blake3.New())
		return f.Bytes()[:f.Len()-4]
	}
	if _, err := shim.Write(frameOf([]byte("hello"))); err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, 3)
	if _, err := io.ReadFull(shim, ack); err != nil || string(ack) != "ack" {
		t.Fatalf("the page server's answer to the first 5 bytes: %q, %v (bytes stuck in the bridge's TLS buffer?)", ack, err)
	}
	rest := bytes.Repeat([]byte("page"), 700000) // several frames
	go func() {
		_, _ = frame.Write(shim, bytes.NewReader(rest), blake3.New())
	}()
	answer := make([]byte, 2)
	if _, err := io.ReadFull(shim, answer); err != nil || string(answer) != "ok" {
		t.Fatalf("the page server's last answer: %q, %v", answer, err)
	}
	shim.Close()
	if err := <-bridged; err != nil {
		t.Fatal(err)
	}
}

// midStreamPageServer writes a stand-in for criu whose page server answers "ack" after the first
// 5 bytes of the stream and "ok" after the rest (as CRIU's does mid-stream), keeping the bytes in
// pages-1.img of its images directory, and returns its path.
func midStreamPageServer(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "criu")
	script := "#!/bin/sh\n[ \"$1\" = page-server ] || exit 2\n" +
		"head -c 5 <&3 >\"$3/pages-1.img\" && printf ack >&3 && cat <&3 >>\"$3/pages-1.img\" && printf ok >&3\n"
	if err := os.WriteFile(p, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPageStreamNameNotTaken (issue 19): a certificate holder that opens a page stream under a
// move's checkpoint name first (and leaves it open) once took the name, and the move's own stream
// was refused as "in progress". Each stream is kept under its name and its ID, and the
// checkpoint adopts only the stream its signed manifest names: the move succeeds, and the
// stranger's stream is never adopted.
func TestPageStreamNameNotTaken(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t)})
	stranger := announcePages(t, addr, "c1", checkpoint.PageDigestBLAKE3)
	defer stranger.Close()
	if _, err := frame.Write(stranger, bytes.NewReader([]byte("not the victim's pages")), blake3.New()); err != nil {
		t.Fatal(err)
	}

	relay, err := StartPageRelay(context.Background(), dial(t, addr), "c1")
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("page"), 100000)
	if got := sendPages(t, relay, data); got != "ok" {
		t.Fatalf("the move's page stream beside the stranger's: answer %q (receiver: %v)", got, wait(t, out).err)
	}
	ps, err := relay.Wait(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !checkpoint.ValidStreamID(ps.ID) || ps.ID != relay.ID() {
		t.Fatalf("the relay's result names stream %q, announced %q", ps.ID, relay.ID())
	}
	sendMoveCheckpoint(t, addr, out, root, ps, data)
}

// TestPageStreamNotDiscardedByStranger: a checkpoint transfer that fails under the move's name
// (here: its berth.json differs from its header's, and names no page stream) leaves the move's
// page stream alone; the move's own checkpoint still adopts it.
func TestPageStreamNotDiscardedByStranger(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	root := filepath.Join(t.TempDir(), "root")
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t)})
	relay, err := StartPageRelay(context.Background(), dial(t, addr), "c1")
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("page"), 100000)
	if got := sendPages(t, relay, data); got != "ok" {
		t.Fatalf("page server answer %q (receiver: %v)", got, wait(t, out).err)
	}
	ps, err := relay.Wait(context.Background())
	if err != nil {
		t.Fatal(err)
	}

	junk := filepath.Join(t.TempDir(), "junk")
	makeCheckpoint(t, junk, 4096)
	_, stream := wire(t, junk, "c1")
	hdr := header{Magic: Magic, Name: "c1", TotalBytes: int64(len(stream)), Manifest: []byte(`{"version":1}`)}
	_, _ = sendStream(context.Background(), dial(t, addr), hdr, bytesTo(stream), nil)
	if o := wait(t, out); o.err == nil {
		t.Fatal("the stranger's checkpoint was kept")
	}

	sendMoveCheckpoint(t, addr, out, root, ps, data)
}

// sendMoveCheckpoint sends checkpoint c1 in copy mode (no page images, its manifest naming page
// stream ps) to the receiver at addr (root, results on out), and checks that both the checkpoint
// and its page stream end well and that the page image adopted is data.
func sendMoveCheckpoint(t *testing.T, addr string, out <-chan outcome, root string, ps checkpoint.PageStream, data []byte) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "c1")
	makeCheckpoint(t, dir, 64<<10)
	for _, p := range []string{"pages-1.img", "pages-2.img"} {
		if err := os.Remove(filepath.Join(dir, "checkpoint", p)); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1"}, PageStream: &ps}); err != nil {
		t.Fatal(err)
	}
	if _, err := Send(context.Background(), dial(t, addr), dir, "c1", nil); err != nil {
		t.Fatalf("the move's checkpoint: %v", err)
	}
	for range 2 {
		if o := wait(t, out); o.err != nil {
			t.Fatal(o.err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(root, "c1", "checkpoint", "pages-1.img")); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("the move's page image not adopted intact: %v", err)
	}
}
