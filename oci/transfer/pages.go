package transfer

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/berth-dev/berth/oci/transfer/frame"

	"github.com/moby/sys/capability"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/quote"
)

// Copy mode: CRIU's page stream travels on its own connection to the receiver, beside the
// checkpoint's. On the source, CRIU (`runc checkpoint --page-server`) connects to a PageRelay
// on 127.0.0.1; the relay forwards the stream over a connection to the receiver (mutual TLS
// between hosts, as Send's) and digests it as it goes. The receiver hands the bytes to a
// `criu page-server --ps-socket` that it runs itself on a socket it made (no port is opened on
// the destination) and digests them as they arrive. The page images land in a staging directory
// that the checkpoint's own transfer (same name, its manifest's PageStream) adopts once both
// digests agree. Page-server responses flow back on the same connection.

// pagesSuffix names the staging directory of a page stream: <StagingPrefix><name><pagesSuffix>.
const pagesSuffix = ".pages"

// PagesStagingDir is the staging directory under root where a receiver keeps the pages of
// checkpoint name's copy-mode page stream until the checkpoint's transfer adopts them. A
// process that ran a receiver in itself and gives up on a move removes it (the receiver's
// handler may still be running as the process exits).
// id is the stream's ID ("" for a sender that announced none).
func PagesStagingDir(root, name, id string) string {
	if id != "" {
		name += "-" + id
	}
	return filepath.Join(root, StagingPrefix+name+pagesSuffix)
}

// RemovePagesStaging removes the staging directories of every page stream of checkpoint name
// under root, whatever their IDs (PagesStagingDir), for a process that ran a receiver in itself
// and gives up on a move. It returns the first removal error.
func RemovePagesStaging(root, name string) error {
	err := os.RemoveAll(PagesStagingDir(root, name, ""))
	matches, _ := filepath.Glob(filepath.Join(root, StagingPrefix+name+"-*"+pagesSuffix))
	for _, m := range matches {
		id := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(m), StagingPrefix+name+"-"), pagesSuffix)
		if checkpoint.ValidStreamID(id) {
			err = errors.Join(err, os.RemoveAll(m))
		}
	}
	return err
}

// pagesKey is a page stream's key in Receiver.pages: the checkpoint's name and the stream's ID.
func pagesKey(name, id string) string { return name + "/" + id }

// ErrPageStream: the page stream for a checkpoint is missing, failed, or differs from the one
// its signed manifest records.
var ErrPageStream = errors.New("page stream")

// PageServer returns the path of the criu binary that serves this receiver's page streams (copy
// and lazy mode: r.CRIU, or "criu" looked up on PATH), or an error wrapping ErrPageStream that names
// the binary and why it cannot run (not found, not executable). Senders call it before they pause
// anything: a receiver without CRIU is otherwise found only mid-dump, by CRIU's "page server
// doesn't answer".
func (r *Receiver) PageServer() (string, error) {
	criu := r.CRIU
	if criu == "" {
		criu = "criu"
	}
	p, err := exec.LookPath(criu)
	if err != nil {
		return "", fmt.Errorf("%w: this receiver cannot run CRIU's page server %q (put the stack's criu on PATH, or use --mode stored): %w", ErrPageStream, criu, err)
	}
	return p, nil
}

// pageStream is a page stream a receiver is receiving or has received, by checkpoint name.
type pageStream struct {
	dir     string
	done    chan struct{} // closed once the stream ended and CRIU's page server exited
	adopted chan struct{} // closed once the checkpoint's transfer adopted or discarded them
	once    sync.Once
	lost    error // why the checkpoint's transfer discarded them
	// set before done is closed
	digest string
	size   int64
	err    error
}

// pagesDone is what receive returns for a page stream: Handle writes no verdict (the connection
// carried the page server's own answers) and reports err.
type pagesDone struct{ err error }

func (p pagesDone) Error() string {
	if p.err == nil {
		return "page stream received"
	}
	return p.err.Error()
}

