package transfer

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/fsutil"
	"github.com/berth-dev/berth/oci/internal/quote"
)

const (
	// StagingPrefix starts the name of a staging directory under Receiver.Root:
	// StagingPrefix + name + "-" + 16 hex digits. Such directories exist only while a transfer
	// runs (or after the receiving process died mid-transfer; see CleanStaging).
	StagingPrefix = ".incoming-"

	// DefaultIdleTimeout is Receiver.IdleTimeout when zero.
	DefaultIdleTimeout = time.Minute
	// DefaultHandshakeTimeout is Receiver.HandshakeTimeout when zero. It is below the senders'
	// HandshakeTimeout, so that a sender without TLS hears why before it gives up.
	DefaultHandshakeTimeout = 3 * time.Second
	// DefaultHeaderTimeout is Receiver.HeaderTimeout when zero. berthctl migrate greets the
	// receiver, then checkpoints the source, then sends the header: this covers the checkpoint.
	DefaultHeaderTimeout = 10 * time.Minute
	// DefaultTransferTimeout is Receiver.TransferTimeout when zero.
	DefaultTransferTimeout = 30 * time.Minute
	// DefaultMaxConns is Receiver.MaxConns when zero.
	DefaultMaxConns = 4
	// DefaultMinBodyRate is Receiver.MinBodyRate when zero, in bytes per second.
	DefaultMinBodyRate = 64 << 10
	// DefaultBodyRateWindow is MinBodyRate's unit of judgement: after w whole windows of the
	// body, at least w windows' worth of MinBodyRate must have arrived.
	DefaultBodyRateWindow = 30 * time.Second
	// DefaultMaxConnsPerPeer is Receiver.MaxConnsPerPeer when zero: a sender holds at most three
	// connections at once (preflight, checkpoint, page stream).
	DefaultMaxConnsPerPeer = 3
	// DefaultHeaderLineTimeout is Receiver.HeaderLineTimeout when zero.
	DefaultHeaderLineTimeout = 30 * time.Second
	// DefaultMaxHandshakes is Receiver.MaxHandshakes when zero.
	DefaultMaxHandshakes = 64
	// DefaultMaxHandshakesPerSource is Receiver.MaxHandshakesPerSource when zero: a sender opens
	// at most three connections at once (preflight, checkpoint, page stream).
	DefaultMaxHandshakesPerSource = 8
	// DefaultReserveBytes is Receiver.ReserveBytes when zero, in bytes.
	DefaultReserveBytes = 1 << 30

	// maxHeaderBytes bounds the header line, in bytes: a base64 manifest of up to
	// checkpoint.MaxManifestBytes, and room for the rest.
	maxHeaderBytes = checkpoint.MaxManifestBytes/3*4 + 8<<10
	// maxErrorText bounds the error text sent back in a verdict, in bytes.
	maxErrorText = 4 << 10
	// refusalTimeout bounds writing a busy or refused line, beyond the TLS handshake.
	refusalTimeout = time.Second
	// signatureSlack, plus 4/3 of berth.json's size, is how many bytes a stream may extract
	// beyond what its manifest announces: room for berth.sig (oci/signature), a DSSE envelope
	// holding the manifest in base64 and a few signatures.
	signatureSlack = 64 << 10
	// lingerTime is how long a receiver that refused before the end of the stream keeps reading
	// (and discarding) it, so the refusal reaches the sender instead of a connection reset.
	lingerTime = 2 * time.Second
	// recvBufferSize is the read buffer on the connection, in bytes.
	recvBufferSize = 1 << 20
)

