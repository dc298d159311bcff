package transfer

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// Lazy (post-copy) mode: the source's CRIU (`runc checkpoint` with lazy-pages) listens on
// 127.0.0.1 once it dumped everything but the memory, and serves the pages from the frozen task
// over TLS, to the one client that shows a certificate of the dump's own CA (lazytls.go: the
// LazyRelay made both identities, and holds its key only in memory; any local process may
// connect first, but none other is served a page).
// On the destination a `criu lazy-pages` daemon, which the receiver runs on a socket it made
// (--ps-socket: no port is opened there), asks for them: on demand when the restored task
// touches a page, and in the background until it has them all. A LazyRelay on the source
// connects to CRIU and carries both directions over one connection to the receiver (mutual TLS
// between hosts, like Send's), in frames (writeFrames) each way, so that a cut link is never
// taken for the end.
//
// The connection's protocol, after the greeting and a header line with Pages and Lazy set:
//  1. the receiver answers a verdict line at once: whether this node can restore lazily
//     (criu.CheckLazyRestore); the sender dials before it pauses anything, so a refusal costs
//     nothing;
//  2. once the checkpoint of that name is in the receiver's root (its own transfer), marked
//     PostCopy by its verified manifest, which records the header's StreamID as LazyStream
//     (a stream of another ID is refused: any peer may name any checkpoint), the receiver has its lazy guard (lazyguard.go, which
//     outlives the receiver and kills the restored task before the daemon may lose its input)
//     start the daemon in checkpoint.LazyPagesDir and answers a second verdict line: ready (the
//     restore may begin);
//  3. frames both ways: CRIU's answers to the daemon, the daemon's requests to CRIU, each
//     direction ended by an empty frame when its side closes;
//  4. the receiver's last verdict line: whether the daemon exited successfully, having every
//     page (CRIU's lazy-pages exits 0 only then).
// The receiver removes the daemon's directory, and the checkpoint (it holds no memory and
// cannot be restored again), when the stream ends, however it ends.

// lazyPrefix starts the name of checkpoint.LazyPagesDir's directories in a receiver's root.
const lazyPrefix = ".lazy-"

// ErrLazyRefused: the receiver cannot restore lazily; the error carries its reason.
var ErrLazyRefused = errors.New("lazy mode refused by the destination")

// LazyRelay is the source's end of a lazy page stream.
type LazyRelay struct {
	conn net.Conn
	// files is CRIU's TLS identity (ServerTLS), tlsConf the relay's own (its client)
	files   checkpoint.LazyTLS
	tlsConf *tls.Config
	name    string
	id      string
	addr    string
	ready   chan struct{} // closed once Start returned
	done    chan struct{}
	err     error
	once    sync.Once
	sent    atomic.Int64 // Bytes
}

// StartLazyRelay announces checkpoint name's lazy page stream on conn (a receiver's
// connection, greeted or not) and returns once the receiver said it can restore lazily: a
// refusal is ErrLazyRefused with its reason. It picks the loopback port CRIU's lazy page server
// will listen on (Addr) and makes the TLS identities of that server (ServerTLS) and of the
// relay, its one client. conn is the relay's: Close or the stream's end closes it.
func StartLazyRelay(ctx context.Context, conn net.Conn, name string) (*LazyRelay, error) {
	if err := ValidName(name); err != nil {
		return nil, fmt.Errorf("lazy page relay: %w", err)
	}
	if _, err := Handshake(conn); err != nil {
		return nil, fmt.Errorf("lazy page relay for %s: %w", name, err)
	}
	var id [16]byte
	if _, err := rand.Read(id[:]); err != nil {
		return nil, err
	}
	line, err := json.Marshal(header{Magic: Magic, Name: name, Pages: true, Lazy: true, StreamID: hex.EncodeToString(id[:])})
	if err != nil {
		return nil, err
	}
	_ = conn.SetWriteDeadline(time.Now().Add(HandshakeTimeout))
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("lazy page relay for %s: %w", name, err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	_ = conn.SetReadDeadline(time.Now().Add(HandshakeTimeout))
	v, err := readVerdict(conn)
	_ = conn.SetReadDeadline(time.Time{})
	if err != nil {
		return nil, fmt.Errorf("lazy page relay for %s: %w", name, err)
	}
	if !v.OK {
		return nil, fmt.Errorf("%w: %s", ErrLazyRefused, v.Error)
	}
	// the port CRIU listens on: free now; CRIU binds it when it is ready
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("lazy page relay for %s: %w", name, err)
	}
	addr := ln.Addr().String()
	ln.Close()
	files, conf, err := newLazyTLS(time.Now())
	if err != nil {
		return nil, fmt.Errorf("lazy page relay for %s: TLS identities: %w", name, err)
	}
	return &LazyRelay{conn: conn, name: name, id: hex.EncodeToString(id[:]), addr: addr, files: files, tlsConf: conf,
		ready: make(chan struct{}), done: make(chan struct{})}, nil
}