// receivePages runs CRIU's page server for the page stream of checkpoint name arriving on br
// (conn is the connection, for the answers), into a staging directory under root, and keeps the
// result for the checkpoint's transfer (adoptPages), digested with alg (the algorithm the sender
// announced; checkpoint.NewPageDigest refuses one it does not know). The stream's bytes count against root's
// free space (pagespace.go; stated is the length its sender stated, 0 if none). It waits, at most IdleTimeout after the
// stream ended, for that transfer to adopt the pages, then removes what is left.
func (r *Receiver) receivePages(ctx context.Context, br *bufio.Reader, conn net.Conn, name, id string, stated int64, alg, root string) error {
	if err := ValidName(name); err != nil {
		return pagesDone{err}
	}
	if id != "" && !checkpoint.ValidStreamID(id) {
		return pagesDone{fmt.Errorf("receive pages of %s: %w: stream id %s is not 32 lowercase hex digits", name, ErrProtocol, quote.Value(id))}
	}
	h, err := checkpoint.NewPageDigest(alg)
	if err != nil {
		// before the page server starts: the sender's CRIU finds no page server and its dump
		// fails, leaving the source running; this receiver's log says why
		return pagesDone{fmt.Errorf("receive pages of %s: %w: %w", name, ErrPageStream, err)}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return pagesDone{fmt.Errorf("receive pages of %s: %w", name, err)}
	}
	key := pagesKey(name, id)
	space, err := r.claimPages(key, stated, root) // pagespace.go
	if err != nil {
		return pagesDone{fmt.Errorf("receive pages of %s: %w", name, err)}
	}
	defer r.release(pagesFlightKey(key))
	ps := &pageStream{dir: PagesStagingDir(root, name, id), done: make(chan struct{}), adopted: make(chan struct{})}
	r.mu.Lock()
	if r.pages == nil {
		r.pages = map[string]*pageStream{}
	}
	if _, busy := r.pages[key]; busy {
		r.mu.Unlock()
		return pagesDone{fmt.Errorf("receive pages of %s: %w: a page stream of that name and id is in progress", name, ErrExists)}
	}
	r.pages[key] = ps
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.pages, key)
		r.mu.Unlock()
		_ = os.RemoveAll(ps.dir)
	}()
	if err := os.Mkdir(ps.dir, 0o700); err != nil {
		ps.err = err
		close(ps.done)
		return pagesDone{fmt.Errorf("receive pages of %s: %w", name, err)}
	}
	ps.digest, ps.size, ps.err = r.servePages(ctx, br, conn, ps.dir, space, alg, h)
	close(ps.done)
	_ = conn.Close()
	if ps.err != nil {
		return pagesDone{fmt.Errorf("receive pages of %s: %w", name, ps.err)}
	}
	idle := r.IdleTimeout
	if idle <= 0 {
		idle = DefaultIdleTimeout
	}
	select {
	case <-ps.adopted:
		if ps.lost != nil {
			return pagesDone{fmt.Errorf("receive pages of %s: discarded: %w", name, ps.lost)}
		}
		return pagesDone{}
	case <-time.After(idle):
		return pagesDone{fmt.Errorf("receive pages of %s: %w: no checkpoint adopted them within %v; removed", name, ErrPageStream, idle)}
	case <-ctx.Done():
		return pagesDone{fmt.Errorf("receive pages of %s: %w", name, ctx.Err())}
	}
}