// Receiver receives checkpoints sent with Send and stores each, once verified, as Root/<name>.
// Set its fields before the first Serve or Handle and leave them; the zero value of every field
// but Root is usable. One Receiver may handle many connections at once.
type Receiver struct {
	// Root is the directory that receives checkpoints; it is created with mode 0700 (and its
	// parents as needed) if missing. Only root should be able to write to it.
	Root string
	// Limits bound what one transfer may write (zero fields: the archive defaults). The sender
	// cannot exceed what its header announced either: the announced manifest's ImageSize plus
	// the size of berth.json, and room for a berth.sig (signatureSlack), cap the bytes extracted.
	Limits archive.Limits
	// IdleTimeout is how long a connection may go without the sender sending anything (or
	// without it reading the verdict) before the transfer fails; 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// HandshakeTimeout bounds, from the moment a connection is handled, the TLS handshake and
	// the greeting: a peer that has not completed its TLS handshake by then loses its slot.
	// 0 means DefaultHandshakeTimeout (3 s).
	HandshakeTimeout time.Duration
	// HeaderTimeout bounds, from the greeting, the arrival of the whole header line, however
	// steadily its bytes trickle in. It must cover the source's checkpoint when the sender greets
	// before checkpointing (berthctl migrate). 0 means DefaultHeaderTimeout (10 min).
	HeaderTimeout time.Duration
	// TransferTimeout bounds a whole connection, from the moment it is handled to the verdict:
	// handshake, header (with the source's checkpoint, see HeaderTimeout), stream, verification.
	// A transfer still running then fails with ErrDeadline. 0 means DefaultTransferTimeout
	// (30 min); raise it for checkpoints that take longer to move.
	TransferTimeout time.Duration
	// MaxConns is how many connections Serve handles at once; a connection beyond them is
	// answered "busy" (the sender gets ErrBusy) and closed. 0 means DefaultMaxConns.
	MaxConns int
	// MaxConnsPerPeer is how many of the MaxConns slots one peer may hold at once: a peer is
	// the verified certificate's identity (subject and names) from one source (sourceOf: an
	// IPv4 address or IPv6 /64), since a cluster's agents may share one certificate. A
	// connection beyond it is answered busy. It is capped at MaxConns-1 (when MaxConns > 1), and
	// one identity holds at most MaxConns-1 from all its sources together, so one peer never
	// holds every slot. 0 means DefaultMaxConnsPerPeer.
	MaxConnsPerPeer int
	// MinBodyRate is the slowest a checkpoint's archive body may arrive, in bytes per second,
	// averaged from its start and judged at each read after the first 30 s
	// (DefaultBodyRateWindow): IdleTimeout ends a sender that sends
	// nothing, this one that sends a byte at a time to keep a slot. 0 means DefaultMinBodyRate
	// (64 KiB/s); a negative value disables it. Page streams are not held to it (CRIU's page
	// server pauses while CRIU dumps).
	MinBodyRate int64
	// bodyRateWindow is DefaultBodyRateWindow when zero (tests shorten it).
	bodyRateWindow time.Duration
	// HeaderLineTimeout bounds the header line from its first byte to its end: a peer may wait
	// up to HeaderTimeout before it starts the header (the source's checkpoint), but not trickle
	// it in to keep a slot. 0 means DefaultHeaderLineTimeout (30 s).
	HeaderLineTimeout time.Duration
	// MaxHandshakes is how many connections may be in their TLS handshake at once (each for at
	// most HandshakeTimeout); 0 means DefaultMaxHandshakes. Beyond it, a new connection takes
	// the place of the oldest one of the source holding the most places, which Serve closes
	// (handshaking), so that peers on many addresses cannot keep every place by renewing them.
	// A connection takes one of the MaxConns slots only once its mutual TLS handshake
	// succeeded, so peers without a certificate of the cluster's CA cannot hold the slots that
	// senders need.
	MaxHandshakes int
	// MaxHandshakesPerSource is how many of those MaxHandshakes one source may hold at once
	// (an IPv4 address, or an IPv6 /64: what one host has); a connection beyond them is closed
	// unanswered, so that one peer that opens connections and never finishes their handshake
	// cannot take every handshake place and keep the other senders out. 0 means
	// DefaultMaxHandshakesPerSource; it is capped at MaxHandshakes.
	MaxHandshakesPerSource int
	// AllowedPeers, if not empty, limits senders to TLS peers whose verified certificate names
	// one of these, exactly: a DNS, IP or URI subject alternative name, or the subject's common
	// name. Others are refused after the TLS handshake (ErrPeerNotAllowed; the sender gets
	// ErrRefused), and so is every plain-TCP peer. Empty: every certificate the CA issued.
	AllowedPeers []string
	// FreeBytes returns how many bytes may still be written to the file system that holds
	// path (the tests inject it). nil means statfs(2) (f_bavail × f_frsize). A transfer whose
	// announced size does not fit (see ReserveBytes) is refused before anything is written;
	// an error from FreeBytes refuses the transfer too.
	FreeBytes func(path string) (uint64, error)
	// ReserveBytes is the margin, in bytes, that a transfer must leave free on Root's file
	// system, beyond what the transfers in progress have yet to write. 0 means
	// DefaultReserveBytes (1 GiB); negative means no margin.
	ReserveBytes int64
	// Verify, if not nil, is called on the directory of the staged berth.json (the staging
	// directory, or its checkpoint/ for a CRI archive, LayoutCRI) once every file matched the
	// manifest's digests, before the checkpoint is renamed into place (the berthctl wiring:
	// signature.Policy.Verify). An error refuses the checkpoint: the staging directory is
	// removed and the sender told why. ctx ends at the TransferTimeout deadline.
	Verify func(ctx context.Context, dir string) error
	// VerifySignature, if not nil, is called on the staged signed directory as soon as its
	// berth.json and berth.sig have arrived (signatureFirst), before the rest of the stream is
	// written: whether any key this node trusts signed that berth.json (for any namespace: the
	// namespace is Verify's to judge, with the whole checkpoint). An error refuses the stream
	// there. nil: the signature is checked only by Verify, at the end.
	VerifySignature func(ctx context.Context, dir string) error
	// NoSync skips fsyncing the received files before they are renamed into place. Leave it
	// false in production: a crash could otherwise leave a checkpoint in place whose files were
	// never written to disk. Tests and benchmarks on throwaway directories may set it.
	NoSync bool
	// OnDone, if not nil, is called by Serve after each connection, with the peer (a Peer:
	// address, and over TLS the verified certificate's subject and names), the path of the
	// stored checkpoint (empty on failure) and Handle's error (ErrBusy for a connection
	// answered busy). It may be called from several goroutines at once.
	OnDone func(remote net.Addr, path string, err error)

	// Preflight, if not nil, answers a preflight query (QueryPreflight: whether this node can
	// restore a container, before the sender pauses it) with opaque JSON; its error is sent as
	// the verdict's error. nil: queries are answered with an error (the sender goes on without
	// this node's checks). ctx ends at the TransferTimeout deadline.
	Preflight func(ctx context.Context, query json.RawMessage) (json.RawMessage, error)

	// CRIU is the criu binary that serves page streams (copy mode, pages.go); "" means "criu"
	// on PATH.
	CRIU string
	// LazyGuard is the command line of the lazy guard (lazyguard.go: `berthctl lazy-guard`),
	// to which the receiver appends the CRIU binary and the checkpoint directory: it runs the
	// `criu lazy-pages` daemon of a lazy page stream and outlives this process. Without it the
	// receiver refuses lazy streams.
	LazyGuard []string

	mu       sync.Mutex
	inFlight map[string]*inFlight   // names being received
	pages    map[string]*pageStream // page streams, by checkpoint name
}

// inFlight is a transfer in progress, for the free-space check of the others.
type inFlight struct {
	announced int64        // bytes it may write
	written   atomic.Int64 // bytes of stream read so far
}