// ServerTLS is the TLS identity CRIU's lazy page server is to use (PEM: the dump's CA, the
// server's certificate and key), for checkpoint.WriteLazyTLS beside the lazy dump's request.
func (p *LazyRelay) ServerTLS() checkpoint.LazyTLS { return p.files }

// Addr is where CRIU's lazy page server is to listen (ADDR:PORT on 127.0.0.1).
func (p *LazyRelay) Addr() string { return p.addr }

// ID is the stream's ID (32 hex digits, random), which the checkpoint's signed manifest must
// record (checkpoint.Manifest.LazyStream) for the receiver to serve the checkpoint to this stream.
func (p *LazyRelay) ID() string { return p.id }

// Start connects to CRIU's lazy page server at Addr (it listens once the shim's Checkpoint
// returned; dialLazyServer: root's socket, TLS with ServerTLS's identity) and, once the receiver
// has the checkpoint and its lazy-pages daemon runs, starts relaying the pages in the background
// and returns: the destination may restore now. Errors: CRIU not listening, a socket not owned
// by root, a failed TLS handshake (another process connected first: CRIU served it no page, and
// failed the dump), or the receiver's refusal (ErrPageStream).
func (p *LazyRelay) Start(ctx context.Context) error {
	c, err := dialLazyServer(p.addr, p.tlsConf, HandshakeTimeout)
	if err != nil {
		p.fail(err)
		return p.err
	}
	// the receiver answers once it has the checkpoint and its daemon listens
	stop := context.AfterFunc(ctx, func() { _ = p.conn.Close(); _ = c.Close() })
	v, err := readVerdict(p.conn)
	if err == nil && !v.OK {
		err = fmt.Errorf("%w: the destination: %s", ErrPageStream, v.Error)
	}
	if err != nil {
		stop()
		c.Close()
		p.fail(fmt.Errorf("lazy pages of %s: %w", p.name, err))
		return p.err
	}
	close(p.ready)
	go func() {
		defer stop()
		defer c.Close()
		p.fail(p.relay(c))
	}()
	return nil
}

func (p *LazyRelay) fail(err error) {
	p.once.Do(func() {
		p.err = err
		_ = p.conn.Close()
		close(p.done)
	})
}

// relay carries CRIU's answers (c, TLS) to the receiver and the daemon's requests back, until
// the receiver's last verdict.
func (p *LazyRelay) relay(c *tls.Conn) error {
	back := make(chan error, 1)
	go func() { // the daemon's requests, to CRIU
		_, err := readFrames(c, p.conn, nopHash{})
		if err == nil {
			_ = c.CloseWrite() // TLS close_notify: CRIU's own shutdown waits for it
		} else {
			// the link is gone: CRIU, waiting for the next request, must see it end
			_ = c.Close()
		}
		back <- err
	}()
	n, werr := writeFrames(p.conn, c, nopHash{})
	p.sent.Store(n)
	if werr != nil {
		return fmt.Errorf("%w: lazy pages of %s cut after %d bytes: %w", ErrPageStream, p.name, n, werr)
	}
	if err := <-back; err != nil {
		return fmt.Errorf("%w: lazy pages of %s: the link to the destination cut: %w", ErrPageStream, p.name, err)
	}
	v, err := readVerdict(p.conn)
	if err != nil {
		return fmt.Errorf("%w: lazy pages of %s: no word from the destination after the stream: %w", ErrPageStream, p.name, err)
	}
	if !v.OK {
		return fmt.Errorf("%w: lazy pages of %s: the destination: %s", ErrPageStream, p.name, v.Error)
	}
	return nil
}

// Wait returns once every page reached the destination's daemon (nil) or the stream failed.
func (p *LazyRelay) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Bytes is what CRIU's lazy page server sent through the relay to the destination's daemon, in
// bytes: the pages and CRIU's page-server headers (the framing not counted). It is known once
// CRIU ended its side of the stream (a Wait that returned nil); 0 before.
func (p *LazyRelay) Bytes() int64 { return p.sent.Load() }

// Close ends the stream (a failed move): the receiver stops its daemon.
func (p *LazyRelay) Close() { p.fail(fmt.Errorf("%w: lazy page relay closed", ErrPageStream)) }