// servePages runs `criu page-server --ps-socket` into dir on one end of a loopback TCP
// connection the receiver makes itself, copies the stream from br into it (digesting it into h,
// a hash of algorithm alg) and the
// page server's answers back to conn, within space (pagespace.go). It returns the stream's digest and length once the source
// ended the stream and the page server exited; its log's last errors if it failed.
func (r *Receiver) servePages(ctx context.Context, br *bufio.Reader, conn net.Conn, dir string, space *pageSpace, alg string, h hash.Hash) (string, int64, error) {
	// Handle bounded the greeting's write by the handshake deadline: the page server's answers
	// come back over this connection for as long as the stream lasts
	_ = conn.SetWriteDeadline(time.Time{})
	ours, theirs, err := loopbackPair()
	if err != nil {
		return "", 0, err
	}
	defer ours.Close()
	f, err := theirs.(*net.TCPConn).File()
	theirs.Close()
	if err != nil {
		return "", 0, err
	}
	logFile := filepath.Join(dir, "page-server.log")
	criu := r.CRIU
	if criu == "" {
		criu = "criu"
	}
	args := []string{"page-server", "--images-dir", dir, "--ps-socket", "3", "-o", logFile, "-v2"}
	if !hasSysAdmin() {
		// without CAP_SYS_ADMIN (the agent container: CAP_CHECKPOINT_RESTORE only) CRIU's
		// root-only kernel probes fail (one unshares a network namespace) and with them any
		// command; --unprivileged skips them, and the page server needs none of what they probe
		args = append(args, "--unprivileged")
	}
	cmd := exec.CommandContext(ctx, criu, args...)
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		f.Close()
		return "", 0, fmt.Errorf("start criu page-server: %w", err)
	}
	f.Close()
	var n int64
	back := make(chan error, 1)
	go func() { // the page server's answers, to the source
		_, err := io.Copy(conn, ours)
		back <- err
	}()
	n, cerr := readFrames(space.writer(ours), br, h)
	if cw, ok := ours.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	werr := cmd.Wait()
	select { // the page server's last answers, up to its end of the socket closing with it
	case <-back:
	case <-time.After(HandshakeTimeout):
	}
	_ = ours.Close()
	if cerr != nil {
		return "", n, fmt.Errorf("%w: cut after %d bytes: %w", ErrPageStream, n, cerr)
	}
	if werr != nil {
		return "", n, fmt.Errorf("%w: criu page-server: %w%s", ErrPageStream, werr, logErrors(logFile))
	}
	return checkpoint.PageDigest(alg, h), n, nil
}

// hasSysAdmin reports whether this process has CAP_SYS_ADMIN in its effective set (read from
// /proc/self/status through moby/sys/capability); false when that cannot be read.
func hasSysAdmin() bool {
	caps, err := capability.NewPid2(0)
	if err != nil || caps.Load() != nil {
		return false
	}
	return caps.Get(capability.EFFECTIVE, capability.CAP_SYS_ADMIN)
}

// The page stream travels in frames (package frame): a cut link is never taken for its end.
const maxFrame = frame.MaxSize

// writeFrames is frame.Write: r to w in frames, hashed into h, then the end frame.
func writeFrames(w io.Writer, r io.Reader, h hash.Hash) (int64, error) {
	return frame.Write(w, r, h)
}

// readFrames copies a framed page stream from r to w, hashing it into h, up to its end frame;
// a stream that ends before it was cut (io.ErrUnexpectedEOF).
func readFrames(w io.Writer, r io.Reader, h hash.Hash) (int64, error) {
	buf := make([]byte, maxFrame) // whole frames: one read, one hash and one write each
	var hdr [4]byte
	var n int64
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
		k := int(binary.BigEndian.Uint32(hdr[:]))
		if k == 0 {
			return n, nil
		}
		if k > maxFrame {
			return n, fmt.Errorf("%w: page stream frame of %d bytes", ErrProtocol, k)
		}
		if _, err := io.ReadFull(r, buf[:k]); err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
		h.Write(buf[:k])
		if _, err := w.Write(buf[:k]); err != nil {
			return n, err
		}
		n += int64(k)
	}
}

