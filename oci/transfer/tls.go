package transfer

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

var (
	// ErrBadTLSFile is returned by ServerTLS and ClientTLS (wrapped, naming the file) when a
	// CA, certificate or key file is missing, unreadable, not PEM of the expected kind, or when
	// the certificate does not match the key or was not issued by the CA.
	ErrBadTLSFile = errors.New("unusable TLS file")
	// ErrInsecure is returned by CheckListen, Listen and Dial (wrapped, naming the address) for
	// plain TCP to or from a non-loopback address, and for a server configuration that does not
	// require and verify client certificates.
	ErrInsecure = errors.New("transfer without mutual TLS")
)

// TLSFlags names the berthctl flags that configure TLS, for error messages.
const TLSFlags = "--tls-ca, --tls-cert and --tls-key"

// TLSFiles names the PEM files of one node's identity in the cluster's transfer PKI, as
// cert-manager writes them into a kubernetes.io/tls Secret: ca.crt, tls.crt, tls.key.
//
// Every node uses the same CA. A node's certificate serves both ends, so it needs both extended
// key usages, "server auth" (berthctl receive) and "client auth" (berthctl send and migrate), or
// none (cert-manager: usages [server auth, client auth, digital signature]); its DNS or IP
// subject alternative names must include the name senders dial.
type TLSFiles struct {
	// CA is the cluster CA's certificate(s) (PEM "CERTIFICATE" blocks): the only issuer whose
	// certificates a peer may present.
	CA string
	// Cert is this node's certificate (PEM), optionally followed by intermediates.
	Cert string
	// Key is the private key of Cert (PEM, PKCS#8, SEC 1 or PKCS#1). Only root should read it.
	Key string
}

// Enabled reports whether any file is set: TLS was asked for.
func (f TLSFiles) Enabled() bool { return f.CA != "" || f.Cert != "" || f.Key != "" }

// ServerTLS returns the receiving side's configuration: TLS 1.3 at least, this node's
// certificate, and client certificates required and verified against the CA
// (tls.RequireAndVerifyClientCert). Pass it to Listen.
//
// Errors: ErrBadTLSFile, wrapped with the file's path and the reason.
func ServerTLS(f TLSFiles) (*tls.Config, error) {
	pool, cert, err := f.load()
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
	}, nil
}

// ClientTLS returns the sending side's configuration: TLS 1.3 at least, this node's certificate
// as the client certificate, and the receiver's certificate verified against the CA and
// serverName (a DNS name or an IP address; "" lets Dial take the host of the address it dials).
//
// Errors: ErrBadTLSFile, wrapped with the file's path and the reason.
func ClientTLS(f TLSFiles, serverName string) (*tls.Config, error) {
	pool, cert, err := f.load()
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ServerName:   serverName,
	}, nil
}

// load reads the three files and checks that the certificate was issued by the CA.
func (f TLSFiles) load() (*x509.CertPool, tls.Certificate, error) {
	for _, p := range []struct{ what, path string }{{"CA", f.CA}, {"certificate", f.Cert}, {"key", f.Key}} {
		if p.path == "" {
			return nil, tls.Certificate{}, fmt.Errorf("%w: no %s file given (all of %s are needed)", ErrBadTLSFile, p.what, TLSFlags)
		}
	}
	caPEM, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("%w: CA %s: %w", ErrBadTLSFile, f.CA, err)
	}
	pool := x509.NewCertPool()
	n := 0
	for rest := caPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, tls.Certificate{}, fmt.Errorf("%w: CA %s: certificate %d: %w", ErrBadTLSFile, f.CA, n+1, err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return nil, tls.Certificate{}, fmt.Errorf("%w: CA %s: no PEM CERTIFICATE block", ErrBadTLSFile, f.CA)
	}
	certPEM, err := os.ReadFile(f.Cert)
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("%w: certificate %s: %w", ErrBadTLSFile, f.Cert, err)
	}
	keyPEM, err := os.ReadFile(f.Key)
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("%w: key %s: %w", ErrBadTLSFile, f.Key, err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("%w: certificate %s with key %s: %w", ErrBadTLSFile, f.Cert, f.Key, err)
	}
	leaf := cert.Leaf // set by X509KeyPair since Go 1.23, unless GODEBUG says otherwise
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, tls.Certificate{}, fmt.Errorf("%w: certificate %s: %w", ErrBadTLSFile, f.Cert, err)
		}
	}
	inter := x509.NewCertPool()
	for _, der := range cert.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("%w: certificate %s (%s) does not verify against CA %s: %w", ErrBadTLSFile, f.Cert, leaf.Subject, f.CA, err)
	}
	return pool, cert, nil
}