// Receiver sentinel errors, each wrapped with the values that decided.
var (
	// ErrNoSpace: the announced size, plus the margin and what the transfers in progress have
	// yet to write, exceeds the free space of Root's file system.
	ErrNoSpace = errors.New("not enough free space for the checkpoint")
	// ErrDeadline: the connection outlived HandshakeTimeout, HeaderTimeout or TransferTimeout.
	ErrDeadline = errors.New("transfer deadline exceeded")
	// ErrPeerNotAllowed: the peer's certificate names none of AllowedPeers, or it has none; or,
	// on a receiver listening without TLS (Listen), the peer's socket is not root's.
	ErrPeerNotAllowed = errors.New("peer not allowed")
)

// Serve accepts connections on ln and handles each (Handle) in its own goroutine, at most
// MaxConns at a time, until ctx is done; then it closes ln, waits for the running transfers
// (which ctx also aborts) and returns nil. Each connection first completes its TLS handshake
// (within HandshakeTimeout; at most MaxHandshakesPerSource from one source, beyond which new
// connections are closed unanswered, and MaxHandshakes at once, beyond which the oldest of the
// source holding the most is closed for the new one) and only then takes a slot, so peers that cannot authenticate never hold
// one. An authenticated connection beyond MaxConns is answered "busy" at once and closed, so a
// sender never waits in the backlog; beyond MaxConns more of those, it is closed unanswered. Each connection is
// closed after Handle returns, and its outcome reported to OnDone. ln comes from Listen (TLS
// between nodes), or is any listener (a tls.NewListener's connections are handled the same).
//
// Errors: the listener's Accept error (wrapped), when it fails for another reason than ctx
// ending it; temporary (timeout) errors are retried.
func (r *Receiver) Serve(ctx context.Context, ln net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()

	maxConns := r.MaxConns
	if maxConns <= 0 {
		maxConns = DefaultMaxConns
	}
	maxHandshakes := r.MaxHandshakes
	if maxHandshakes <= 0 {
		maxHandshakes = DefaultMaxHandshakes
	}
	perSource := r.MaxHandshakesPerSource
	if perSource <= 0 {
		perSource = DefaultMaxHandshakesPerSource
	}
	perSource = min(perSource, maxHandshakes)
	handshakes := newHandshaking(maxHandshakes, perSource) // connections in their TLS handshake
	perPeer := r.MaxConnsPerPeer
	if perPeer <= 0 {
		perPeer = DefaultMaxConnsPerPeer
	}
	if maxConns > 1 {
		perPeer = min(perPeer, maxConns-1)
	}
	// one certificate identity, from however many sources, never holds every slot either
	peers := &peerSlots{max: perPeer, maxIdentity: max(maxConns-1, 1), held: map[string]int{}}
	slots := make(chan struct{}, maxConns)
	busy := make(chan struct{}, maxConns) // connections being answered busy
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("transfer: accept: %w", err)
		}
		src := sourceOf(conn.RemoteAddr())
		id, ok := handshakes.add(conn, src)
		if !ok {
			r.done(conn, "", fmt.Errorf("%w: %d connections from %s in their TLS handshake: closed unanswered", ErrBusy, perSource, src), func() {})
			continue
		}
		wg.Go(func() {
			// the TLS handshake first, outside the slots: only an authenticated peer may
			// take one (a plain connection, on loopback, has nothing to complete)
			err := r.handshakeTLS(conn, time.Now().Add(r.handshakeTimeout()))
			if !handshakes.remove(id) {
				err = fmt.Errorf("%w: %s was in its TLS handshake when all %d places were taken: closed for a newer connection", ErrBusy, conn.RemoteAddr(), maxHandshakes)
			}
			if err != nil {
				r.done(conn, "", err, func() {})
				return
			}
			key, ident := peerKey(conn), identityKey(conn)
			if !peers.take(key, ident) {
				err := r.answerBusy(ctx, conn, maxConns)
				r.done(conn, "", fmt.Errorf("%w (%s holds %d of the %d slots from this source, or %d from all, as many as one peer may)", err, peerOf(conn), perPeer, maxConns, peers.maxIdentity), func() {})
				return
			}
			select {
			case slots <- struct{}{}:
				path, err := r.Handle(ctx, conn)
				r.done(conn, path, err, func() { <-slots; peers.give(key, ident) })
				return
			default:
				peers.give(key, ident)
			}
			select {
			case busy <- struct{}{}:
				err := r.answerBusy(ctx, conn, maxConns)
				r.done(conn, "", err, func() { <-busy })
			default:
				r.done(conn, "", fmt.Errorf("%w: all %d slots in use, and %d busy answers: closed unanswered", ErrBusy, maxConns, maxConns), func() {})
			}
		})
	}
}

// peerSlots counts the slots each peer (peerKey) holds, at most max each, and each certificate
// identity (identityKey) from all its sources, at most maxIdentity.
type peerSlots struct {
	mu          sync.Mutex
	max         int
	maxIdentity int
	held        map[string]int
}

// take counts one more slot of peer key with certificate identity ident; false when the peer
// holds max already or the identity maxIdentity.
func (p *peerSlots) take(key, ident string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.held["peer|"+key] >= p.max || p.held["identity|"+ident] >= p.maxIdentity {
		return false
	}
	p.held["peer|"+key]++
	p.held["identity|"+ident]++
	return true
}

// give returns one slot of peer key with identity ident.
func (p *peerSlots) give(key, ident string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, k := range []string{"peer|" + key, "identity|" + ident} {
		if p.held[k]--; p.held[k] <= 0 {
			delete(p.held, k)
		}
	}
}

// identityKey names the certificate identity of an authenticated connection: its subject and
// names (none without TLS).
func identityKey(conn net.Conn) string {
	p := peerOf(conn)
	return p.Subject + "|" + strings.Join(p.Names, ",")
}