// adoptPages moves the page images of checkpoint name's page stream into staging's CRIU image
// directory, once the stream's digest and length equal m.PageStream's (signed by the source).
// Without a PageStream in m it does nothing.
func (r *Receiver) adoptPages(ctx context.Context, name, staging string, m *checkpoint.Manifest) error {
	if m.PageStream == nil {
		return nil
	}
	r.mu.Lock()
	ps := r.pages[pagesKey(name, m.PageStream.ID)]
	r.mu.Unlock()
	if ps == nil {
		return fmt.Errorf("%w: the manifest records a page stream (%s, %d bytes, id %s), but none arrived for %s under that id", ErrPageStream, m.PageStream.Digest, m.PageStream.Size, quote.Value(m.PageStream.ID), name)
	}
	select {
	case <-ps.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	if ps.err != nil {
		return ps.err
	}
	if got := algOf(ps.digest); got != algOf(m.PageStream.Digest) {
		return fmt.Errorf("%w: the page stream arrived digested with %s, as its sender announced, but the signed manifest records a %s digest (%s); the pages are not kept",
			ErrPageStream, got, algOf(m.PageStream.Digest), m.PageStream.Digest)
	}
	if ps.digest != m.PageStream.Digest || ps.size != m.PageStream.Size {
		return fmt.Errorf("%w: received %s (%d bytes), the signed manifest records %s (%d bytes)", ErrPageStream, ps.digest, ps.size, m.PageStream.Digest, m.PageStream.Size)
	}
	ents, err := os.ReadDir(ps.dir)
	if err != nil {
		return err
	}
	images := filepath.Join(staging, checkpoint.ImagesDir)
	for _, e := range ents {
		p := checkpoint.ImagesDir + "/" + e.Name()
		if !checkpoint.IsPageImage(p) || !e.Type().IsRegular() {
			continue
		}
		if _, err := os.Lstat(filepath.Join(images, e.Name())); err == nil {
			return fmt.Errorf("%w: %s is both in the checkpoint and in its page stream", ErrPageStream, p)
		}
		if err := os.Rename(filepath.Join(ps.dir, e.Name()), filepath.Join(images, e.Name())); err != nil {
			return err
		}
	}
	ps.once.Do(func() { close(ps.adopted) })
	return nil
}

// discardPages ends the page stream that checkpoint name's manifest m names (m.PageStream's ID),
// if any, because the checkpoint's transfer failed with err: the page stream's handler removes
// what it received. Only that stream goes: a transfer that fails under a name another move
// also uses (a stranger's, or one whose manifest names no stream) costs that move nothing.
func (r *Receiver) discardPages(name string, m *checkpoint.Manifest, err error) {
	if m == nil || m.PageStream == nil {
		return
	}
	r.mu.Lock()
	ps := r.pages[pagesKey(name, m.PageStream.ID)]
	r.mu.Unlock()
	if ps != nil {
		ps.once.Do(func() { ps.lost = err; close(ps.adopted) })
	}
}

// algOf returns the algorithm a "<algorithm>:<hex>" digest names ("" if none).
func algOf(d string) string {
	alg, _, _ := strings.Cut(d, ":")
	return alg
}

// loopbackPair returns both ends of a TCP connection on 127.0.0.1 that nobody else can take:
// the listener accepts until the peer is the end it dialed itself.
func loopbackPair() (net.Conn, net.Conn, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return nil, nil, err
	}
	for {
		b, err := ln.Accept()
		if err != nil {
			a.Close()
			return nil, nil, err
		}
		if b.RemoteAddr().String() == a.LocalAddr().String() {
			return a, b, nil
		}
		b.Close()
	}
}

// logErrors returns "; CRIU says: " and the last error lines of a CRIU log, or "".
func logErrors(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 3 {
		errs = errs[len(errs)-3:]
	}
	if len(errs) == 0 {
		return ""
	}
	return "; CRIU says: " + strings.Join(errs, " | ")
}

// PageRelay is the source's end of a page stream: CRIU connects to Addr (127.0.0.1) as its page
// server; the relay forwards the stream to a receiver and digests it with
// checkpoint.PageDigestDefault, which its header announces to the receiver.
type PageRelay struct {
	ln net.Listener
	// cancel ends the relay's context: Close, whether CRIU connected yet or not
	cancel context.CancelFunc
	done   chan struct{}
	res    checkpoint.PageStream
	err    error
	id     string // the stream's ID (checkpoint.NewStreamID), announced in its header
}