// IsLoopback reports whether host (a host name or IP literal, without port) is "localhost" or a
// loopback address (127.0.0.0/8, ::1). Other names are not resolved: they count as remote.
func IsLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// CheckListen checks that a receiver may listen on addr (host:port): plain TCP only on a
// loopback address (tests, single-node labs); any other address, an empty host (all
// interfaces) included, needs TLS.
//
// Errors: ErrInsecure, wrapped with the address and the flags that enable TLS; the address's
// parse error.
func CheckListen(addr string, withTLS bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	if !withTLS && !IsLoopback(host) {
		return fmt.Errorf("listen %s: %w: a receiver reachable from other hosts must authenticate its peers; give %s (or listen on 127.0.0.1)",
			addr, ErrInsecure, TLSFlags)
	}
	return nil
}

// Listen listens on addr (TCP) for Receiver.Serve. With cfg (ServerTLS) every connection is
// TLS; cfg must require and verify client certificates. Without cfg addr must be a loopback
// address (CheckListen), and the receiver accepts only connections from sockets owned by root
// (on Linux, from /proc/net/tcp and tcp6; elsewhere none): any other local user's connection
// is refused before the greeting (ErrPeerNotAllowed), so that on a shared host only root sends
// checkpoints, page streams or preflight queries to a receiver without TLS.
//
// Errors: ErrInsecure (wrapped, naming the address); net.Listen's error, wrapped with the
// address.
func Listen(addr string, cfg *tls.Config) (net.Listener, error) {
	if err := CheckListen(addr, cfg != nil); err != nil {
		return nil, err
	}
	if cfg != nil && (cfg.ClientAuth != tls.RequireAndVerifyClientCert || cfg.ClientCAs == nil) {
		return nil, fmt.Errorf("listen %s: %w: the TLS configuration does not require and verify client certificates (use ServerTLS)", addr, ErrInsecure)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	if cfg == nil {
		return rootOnlyListener{ln}, nil
	}
	return &tlsListener{Listener: ln, cfg: cfg}, nil
}

// rootOnlyListener is Listen's listener without TLS: each connection records whether its peer's
// socket is root's (rootPeer), and the receiver refuses the others (Receiver.handshakeTLS).
type rootOnlyListener struct{ net.Listener }

func (l rootOnlyListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &plainConn{Conn: c, root: rootPeer(c)}, nil
}

// plainConn is a connection accepted without TLS on loopback; root: its peer's socket is root's.
type plainConn struct {
	net.Conn
	root bool
}

// tlsListener is tls.NewListener that remembers, per connection, whether the peer sent
// anything: a receiver tells a peer that sent nothing (a plain berth sender waiting for the
// greeting) in plain text that TLS is required.
type tlsListener struct {
	net.Listener
	cfg *tls.Config
}

func (l *tlsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return tls.Server(&watchedConn{Conn: c, r: bufio.NewReaderSize(c, recvBufferSize)}, l.cfg), nil
}

// watchedConn records whether anything was read from the connection. It reads through r, a
// large buffer: crypto/tls reads about one record (16 KiB) per call, and a system call for each
// costs the receiver more than the copy out of the buffer.
type watchedConn struct {
	net.Conn
	r    *bufio.Reader
	read atomic.Bool
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.read.Store(true)
	}
	return n, err
}