// peerKey names the peer of an authenticated connection for MaxConnsPerPeer: its certificate
// identity (identityKey) from its source host (sourceOf).
func peerKey(conn net.Conn) string {
	return sourceOf(conn.RemoteAddr()) + "|" + identityKey(conn)
}

// handshaking is the set of connections in their TLS handshake (Serve): at most max at once,
// at most perSource of them from one source (sourceOf). When it is full, a new connection takes
// the place of the oldest connection of the source that holds the most places, which is closed:
// so peers on many addresses that open connections and never finish their handshake cannot keep
// every place by renewing them each HandshakeTimeout; to displace a sender's handshake (one
// round trip, from a source holding one or two places) they must open max new connections from
// sources that hold as few, within that round trip.
type handshaking struct {
	mu        sync.Mutex
	max       int
	perSource int
	next      uint64
	conns     map[uint64]handshakeEntry
	bySource  map[string]int
}

// handshakeEntry is one connection of handshaking.
type handshakeEntry struct {
	conn net.Conn
	src  string
}

func newHandshaking(max, perSource int) *handshaking {
	return &handshaking{max: max, perSource: perSource, conns: map[uint64]handshakeEntry{}, bySource: map[string]int{}}
}

// add counts conn from src in and returns its id; ok is false (nothing counted) when src holds
// perSource places already. When every place is taken it closes the oldest connection of the
// source holding the most (its remove then reports false) and gives its place to conn.
func (h *handshaking) add(conn net.Conn, src string) (id uint64, ok bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.bySource[src] >= h.perSource {
		return 0, false
	}
	if len(h.conns) >= h.max {
		var victim uint64
		most := 0
		for id, e := range h.conns {
			if n := h.bySource[e.src]; n > most || (n == most && id < victim) {
				victim, most = id, n
			}
		}
		_ = h.conns[victim].conn.Close()
		h.drop(victim)
	}
	h.next++
	h.conns[h.next] = handshakeEntry{conn: conn, src: src}
	h.bySource[src]++
	return h.next, true
}

// remove takes connection id out of the set once its handshake ended; false: it had been closed
// for a newer connection (add).
func (h *handshaking) remove(id uint64) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.conns[id]; !ok {
		return false
	}
	h.drop(id)
	return true
}

// drop forgets connection id; h.mu is held.
func (h *handshaking) drop(id uint64) {
	src := h.conns[id].src
	delete(h.conns, id)
	if h.bySource[src]--; h.bySource[src] <= 0 {
		delete(h.bySource, src)
	}
}

// sourceOf names the host a connection comes from, for MaxHandshakesPerSource: its IPv4
// address, the /64 prefix of an IPv6 address (one host's usual share), else the address as a
// string (a Unix socket, a pipe in tests).
func sourceOf(a net.Addr) string {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return a.String()
	}
	ip := ap.Addr().Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}

// done closes conn, frees its slot (release) and then reports its outcome to OnDone.
func (r *Receiver) done(conn net.Conn, path string, err error, release func()) {
	peer := peerOf(conn)
	_ = conn.Close()
	release()
	if r.OnDone != nil {
		r.OnDone(peer, path, err)
	}
}

// answerBusy completes conn's TLS handshake, if any, and answers busy. It returns ErrBusy
// (wrapped), or the error that kept it from answering.
func (r *Receiver) answerBusy(ctx context.Context, conn net.Conn, maxConns int) error {
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	if err := r.handshakeTLS(conn, time.Now().Add(r.handshakeTimeout())); err != nil {
		return err
	}
	if err := writeLine(conn, busyLine, refusalTimeout); err != nil {
		return fmt.Errorf("tell %s the receiver is busy: %w", conn.RemoteAddr(), err)
	}
	return fmt.Errorf("%w: all %d slots in use: answered busy", ErrBusy, maxConns)
}

func (r *Receiver) headerLineTimeout() time.Duration {
	if r.HeaderLineTimeout > 0 {
		return r.HeaderLineTimeout
	}
	return DefaultHeaderLineTimeout
}

func (r *Receiver) handshakeTimeout() time.Duration {
	if r.HandshakeTimeout > 0 {
		return r.HandshakeTimeout
	}
	return DefaultHandshakeTimeout
}

// handshakeTLS completes conn's TLS handshake by deadline when conn is a *tls.Conn. A plain
// connection that Listen accepted from a socket not owned by root is refused (told so, then
// ErrPeerNotAllowed); other plain connections pass. A peer that sent nothing at all, most likely
// a berth sender without TLS waiting for the greeting, is told in plain text that TLS is required
// (over a Listen listener, which records that).
func (r *Receiver) handshakeTLS(conn net.Conn, deadline time.Time) error {
	if pc, ok := conn.(*plainConn); ok && !pc.root {
		_ = writeLine(conn, refusal("this receiver, without TLS, accepts only root's connections"), refusalTimeout)
		return fmt.Errorf("%w: %s: not a socket of root, and this receiver runs without TLS", ErrPeerNotAllowed, conn.RemoteAddr())
	}
	tc, ok := conn.(*tls.Conn)
	if !ok {
		return nil
	}
	_ = conn.SetDeadline(deadline)
	err := tc.Handshake()
	_ = conn.SetDeadline(time.Time{})
	if err == nil {
		return nil
	}
	if wc, ok := tc.NetConn().(*watchedConn); ok && !wc.read.Load() {
		_ = writeLine(wc, refusal("this receiver requires mutual TLS (give "+TLSFlags+")"), refusalTimeout)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%w: TLS handshake with %s not complete within HandshakeTimeout %v: %w", ErrDeadline, conn.RemoteAddr(), r.handshakeTimeout(), err)
	}
	return fmt.Errorf("TLS handshake with %s: %w", conn.RemoteAddr(), err)
}