// nopHash is a hash.Hash that hashes nothing: lazy pages are not digested (the connection's
// authentication covers them; checkpoint.Manifest.PostCopy).
type nopHash struct{}

func (nopHash) Write(p []byte) (int, error) { return len(p), nil }
func (nopHash) Sum(b []byte) []byte         { return b }
func (nopHash) Reset()                      {}
func (nopHash) Size() int                   { return 0 }
func (nopHash) BlockSize() int              { return 1 }

// lazyPoll is how often the receiver looks for the checkpoint a lazy page stream waits for.
const lazyPoll = 10 * time.Millisecond

// receiveLazyPages is the receiver's side of a lazy page stream for checkpoint name, of ID
// streamID (the protocol above). It returns pagesDone: the verdicts were written on conn.
func (r *Receiver) receiveLazyPages(ctx context.Context, br *bufio.Reader, conn net.Conn, name, streamID, root string) error {
	_ = conn.SetWriteDeadline(time.Time{})
	say := func(err error) error {
		v := verdict{OK: err == nil}
		if err != nil {
			v.Error = err.Error()
		}
		line, _ := json.Marshal(v)
		_ = conn.SetWriteDeadline(time.Now().Add(HandshakeTimeout))
		_, werr := conn.Write(append(line, '\n'))
		_ = conn.SetWriteDeadline(time.Time{})
		return werr
	}
	criuPath := r.CRIU
	if criuPath == "" {
		criuPath = "criu"
	}
	if len(r.LazyGuard) == 0 {
		err := errors.New("this receiver has no lazy guard (Receiver.LazyGuard): a task restored lazily could run on with missing pages read as zeros if the receiver died")
		_ = say(err)
		return pagesDone{fmt.Errorf("lazy pages of %s: %w", name, err)}
	}
	if err := criu.New(criuPath).CheckLazyRestore(ctx); err != nil {
		_ = say(err)
		return pagesDone{fmt.Errorf("lazy pages of %s: %w", name, err)}
	}
	if err := say(nil); err != nil {
		return pagesDone{fmt.Errorf("lazy pages of %s: %w", name, err)}
	}
	err := r.serveLazy(ctx, br, conn, name, streamID, root, say)
	if err != nil {
		err = fmt.Errorf("lazy pages of %s: %w", name, err)
	}
	_ = say(err)
	return pagesDone{err}
}