// Dial connects to the receiver at addr (host:port) and waits for its greeting (Handshake),
// all within ctx and HandshakeTimeout; pass the result to Send. With cfg (ClientTLS) the
// connection is TLS, and the receiver's certificate must name cfg.ServerName or, when that is
// empty, addr's host. Without cfg addr must be a loopback address: a checkpoint holds the
// process's memory, secrets included, and is code to the receiver.
//
// Errors: ErrInsecure (plain TCP to a remote address); the dial error; the TLS handshake's error
// (wrapped, naming the address; ErrProtocol when the receiver answered in plain text); and
// Handshake's (ErrBusy, ErrRefused, ErrProtocol). All name addr.
func Dial(ctx context.Context, addr string, cfg *tls.Config) (Greeted, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return Greeted{}, fmt.Errorf("dial receiver %s: %w", addr, err)
	}
	if cfg == nil && !IsLoopback(host) {
		return Greeted{}, fmt.Errorf("dial receiver %s: %w: checkpoints leave this host only over mutual TLS; give %s", addr, ErrInsecure, TLSFlags)
	}
	ctx, cancel := context.WithTimeout(ctx, HandshakeTimeout)
	defer cancel()
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return Greeted{}, fmt.Errorf("dial receiver %s: %w", addr, err)
	}
	conn := raw
	if cfg != nil {
		if cfg.ServerName == "" {
			cfg = cfg.Clone()
			cfg.ServerName = host
		}
		tc := tls.Client(&coalescer{Conn: raw}, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = raw.Close()
			var rh tls.RecordHeaderError
			if errors.As(err, &rh) && strings.HasPrefix(Magic, string(rh.RecordHeader[:])) {
				return Greeted{}, fmt.Errorf("receiver %s: %w: it answered in plain text (%q): it runs without TLS", addr, ErrProtocol, rh.RecordHeader[:])
			}
			if isRemoteTLSAlert(err) {
				return Greeted{}, fmt.Errorf("%w: receiver %s refused the TLS handshake: %w", ErrRefused, addr, err)
			}
			return Greeted{}, fmt.Errorf("receiver %s: TLS handshake: %w", addr, err)
		}
		conn = tc
	}
	g, err := Handshake(conn)
	if err != nil {
		_ = conn.Close()
		// Handshake names the peer's address; name the receiver as it was given, as every
		// other error here does
		return Greeted{}, fmt.Errorf("receiver %s: %w", addr, err)
	}
	return g, nil
}

// Peer is the remote end of a connection as Receiver.OnDone reports it (as its net.Addr): the
// address and, over TLS, the identity its verified certificate states.
type Peer struct {
	// Addr is the remote address.
	Addr net.Addr
	// Subject is the verified certificate's subject ("CN=node-b,O=..."); "" without TLS or
	// before the handshake completed.
	Subject string
	// Names are the certificate's subject alternative names: DNS names, IP addresses and URIs.
	Names []string
	cn    string // the subject's common name
}

// Network returns the address's network.
func (p Peer) Network() string { return p.Addr.Network() }

// String returns the address, then the identity in parentheses when there is one:
// "10.0.0.7:41234 (CN=node-b; node-b.berth.svc, 10.0.0.7)".
func (p Peer) String() string {
	if p.Subject == "" && len(p.Names) == 0 {
		return p.Addr.String()
	}
	return fmt.Sprintf("%s (%s; %s)", p.Addr, p.Subject, strings.Join(p.Names, ", "))
}

// peerOf returns conn's Peer; the identity is set when conn is a *tls.Conn whose handshake
// completed with a client certificate.
func peerOf(conn net.Conn) Peer {
	p := Peer{Addr: conn.RemoteAddr()}
	tc, ok := conn.(*tls.Conn)
	if !ok {
		return p
	}
	st := tc.ConnectionState()
	if !st.HandshakeComplete || len(st.PeerCertificates) == 0 {
		return p
	}
	c := st.PeerCertificates[0]
	p.Subject, p.cn = c.Subject.String(), c.Subject.CommonName
	p.Names = append(p.Names, c.DNSNames...)
	for _, ip := range c.IPAddresses {
		p.Names = append(p.Names, ip.String())
	}
	for _, u := range c.URIs {
		p.Names = append(p.Names, u.String())
	}
	return p
}