// Handle receives one checkpoint from conn and answers the sender with the verdict. It returns
// the absolute path of the stored checkpoint, Root/<name>.
//
// Steps: complete the TLS handshake when conn is a *tls.Conn and check the peer against
// AllowedPeers (within HandshakeTimeout); greet; read and check the header (magic, name,
// manifest, sizes; within HeaderTimeout); refuse a name that exists under Root or is being
// received, and a size that does not fit Root's free space (FreeBytes, ReserveBytes); extract the
// stream (archive.Extract, with Limits) into a staging directory Root/.incoming-<name>-<random>;
// check that exactly the announced bytes came and that the berth.json received is the header's;
// verify every file (checkpoint.Verify); call Verify; fsync (unless NoSync); rename the staging
// directory to Root/<name> without replacing anything; fsync Root. On any failure the staging
// directory is removed, so nothing half-received remains, and the sender is told why.
//
// conn belongs to the caller, who closes it; Handle closes it only to abort when ctx is done.
// A sender that stalls for IdleTimeout fails the transfer, and so does one that takes longer
// than TransferTimeout in all.
//
// Errors: ErrDeadline, ErrPeerNotAllowed, the TLS handshake's error, ErrProtocol,
// ErrInvalidName, ErrExists, ErrNoSpace, checkpoint.ErrUnsupportedVersion,
// checkpoint.ErrInvalidManifest, archive's Err* refusals, oci's verification sentinels
// (checkpoint.ErrDigestMismatch...), Verify's error, conn's I/O errors (a cut connection:
// io.ErrUnexpectedEOF or a reset), ctx.Err(), file-system errors under Root; wrapped with the
// name when known. When the checkpoint was stored but the verdict could not be sent, Handle
// returns the path and that error.
func (r *Receiver) Handle(ctx context.Context, conn net.Conn) (string, error) {
	start := time.Now()
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	idle := r.IdleTimeout
	if idle <= 0 {
		idle = DefaultIdleTimeout
	}
	transferTimeout := r.TransferTimeout
	if transferTimeout <= 0 {
		transferTimeout = DefaultTransferTimeout
	}
	headerTimeout := r.HeaderTimeout
	if headerTimeout <= 0 {
		headerTimeout = DefaultHeaderTimeout
	}
	deadline := start.Add(transferTimeout)
	tctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()

	hsDeadline := start.Add(r.handshakeTimeout())
	if err := r.handshakeTLS(conn, hsDeadline); err != nil {
		return "", err
	}
	if len(r.AllowedPeers) > 0 {
		if p := peerOf(conn); !p.allowed(r.AllowedPeers) {
			who := "a peer without a TLS certificate"
			if p.Subject != "" || len(p.Names) > 0 {
				who = fmt.Sprintf("certificate %s (%s)", p.Subject, strings.Join(p.Names, ", "))
			}
			_ = writeLine(conn, refusal(who+" is not among this receiver's allowed peers"), refusalTimeout)
			return "", fmt.Errorf("%w: %s from %s names none of %q", ErrPeerNotAllowed, who, conn.RemoteAddr(), r.AllowedPeers)
		}
	}
	// greet first: a sender learns it reached a berth receiver before it pauses anything
	_ = conn.SetWriteDeadline(hsDeadline)
	if _, err := conn.Write([]byte(Greeting)); err != nil {
		if time.Now().After(hsDeadline) {
			err = fmt.Errorf("%w: HandshakeTimeout %v: %w", ErrDeadline, r.handshakeTimeout(), err)
		}
		return "", fmt.Errorf("greet sender %s: %w", conn.RemoteAddr(), err)
	}
	ir := &idleReader{conn: conn, idle: idle,
		hard: earliest(time.Now().Add(headerTimeout), deadline), limit: fmt.Sprintf("no complete header within HeaderTimeout %v", headerTimeout)}
	if ir.hard.Equal(deadline) {
		ir.limit = fmt.Sprintf("no complete header within TransferTimeout %v", transferTimeout)
	}
	br := bufio.NewReaderSize(ir, recvBufferSize)
	var answer json.RawMessage
	path, drained, err := r.receive(tctx, br, ir, deadline, transferTimeout, &answer)
	if pd, ok := err.(pagesDone); ok { // a page stream: no verdict, the page server answered
		return "", pd.err
	}
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	}

	v := verdict{OK: err == nil, Path: path, Preflight: answer}
	if err != nil {
		v.Error = err.Error()
		if len(v.Error) > maxErrorText {
			v.Error = v.Error[:maxErrorText] + "..."
		}
	}
	line, _ := json.Marshal(v) // cannot fail: strings and a bool
	_ = conn.SetWriteDeadline(time.Now().Add(idle))
	_, werr := conn.Write(append(line, '\n'))

	if err != nil {
		if !drained && ir.err == nil && werr == nil && ctx.Err() == nil {
			// We refused; the sender may still be streaming: read on for a moment, so that
			// closing the connection does not reset it before the sender has read the verdict.
			_ = conn.SetReadDeadline(time.Now().Add(lingerTime))
			_, _ = io.Copy(io.Discard, conn)
		}
		return "", err
	}
	if werr != nil {
		return path, fmt.Errorf("stored %s, but could not tell the sender: %w", path, werr)
	}
	return path, nil
}