// serveLazy waits for checkpoint name in root, checks that its verified manifest binds the
// stream streamID (Manifest.LazyStream), runs the lazy-pages daemon for it under
// r.LazyGuard, says ready and relays until the guard exits (with the daemon's verdict). Once it
// started serving (a PostCopy checkpoint whose daemon directory it created), it removes the
// daemon's directory and the checkpoint, however the stream ends; a checkpoint of another mode,
// or one another stream serves, is refused and left as it is. It never kills the daemon itself:
// it ends the guard's control pipe, and the guard kills the restored task first.
func (r *Receiver) serveLazy(ctx context.Context, br *bufio.Reader, conn net.Conn, name, streamID, root string, say func(error) error) (retErr error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return err
	}
	final := filepath.Join(abs, name)
	idle := r.IdleTimeout
	if idle <= 0 {
		idle = DefaultIdleTimeout
	}
	// the checkpoint's own transfer is on its way, on another connection
	deadline := time.Now().Add(idle)
	for {
		if _, err := os.Stat(filepath.Join(final, checkpoint.ManifestFile)); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: checkpoint %s did not arrive within %v", ErrPageStream, name, idle)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(lazyPoll):
		}
	}
	// Only a stream that serves the checkpoint removes it: one that names a checkpoint taken in
	// another mode, or one whose daemon another stream runs, must leave it (any peer may name
	// any checkpoint of the root).
	m, err := checkpoint.ReadManifest(final)
	if err != nil {
		return err
	}
	if !m.PostCopy {
		return fmt.Errorf("%w: checkpoint %s was not taken in lazy mode", ErrPageStream, name)
	}
	// the manifest is the signed one (the checkpoint is in the root only once verified); the
	// expected ID is never told: it is what a peer that is not the source lacks
	if m.LazyStream == "" {
		return fmt.Errorf("%w: checkpoint %s: its signed manifest binds no lazy page stream (lazyStream)", ErrPageStream, name)
	}
	if subtle.ConstantTimeCompare([]byte(m.LazyStream), []byte(streamID)) != 1 {
		return fmt.Errorf("%w: checkpoint %s: its signed manifest binds another lazy page stream than this one (stream ID %q)", ErrPageStream, name, streamID)
	}
	dir := checkpoint.LazyPagesDir(final)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("%w: %s exists: another lazy stream serves %s", ErrExists, dir, name)
		}
		return err
	}
	defer func() {
		// it holds no memory: restored once, or never, it cannot be restored again
		if err := os.RemoveAll(final); err != nil {
			retErr = errors.Join(retErr, err)
		}
		if err := checkpoint.RemoveStamp(final); err != nil {
			retErr = errors.Join(retErr, err)
		}
	}()
	defer os.RemoveAll(dir)
	ours, theirs, err := loopbackPair()
	if err != nil {
		return err
	}
	defer ours.Close()
	f, err := theirs.(*net.TCPConn).File()
	theirs.Close()
	if err != nil {
		return err
	}
	sr, sw, err := os.Pipe()
	if err != nil {
		f.Close()
		return err
	}
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		f.Close()
		sr.Close()
		sw.Close()
		return err
	}
	defer ctlW.Close()
	held, err := ours.(*net.TCPConn).File()
	if err != nil {
		f.Close()
		sr.Close()
		sw.Close()
		ctlR.Close()
		return err
	}
	logFile := filepath.Join(dir, "lazy-pages.log")
	criuPath := r.CRIU
	if criuPath == "" {
		criuPath = "criu"
	}
	guardLog, err := os.OpenFile(filepath.Join(dir, "lazy-guard.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		f.Close()
		sr.Close()
		sw.Close()
		ctlR.Close()
		held.Close()
		return err
	}
	// the guard, not this process, runs the daemon: it outlives this process (lazyguard.go)
	cmd := exec.Command(r.LazyGuard[0], append(append([]string(nil), r.LazyGuard[1:]...), criuPath, final)...)
	cmd.ExtraFiles = []*os.File{f, sw, held, ctlR}
	cmd.Stdout, cmd.Stderr = guardLog, guardLog
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	f.Close()
	sw.Close()
	held.Close()
	ctlR.Close()
	guardLog.Close()
	if err != nil {
		sr.Close()
		return fmt.Errorf("start the lazy guard %s: %w", r.LazyGuard[0], err)
	}
	// a cancelled receive ends the control pipe: the guard kills the restored task, then the daemon
	stopCtl := context.AfterFunc(ctx, func() { _ = ctlW.Close() })
	defer stopCtl()
	guardErr := func(werr error) string {
		b, _ := os.ReadFile(filepath.Join(dir, "lazy-guard.log"))
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		return fmt.Sprintf("%v (lazy guard: %s)%s", werr, lines[len(lines)-1], logErrors(logFile))
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var b [1]byte
	_, rerr := sr.Read(b[:])
	sr.Close()
	if rerr != nil {
		_ = ctlW.Close()
		werr := <-exited
		return fmt.Errorf("%w: criu lazy-pages did not start: %s", ErrPageStream, guardErr(werr))
	}
	if err := say(nil); err != nil { // ready: the restore may begin
		_ = ctlW.Close()
		<-exited
		return err
	}
	back := make(chan error, 1)
	go func() { // the daemon's requests, to the source
		// the daemon's end of the socket ends the requests, however it ends (a daemon killed
		// with answers unread resets it): its exit status tells how
		_, err := writeFrames(conn, eofReader{ours}, nopHash{})
		back <- err
	}()
	// a daemon that died stops taking requests' answers: read the source's frames on up to its
	// end (the source ends its stream once it sees the daemon's end), so that the verdict, the
	// daemon's exit, reaches it
	dw := &drainWriter{w: ours}
	_, cerr := readFrames(dw, br, nopHash{})
	if cerr != nil {
		// the source is gone: the daemon cannot finish; the guard kills the restored task,
		// then the daemon (a task must not run on with pages missing)
		_ = ctlW.Close()
	} else if cw, ok := ours.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	werr := <-exited
	_ = ours.Close()
	select {
	case <-back:
	case <-time.After(HandshakeTimeout):
	}
	if cerr != nil {
		return fmt.Errorf("%w: cut: %w", ErrPageStream, cerr)
	}
	if werr != nil {
		return fmt.Errorf("%w: criu lazy-pages: %s", ErrPageStream, guardErr(werr))
	}
	return nil
}

// drainWriter writes to w until a write fails, then discards (and remembers the failure).
type drainWriter struct {
	w   io.Writer
	err error
}

func (d *drainWriter) Write(p []byte) (int, error) {
	if d.err == nil {
		if _, err := d.w.Write(p); err != nil {
			d.err = err
		}
	}
	return len(p), nil
}

// eofReader reads r and reports any error as io.EOF.
type eofReader struct{ r io.Reader }

func (e eofReader) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err != nil {
		err = io.EOF
	}
	return n, err
}