// allowed reports whether p's certificate names one of list: a subject alternative name or
// the subject's common name, exactly.
func (p Peer) allowed(list []string) bool {
	for _, a := range list {
		if a != "" && (a == p.cn || slices.Contains(p.Names, a)) {
			return true
		}
	}
	return false
}

// coalescer is the TCP connection under a sender's TLS connection (Dial). crypto/tls writes
// every record, at most 16 KiB, with a system call of its own; while a stream is sent
// (coalesceWrites) the coalescer gathers them into writes of up to coalesceBytes, which costs
// the sender and, on the receiving host, the TCP stack far less per byte. Otherwise (the
// handshake, the verdict's alerts) it writes through.
type coalescer struct {
	net.Conn
	mu  sync.Mutex
	on  bool
	buf []byte
}

// coalesceBytes is the largest write a coalescer gathers, in bytes.
const coalesceBytes = 256 << 10

func (c *coalescer) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.on {
		return c.Conn.Write(p)
	}
	if len(c.buf)+len(p) > coalesceBytes {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
	}
	if len(p) >= coalesceBytes {
		return c.Conn.Write(p)
	}
	c.buf = append(c.buf, p...)
	return len(p), nil
}

// flushLocked writes what was gathered; c.mu is held.
func (c *coalescer) flushLocked() error {
	if len(c.buf) == 0 {
		return nil
	}
	_, err := c.Conn.Write(c.buf)
	c.buf = c.buf[:0]
	return err
}

// coalesceWrites turns on the gathering of TLS records for a stream on conn (a Dial
// connection over TLS; for others it does nothing) and returns the function that writes what
// is gathered and turns it off, returning the write's error. Call it before the stream's
// first write and the returned function once the stream is written, before waiting for an
// answer.
func coalesceWrites(conn net.Conn) (done func() error) {
	if g, ok := conn.(Greeted); ok {
		conn = g.Conn
	}
	tc, ok := conn.(*tls.Conn)
	if !ok {
		return func() error { return nil }
	}
	c, ok := tc.NetConn().(*coalescer)
	if !ok {
		return func() error { return nil }
	}
	c.mu.Lock()
	c.on = true
	if c.buf == nil {
		c.buf = make([]byte, 0, coalesceBytes)
	}
	c.mu.Unlock()
	return func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.on = false
		return c.flushLocked()
	}
}

// coalescedFrames returns a writer to conn that gathers the TLS records of each Write into
// writes of up to coalesceBytes, flushing what it gathered before the Write returns (each Write
// is a whole page-stream frame, which the peer may have to answer before more comes), and the
// function that turns the gathering off again. Without TLS (or a conn not from Dial) it returns
// conn itself and a function that does nothing.
func coalescedFrames(conn net.Conn) (io.Writer, func()) {
	inner := conn
	if g, ok := inner.(Greeted); ok {
		inner = g.Conn
	}
	tc, ok := inner.(*tls.Conn)
	if !ok {
		return conn, func() {}
	}
	c, ok := tc.NetConn().(*coalescer)
	if !ok {
		return conn, func() {}
	}
	done := coalesceWrites(conn)
	return frameWriter{conn, c}, func() { _ = done() }
}

// frameWriter writes each Write to conn through c, gathering, then flushes c.
type frameWriter struct {
	conn net.Conn
	c    *coalescer
}

func (w frameWriter) Write(p []byte) (int, error) {
	n, err := w.conn.Write(p)
	w.c.mu.Lock()
	if ferr := w.c.flushLocked(); err == nil {
		err = ferr
	}
	w.c.mu.Unlock()
	return n, err
}