// receive runs the protocol up to the verdict. drained reports whether the whole stream was
// read. ctx ends at the transfer's deadline.
func (r *Receiver) receive(ctx context.Context, br *bufio.Reader, ir *idleReader, deadline time.Time, transferTimeout time.Duration, answer *json.RawMessage) (path string, drained bool, retErr error) {
	b, err := br.Peek(1)
	if err == nil && b[0] == tlsHandshakeRecord {
		return "", false, fmt.Errorf("%w: the peer started a TLS handshake, but this receiver runs without TLS (give it %s)", ErrProtocol, TLSFlags)
	}
	if err == nil {
		// the header has begun: the rest of its line comes within HeaderLineTimeout, however
		// slowly its bytes trickle in
		if line := time.Now().Add(r.headerLineTimeout()); line.Before(ir.hard) {
			ir.hard, ir.limit = line, fmt.Sprintf("header line not complete within HeaderLineTimeout %v of its first byte", r.headerLineTimeout())
		}
	}
	hdr, err := readHeader(br)
	if err != nil {
		return "", false, err
	}
	ir.hard, ir.limit = deadline, fmt.Sprintf("transfer not complete within TransferTimeout %v", transferTimeout)
	name := hdr.Name
	if err := ValidName(name); err != nil {
		return "", false, err
	}
	if hdr.Pages && hdr.Lazy {
		// pages flow for as long as the restored task needs them, within the transfer's deadline;
		// the idle timeout still ends a dead link
		ir.hard = deadline
		return "", false, r.receiveLazyPages(ctx, br, ir.conn, name, hdr.StreamID, r.Root)
	}
	if hdr.Pages {
		ir.hard = deadline
		return "", false, r.receivePages(ctx, br, ir.conn, name, hdr.StreamID, hdr.PageBytes, hdr.PageDigest, r.Root)
	}
	if len(hdr.Preflight) > 0 {
		if r.Preflight == nil {
			return "", true, fmt.Errorf("preflight of %s: %w", name, ErrNoPreflight)
		}
		a, err := r.Preflight(ctx, hdr.Preflight)
		if err != nil {
			return "", true, fmt.Errorf("preflight of %s: %w", name, err)
		}
		*answer = a
		return "", true, nil
	}
	m, err := checkpoint.ParseManifest(hdr.Manifest)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: header manifest: %w", name, err)
	}
	lim := r.Limits.WithDefaults()
	// signed is where berth.json is, relative to the checkpoint directory
	signed := "."
	switch hdr.Layout {
	case "":
	case LayoutCRI:
		signed = checkpoint.ImagesDir
	default:
		return "", false, fmt.Errorf("receive %s: %w: layout %s", name, ErrProtocol, quote.Value(hdr.Layout))
	}
	if signed != "." {
		// a CRI archive: files beyond the manifest's (containerd's), so only the stream's
		// length bounds what it extracts
		if m.ImageSize > hdr.TotalBytes {
			return "", false, fmt.Errorf("receive %s: %w: stream of %d bytes announced for %d bytes of CRIU images",
				name, ErrProtocol, hdr.TotalBytes, m.ImageSize)
		}
		lim.MaxTotalBytes = min(lim.MaxTotalBytes, hdr.TotalBytes)
	} else if m.ImageSize > lim.MaxTotalBytes-int64(len(hdr.Manifest)) { // written so it cannot overflow
		return "", false, fmt.Errorf("receive %s: %w: %d bytes of files and %d of manifest announced, limit %d",
			name, archive.ErrTotalTooLarge, m.ImageSize, len(hdr.Manifest), lim.MaxTotalBytes)
	}
	if signed == "." {
		content := m.ImageSize + int64(len(hdr.Manifest)) // what the stream must extract, in bytes
		if hdr.TotalBytes < content {
			return "", false, fmt.Errorf("receive %s: %w: stream of %d bytes announced for %d bytes of files",
				name, ErrProtocol, hdr.TotalBytes, content)
		}
		// room for a berth.sig beside berth.json; an extra file of any other name is refused by
		// the verification
		// (content + the smaller of the two cannot overflow: it is at most hdr.TotalBytes)
		lim.MaxTotalBytes = content + min(sigAllowance(len(hdr.Manifest)), hdr.TotalBytes-content)
	}

	if r.Root == "" {
		return "", false, fmt.Errorf("receive %s: receiver has no root directory: %w", name, fs.ErrInvalid)
	}
	root, err := filepath.Abs(r.Root)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	// the stream's length bounds what it writes: tar headers and padding are about what the
	// file system's block rounding adds
	slot, err := r.claim(name, hdr.TotalBytes, root)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	defer r.release(name)
	final := filepath.Join(root, name)
	if _, err := os.Lstat(final); err == nil {
		return "", false, fmt.Errorf("receive %s: %w: %s", name, ErrExists, final)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}

	var suffix [8]byte
	_, _ = rand.Read(suffix[:]) // never fails
	staging := filepath.Join(root, StagingPrefix+name+"-"+hex.EncodeToString(suffix[:]))
	defer func() {
		if retErr != nil {
			r.discardPages(name, m, retErr)
			if err := os.RemoveAll(staging); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("remove %s: %w", staging, err))
			}
		}
	}()

	cr := &countingReader{r: r.rateFloor(io.LimitReader(br, hdr.TotalBytes)), n: &slot.written}
	digests, err := archive.ExtractDigestsThen(cr, staging, lim, r.signatureFirst(ctx, filepath.Join(staging, signed), signed, int64(len(hdr.Manifest)), sigAllowance(len(hdr.Manifest))))
	if err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	if n := cr.n.Load(); n != hdr.TotalBytes {
		return "", false, fmt.Errorf("receive %s: %w: stream ended after %d of %d bytes", name, ErrProtocol, n, hdr.TotalBytes)
	}
	drained = true

	signedDir := filepath.Join(staging, signed)
	got, err := checkpoint.ReadManifestBytes(signedDir)
	if err != nil {
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if !bytes.Equal(got, hdr.Manifest) {
		return "", drained, fmt.Errorf("receive %s: %w: the %s in the stream differs from the header's", name, ErrProtocol, filepath.Join(signed, checkpoint.ManifestFile))
	}
	if signed != "." {
		// the manifest's paths are relative to its own directory
		known := archive.Digests{}
		for p, d := range digests {
			if rel, ok := strings.CutPrefix(p, signed+"/"); ok {
				known[rel] = d
			}
		}
		digests = known
	}
	// digests were computed while extracting: no second read of the files
	if err := checkpoint.VerifyDigests(signedDir, m, digests); err != nil {
		return "", drained, fmt.Errorf("receive %s: %s%w", name, strings.TrimPrefix(signed+"/", "./"), err)
	}
	if signed != "." {
		// a CRI archive: beside the signed checkpoint/, only the files containerd writes, which
		// no restore reads; anything else is kept by no receiver
		if err := checkpoint.CheckCRITop(staging, false); err != nil {
			return "", drained, fmt.Errorf("receive %s: %w", name, err)
		}
	}
	if r.Verify != nil {
		if err := r.Verify(ctx, signedDir); err != nil {
			return "", drained, fmt.Errorf("receive %s: refused by verification: %w", name, err)
		}
	}
	// a page stream's images go into the CRIU image directory: ImagesDir in both layouts (a CRI
	// checkpoint's manifest is in it)
	if err := r.adoptPages(ctx, name, staging, m); err != nil {
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if signed != "." {
		// a CRI checkpoint's stamp goes beside its checkpoint/, inside the directory (its parent
		// is the checkpoint directory, not the root), before the rename: files keep their
		// inodes and change times when their directory is renamed
		_ = checkpoint.WriteStamp(filepath.Join(staging, signed), m)
	}
	if !r.NoSync {
		if err := syncTree(staging); err != nil {
			return "", drained, fmt.Errorf("receive %s: %w", name, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return "", drained, fmt.Errorf("receive %s: %w: not verified within TransferTimeout %v: %w", name, ErrDeadline, transferTimeout, err)
	}
	if err := fsutil.RenameNoReplace(staging, final); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return "", drained, fmt.Errorf("receive %s: %w: %s", name, ErrExists, final)
		}
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if !r.NoSync {
		// Best effort: the checkpoint is complete and in place, only the rename's durability
		// would be in doubt, and reporting failure for a stored checkpoint would mislead.
		_ = fsutil.SyncDir(root)
	}
	// record the verification so the shim's restore need not read the files again; without
	// the stamp it verifies in full, so a failure here costs time, not safety
	if signed == "." {
		_ = checkpoint.WriteStamp(final, m)
	}
	return final, drained, nil
}

// signatureFirst returns the extraction hooks that call VerifySignature on the staged signed
// directory (signed: its path relative to the checkpoint, "." or checkpoint.ImagesDir) as soon
// as its berth.json and berth.sig are both written, or once another file follows berth.json
// without a berth.sig (berth's archives carry the two first): a stream that no trusted key
// signed is refused before its bulk reaches the disk. In berth's own layout (signed ".") the
// stream's first entry must be berth.json of manifestLen bytes (the header's), and a berth.sig
// after it at most sigMax bytes, or the stream is refused with ErrProtocol before that entry is
// written. No hooks without VerifySignature.
func (r *Receiver) signatureFirst(ctx context.Context, dir, signed string, manifestLen, sigMax int64) archive.Hooks {
	if r.VerifySignature == nil {
		return archive.Hooks{}
	}
	manifest := path.Join(signed, checkpoint.ManifestFile)
	sig := path.Join(signed, checkpoint.SignatureFile)
	var haveManifest, haveSig, checked bool
	var entries int
	before := func(e archive.Entry) error {
		if entries++; checked || signed != "." {
			return nil
		}
		switch {
		case entries == 1 && (e.Name != manifest || e.Dir):
			// berth's own layout: berth.json is the first entry; a stream that puts it later
			// would have everything else written before its signature is read
			return fmt.Errorf("%w: %s is the stream's first entry, not %s: berth's archives carry %s and %s first; refused before it was written",
				ErrProtocol, quote.Value(e.Name), manifest, manifest, sig)
		case entries == 1 && e.Size != manifestLen:
			return fmt.Errorf("%w: %s in the stream is %d bytes, the header's %d", ErrProtocol, manifest, e.Size, manifestLen)
		case e.Name == sig && e.Size > sigMax:
			return fmt.Errorf("%w: %s is %d bytes, more than a signature's %d", ErrProtocol, sig, e.Size, sigMax)
		}
		return nil
	}
	after := func(name string) error {
		if checked {
			return nil
		}
		switch name {
		case manifest:
			haveManifest = true
		case sig:
			haveSig = true
		}
		if !haveManifest || (!haveSig && name == manifest) || (!haveSig && signed != ".") {
			return nil // a CRI archive's files come in containerd's order: wait for both
		}
		checked = true
		if err := r.VerifySignature(ctx, dir); err != nil {
			return fmt.Errorf("refused before the rest of the stream was written: %w", err)
		}
		return nil
	}
	return archive.Hooks{Before: before, After: after}
}

// sigAllowance is the most bytes a berth.sig beside a berth.json of manifestLen bytes may have:
// signatureSlack and 4/3 of the manifest (a signature envelope carries it base64-encoded).
func sigAllowance(manifestLen int) int64 {
	return int64(manifestLen)/3*4 + signatureSlack
}

// tlsHandshakeRecord is the first byte of a TLS connection (a handshake record: ClientHello).
const tlsHandshakeRecord = 0x16

// claim marks name as being received and reserves announced bytes of root's file system. It
// fails with ErrExists when name is being received, with ErrNoSpace when announced bytes, what
// the other transfers have yet to write and the margin exceed the free space, and with
// FreeBytes's error.
func (r *Receiver) claim(name string, announced int64, root string) (*inFlight, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inFlight[name] != nil {
		return nil, fmt.Errorf("%w: another transfer of it is running", ErrExists)
	}
	free := r.FreeBytes
	if free == nil {
		free = statfsFree
	}
	avail, err := free(root)
	if err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return nil, fmt.Errorf("free space of %s: %w", root, err)
	}
	if err == nil {
		margin := r.ReserveBytes
		if margin == 0 {
			margin = DefaultReserveBytes
		}
		margin = max(margin, 0)
		var pending int64 // bytes the transfers in progress have yet to write
		for _, f := range r.inFlight {
			pending += max(f.announced-f.written.Load(), 0)
		}
		// compared in uint64: avail may exceed math.MaxInt64 on no file system today, but the
		// sum of three non-negative int64s cannot overflow a uint64
		if need := uint64(announced) + uint64(pending) + uint64(margin); need > avail {
			return nil, fmt.Errorf("%w: %d bytes announced, %d bytes free on the file system of %s, margin %d bytes, %d bytes still to come for %d transfers in progress",
				ErrNoSpace, announced, avail, root, margin, pending, len(r.inFlight))
		}
	}
	if r.inFlight == nil {
		r.inFlight = map[string]*inFlight{}
	}
	f := &inFlight{announced: announced}
	r.inFlight[name] = f
	return f, nil
}

func (r *Receiver) release(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.inFlight, name)
}