// StartPageRelay announces checkpoint name's page stream on conn (a receiver's connection,
// greeted or not) and listens on 127.0.0.1 for CRIU's page client. It accepts one connection,
// from a socket owned by root (the shim's CRIU), and relays it both ways until CRIU ends it.
// conn is the relay's: it is closed when the relay ends.
func StartPageRelay(ctx context.Context, conn net.Conn, name string) (*PageRelay, error) {
	if err := ValidName(name); err != nil {
		return nil, fmt.Errorf("page relay: %w", err)
	}
	if _, err := Handshake(conn); err != nil {
		return nil, fmt.Errorf("page relay for %s: %w", name, err)
	}
	id := checkpoint.NewStreamID()
	line, err := json.Marshal(header{Magic: Magic, Name: name, Pages: true, PageDigest: checkpoint.PageDigestDefault, StreamID: id})
	if err != nil {
		return nil, err
	}
	_ = conn.SetWriteDeadline(time.Now().Add(HandshakeTimeout))
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("page relay for %s: %w", name, err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("page relay for %s: %w", name, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	p := &PageRelay{ln: ln, cancel: cancel, done: make(chan struct{}), id: id}
	go func() {
		defer close(p.done)
		defer conn.Close()
		defer cancel()
		p.res, p.err = p.relay(ctx, conn)
	}()
	return p, nil
}

// ID is the page stream's ID, announced to the receiver and returned in Wait's PageStream.
func (p *PageRelay) ID() string { return p.id }

// Addr is where CRIU's page client connects (ADDR:PORT on 127.0.0.1).
func (p *PageRelay) Addr() string { return p.ln.Addr().String() }

func (p *PageRelay) relay(ctx context.Context, conn net.Conn) (checkpoint.PageStream, error) {
	stop := context.AfterFunc(ctx, func() { _ = p.ln.Close(); _ = conn.Close() })
	defer stop()
	var c net.Conn
	for {
		var err error
		if c, err = p.ln.Accept(); err != nil {
			return checkpoint.PageStream{}, fmt.Errorf("%w: CRIU never connected: %w", ErrPageStream, err)
		}
		if rootPeer(c) {
			break
		}
		c.Close() // not the shim's CRIU
	}
	_ = p.ln.Close()
	defer c.Close()
	stop2 := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop2()
	back := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, conn)
		// the receiver ended the stream: CRIU, perhaps waiting for an answer, must see it end
		_ = c.(*net.TCPConn).CloseWrite()
		back <- err
	}()
	h, err := checkpoint.NewPageDigest(checkpoint.PageDigestDefault)
	if err != nil {
		return checkpoint.PageStream{}, err
	}
	// over TLS, one write of up to 256 KiB per 16 KiB records rather than one per record
	w, unbatch := coalescedFrames(conn)
	n, err := writeFrames(w, c, h)
	unbatch()
	if cw, ok := underlying(conn).(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	if err != nil {
		return checkpoint.PageStream{}, fmt.Errorf("%w: cut after %d bytes: %w", ErrPageStream, n, err)
	}
	select { // the receiver closes once its page server exited
	case <-back:
	case <-ctx.Done():
		return checkpoint.PageStream{}, ctx.Err()
	}
	return checkpoint.PageStream{Digest: checkpoint.PageDigest(checkpoint.PageDigestDefault, h), Size: n, ID: p.id}, nil
}

// Wait returns the stream's digest and length once CRIU ended it and the receiver closed.
func (p *PageRelay) Wait(ctx context.Context) (checkpoint.PageStream, error) {
	select {
	case <-p.done:
		return p.res, p.err
	case <-ctx.Done():
		return checkpoint.PageStream{}, ctx.Err()
	}
}

// Close stops the relay (a failed move): before CRIU connected it stops listening, during the
// stream it closes both connections, so CRIU's dump fails and the receiver removes what it got;
// Wait then returns the relay's error (context.Canceled when CRIU had connected). After the
// stream ended it changes nothing.
func (p *PageRelay) Close() {
	p.cancel()
	_ = p.ln.Close()
}

func underlying(c net.Conn) net.Conn {
	if g, ok := c.(Greeted); ok {
		return g.Conn
	}
	return c
}