// CleanStaging removes every staging directory (StagingPrefix*) under Root, and every lazy
// page stream's daemon directory (checkpoint.LazyPagesDir) with its checkpoint, which holds no
// memory: leftovers of a receiving process that died mid-transfer. Call it at startup, before Serve, and never while
// a transfer into Root may be running (from this process or another).
//
// Errors: the *fs.PathError of reading Root (none when Root does not exist) or of a removal.
func (r *Receiver) CleanStaging() error {
	entries, err := os.ReadDir(r.Root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("clean staging: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), StagingPrefix) {
			if err := os.RemoveAll(filepath.Join(r.Root, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
		// a lazy page stream's daemon directory: its checkpoint, which holds no memory, goes too
		if name, ok := strings.CutPrefix(e.Name(), lazyPrefix); ok && ValidName(name) == nil {
			if m, err := checkpoint.ReadManifest(filepath.Join(r.Root, name)); err == nil && m.PostCopy {
				if err := os.RemoveAll(filepath.Join(r.Root, name)); err != nil {
					errs = append(errs, err)
				}
				if err := checkpoint.RemoveStamp(filepath.Join(r.Root, name)); err != nil {
					errs = append(errs, err)
				}
			}
			if err := os.RemoveAll(filepath.Join(r.Root, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clean staging: %w", err)
	}
	return nil
}

// readHeader reads and decodes the header line.
func readHeader(br *bufio.Reader) (header, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > maxHeaderBytes {
			return header{}, fmt.Errorf("%w: header line longer than %d bytes", ErrProtocol, maxHeaderBytes)
		}
		if err == nil {
			break
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if errors.Is(err, io.EOF) {
			return header{}, fmt.Errorf("%w: connection closed before the header ended", ErrProtocol)
		}
		return header{}, fmt.Errorf("reading header: %w", err)
	}
	var h header
	if err := json.Unmarshal(line, &h); err != nil {
		return header{}, fmt.Errorf("%w: header: %w", ErrProtocol, err)
	}
	if h.Magic != Magic {
		return header{}, fmt.Errorf("%w: magic %s, want %q", ErrProtocol, quote.Value(h.Magic), Magic)
	}
	return h, nil
}

// syncTree fsyncs every file and directory under dir, dir included.
func syncTree(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return err
		}
		return f.Close()
	})
}

// idleReader reads from conn, failing a read that waits longer than idle or past hard (an
// absolute deadline, reported as ErrDeadline with limit). It remembers the first read error
// (end of stream included).
type idleReader struct {
	conn  net.Conn
	idle  time.Duration
	hard  time.Time
	limit string
	err   error
}

func (r *idleReader) Read(p []byte) (int, error) {
	if err := r.conn.SetReadDeadline(earliest(time.Now().Add(r.idle), r.hard)); err != nil {
		r.err = err
		return 0, err
	}
	n, err := r.conn.Read(p)
	var ne net.Error
	if err != nil && errors.As(err, &ne) && ne.Timeout() && !time.Now().Before(r.hard) {
		err = fmt.Errorf("%w: %s: %w", ErrDeadline, r.limit, err)
	}
	if err != nil && r.err == nil {
		r.err = err
	}
	return n, err
}

// earliest returns the earlier of a and b.
func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// countingReader counts the bytes read through it.
// rateFloor returns body held to MinBodyRate (body itself when it is disabled).
func (r *Receiver) rateFloor(body io.Reader) io.Reader {
	rate := r.MinBodyRate
	if rate == 0 {
		rate = DefaultMinBodyRate
	}
	if rate < 0 {
		return body
	}
	window := r.bodyRateWindow
	if window <= 0 {
		window = DefaultBodyRateWindow
	}
	return &floorReader{r: body, window: window, min: int64(float64(rate) * window.Seconds()), start: time.Now()}
}

// floorReader fails a read, with ErrDeadline, once fewer bytes have arrived since start than
// min for each whole window elapsed: the body's average rate from its start, so bursts between
// long waits cannot keep a slot at a fraction of the rate. A read blocked with nothing arriving
// is IdleTimeout's to end; the next read after it is judged with the time it waited.
type floorReader struct {
	r      io.Reader
	window time.Duration
	min    int64 // bytes per window
	start  time.Time
	n      int64
}

func (f *floorReader) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	f.n += int64(n)
	elapsed := time.Since(f.start)
	if windows := int64(elapsed / f.window); windows > 0 && f.n < windows*f.min {
		return n, fmt.Errorf("%w: %d bytes of the checkpoint arrived in %v, less than MinBodyRate (%d bytes/s): the sender is too slow, or holds the connection open",
			ErrDeadline, f.n, elapsed.Round(time.Millisecond), f.min*int64(time.Second)/int64(f.window))
	}
	return n, err
}

type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}
