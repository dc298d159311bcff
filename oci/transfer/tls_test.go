package transfer

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// testCA is a cluster CA for tests, generated per test (no fixture to expire): it writes each
// node's files as cert-manager names them in a kubernetes.io/tls Secret.
type testCA struct {
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newTestCA(t testing.TB, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), name)
	writePEM(t, filepath.Join(dir, "ca.crt"), "CERTIFICATE", der)
	return &testCA{dir: dir, cert: cert, key: key}
}

// node issues a certificate for node name (CN, and the DNS name <name>.berth.test), valid for
// localhost and 127.0.0.1, with the given extended key usages (none: server and client auth),
// and returns its files.
func (ca *testCA) node(t testing.TB, name string, usages ...x509.ExtKeyUsage) TLSFiles {
	t.Helper()
	if usages == nil {
		usages = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name, Organization: []string{"berth"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usages,
		DNSNames:     []string{"localhost", name + ".berth.test"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(ca.dir, name)
	writePEM(t, filepath.Join(dir, "tls.crt"), "CERTIFICATE", der)
	writePEM(t, filepath.Join(dir, "tls.key"), "PRIVATE KEY", pkcs8)
	return TLSFiles{CA: filepath.Join(ca.dir, "ca.crt"), Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key")}
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func serverTLS(t testing.TB, f TLSFiles) *tls.Config {
	t.Helper()
	cfg, err := ServerTLS(f)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func clientTLS(t testing.TB, f TLSFiles) *tls.Config {
	t.Helper()
	cfg, err := ClientTLS(f, "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// done is one connection's outcome as Receiver.OnDone reports it.
type done struct {
	peer net.Addr
	path string
	err  error
}

// serve runs r on a loopback Listen listener (TLS with cfg) until the test ends and returns its
// address and every connection's outcome.
func serve(t testing.TB, r *Receiver, cfg *tls.Config) (string, <-chan done) {
	t.Helper()
	ln, err := Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan done, 64)
	r.OnDone = func(peer net.Addr, path string, err error) { out <- done{peer, path, err} }
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- r.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln.Addr().String(), out
}

func next(t testing.TB, out <-chan done) done {
	t.Helper()
	select {
	case d := <-out:
		return d
	case <-time.After(20 * time.Second):
		t.Fatal("receiver did not finish a connection")
		return done{}
	}
}

// sendTo dials addr (TLS with cfg) and sends dir as name.
func sendTo(t testing.TB, addr string, cfg *tls.Config, dir, name string) (Result, error) {
	t.Helper()
	conn, err := Dial(context.Background(), addr, cfg)
	if err != nil {
		return Result{}, err
	}
	defer conn.Close()
	return Send(context.Background(), conn, dir, name, nil)
}

func TestTLSFiles(t *testing.T) {
	ca := newTestCA(t, "cluster-ca")
	good := ca.node(t, "node-a")
	other := newTestCA(t, "other-ca").node(t, "node-x")
	dir := t.TempDir()
	noCert := filepath.Join(dir, "empty.crt")
	if err := os.WriteFile(noCert, []byte("not PEM\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.crt")

	cases := []struct {
		name  string
		files TLSFiles
		want  []string // in the error; nil: no error
	}{
		{"cert-manager files", good, nil},
		{"no CA given", TLSFiles{Cert: good.Cert, Key: good.Key}, []string{"no CA file", TLSFlags}},
		{"no key given", TLSFiles{CA: good.CA, Cert: good.Cert}, []string{"no key file"}},
		{"CA missing", TLSFiles{CA: missing, Cert: good.Cert, Key: good.Key}, []string{missing, "no such file"}},
		{"CA not PEM", TLSFiles{CA: noCert, Cert: good.Cert, Key: good.Key}, []string{noCert, "no PEM CERTIFICATE"}},
		{"cert missing", TLSFiles{CA: good.CA, Cert: missing, Key: good.Key}, []string{missing}},
		{"key of another certificate", TLSFiles{CA: good.CA, Cert: good.Cert, Key: other.Key}, []string{good.Cert, other.Key}},
		{"cert of another CA", TLSFiles{CA: good.CA, Cert: other.Cert, Key: other.Key}, []string{other.Cert, "CN=node-x", good.CA, "unknown authority"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for side, build := range map[string]func(TLSFiles) (*tls.Config, error){
				"server": ServerTLS,
				"client": func(f TLSFiles) (*tls.Config, error) { return ClientTLS(f, "node-a.berth.test") },
			} {
				cfg, err := build(tc.files)
				if tc.want == nil {
					if err != nil {
						t.Fatalf("%s: %v", side, err)
					}
					if cfg.MinVersion != tls.VersionTLS13 || len(cfg.Certificates) != 1 {
						t.Errorf("%s: MinVersion %x, %d certificates", side, cfg.MinVersion, len(cfg.Certificates))
					}
					continue
				}
				if !errors.Is(err, ErrBadTLSFile) {
					t.Fatalf("%s: got %v, want ErrBadTLSFile", side, err)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: error %q does not name %q", side, err, w)
					}
				}
			}
		})
	}
	srv := serverTLS(t, good)
	if srv.ClientAuth != tls.RequireAndVerifyClientCert || srv.ClientCAs == nil {
		t.Errorf("server config does not require and verify client certificates: %v", srv.ClientAuth)
	}
	if cli, _ := ClientTLS(good, "node-b"); cli.ServerName != "node-b" || cli.RootCAs == nil {
		t.Errorf("client config: server name %q, roots %v", cli.ServerName, cli.RootCAs)
	}
}

func TestCheckListen(t *testing.T) {
	cases := []struct {
		addr    string
		withTLS bool
		ok      bool
	}{
		{"127.0.0.1:7650", false, true},
		{"127.3.2.1:7650", false, true},
		{"[::1]:7650", false, true},
		{"localhost:7650", false, true},
		{"LOCALHOST:0", false, true},
		{":7650", false, false},
		{"0.0.0.0:7650", false, false},
		{"[::]:7650", false, false},
		{"10.1.2.3:7650", false, false},
		{"node-a:7650", false, false},
		{":7650", true, true},
		{"10.1.2.3:7650", true, true},
	}
	for _, tc := range cases {
		err := CheckListen(tc.addr, tc.withTLS)
		if tc.ok != (err == nil) {
			t.Errorf("CheckListen(%q, tls %v): %v", tc.addr, tc.withTLS, err)
			continue
		}
		if !tc.ok && (!errors.Is(err, ErrInsecure) || !strings.Contains(err.Error(), tc.addr) || !strings.Contains(err.Error(), "--tls-cert")) {
			t.Errorf("CheckListen(%q): %v; want ErrInsecure naming the address and the flags", tc.addr, err)
		}
	}
	if err := CheckListen("no-port", true); err == nil || errors.Is(err, ErrInsecure) {
		t.Errorf("address without port: %v", err)
	}

	// Listen: the same rule, and a TLS configuration must verify clients.
	if _, err := Listen("0.0.0.0:0", nil); !errors.Is(err, ErrInsecure) {
		t.Errorf("Listen on all interfaces without TLS: %v", err)
	}
	f := newTestCA(t, "ca").node(t, "node-a")
	weak := serverTLS(t, f)
	weak.ClientAuth = tls.RequestClientCert
	if _, err := Listen("127.0.0.1:0", weak); !errors.Is(err, ErrInsecure) {
		t.Errorf("Listen with a TLS config that does not verify clients: %v", err)
	}
	// Dial: plain TCP only to loopback; refused before any packet is sent (192.0.2.0/24 is
	// TEST-NET-1: nothing answers there).
	if _, err := Dial(context.Background(), "192.0.2.1:7650", nil); !errors.Is(err, ErrInsecure) || !strings.Contains(err.Error(), "192.0.2.1:7650") {
		t.Errorf("Dial to a remote address without TLS: %v", err)
	}
}

// TestMutualTLS moves a checkpoint over mutual TLS and checks what each side learns of the other.
func TestMutualTLS(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 1<<20)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")

	cases := []struct {
		name    string
		allowed []string
		wantErr error // of the sender; the receiver's is ErrPeerNotAllowed
	}{
		{"any certificate of the CA", nil, nil},
		{"allowed by DNS name", []string{"node-c.berth.test", "node-b.berth.test"}, nil},
		{"allowed by common name", []string{"node-b"}, nil},
		{"not allowed", []string{"node-c", "node-c.berth.test"}, ErrRefused},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			addr, out := serve(t, &Receiver{Root: root, NoSync: true, AllowedPeers: tc.allowed}, serverTLS(t, recvFiles))
			conn, err := Dial(context.Background(), addr, clientTLS(t, sendFiles))
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), "not among this receiver's allowed peers") {
					t.Fatalf("Dial: %v, want %v", err, tc.wantErr)
				}
				if d := next(t, out); !errors.Is(d.err, ErrPeerNotAllowed) || !strings.Contains(d.err.Error(), "CN=node-b") {
					t.Errorf("receiver: %v, want ErrPeerNotAllowed naming the certificate", d.err)
				}
				assertRootClean(t, root)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			st := conn.Conn.(*tls.Conn).ConnectionState()
			if st.Version != tls.VersionTLS13 || st.PeerCertificates[0].Subject.CommonName != "node-a" {
				t.Errorf("TLS version %x, receiver certificate %v", st.Version, st.PeerCertificates[0].Subject)
			}
			res, err := Send(context.Background(), conn, src, "over-tls", nil)
			if err != nil {
				t.Fatal(err)
			}
			d := next(t, out)
			if d.err != nil || d.path != res.Path {
				t.Fatalf("receiver: %+v", d)
			}
			sameTree(t, src, res.Path)
			p, ok := d.peer.(Peer)
			if !ok || !strings.Contains(p.Subject, "CN=node-b") || !slices.Contains(p.Names, "node-b.berth.test") || !slices.Contains(p.Names, "127.0.0.1") {
				t.Errorf("OnDone peer %#v: want the sender's verified identity", d.peer)
			}
			if s := d.peer.String(); !strings.Contains(s, "127.0.0.1:") || !strings.Contains(s, "CN=node-b") {
				t.Errorf("peer prints as %q", s)
			}
		})
	}
}

// TestTLSRefusals: every mismatch between the ends fails fast, says why, and leaves the
// receiver's single slot free for the next sender.
func TestTLSRefusals(t *testing.T) {
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)
	ca := newTestCA(t, "cluster-ca")
	recvFiles, sendFiles := ca.node(t, "node-a"), ca.node(t, "node-b")
	otherCA := newTestCA(t, "other-ca")
	stranger := otherCA.node(t, "node-x")
	serverOnly := ca.node(t, "node-s", x509.ExtKeyUsageServerAuth)

	tls12 := clientTLS(t, sendFiles)
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	// a sender that trusts the right CA for the receiver but presents another CA's certificate
	strangerCfg := clientTLS(t, stranger)
	strangerCfg.RootCAs = clientTLS(t, sendFiles).RootCAs
	serverOnlyCfg := clientTLS(t, serverOnly)
	// a sender whose CA is not the receiver's
	wrongRoots := clientTLS(t, sendFiles)
	wrongRoots.RootCAs = clientTLS(t, stranger).RootCAs

	cases := []struct {
		name       string
		serverTLS  bool
		client     *tls.Config
		wantSend   error  // nil: any error
		sendText   string // in the sender's error
		recvText   string // in the receiver's error
		recvDeadln bool   // the receiver's error is ErrDeadline
	}{
		{name: "plain sender, TLS receiver", serverTLS: true, client: nil, wantSend: ErrRefused, sendText: "requires mutual TLS", recvDeadln: true},
		{name: "TLS sender, plain receiver", serverTLS: false, client: clientTLS(t, sendFiles), wantSend: ErrProtocol, sendText: "runs without TLS", recvText: "started a TLS handshake"},
		{name: "client certificate of another CA", serverTLS: true, client: strangerCfg, wantSend: ErrRefused, sendText: "certificate", recvText: "certificate"},
		{name: "client certificate without client auth usage", serverTLS: true, client: serverOnlyCfg, wantSend: ErrRefused, sendText: "certificate", recvText: "incompatible key usage"},
		{name: "receiver certificate of another CA", serverTLS: true, client: wrongRoots, sendText: "unknown authority", recvText: "TLS handshake"},
		{name: "TLS 1.2", serverTLS: true, client: tls12, sendText: "protocol version", recvText: "TLS handshake"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			var srv *tls.Config
			if tc.serverTLS {
				srv = serverTLS(t, recvFiles)
			}
			r := &Receiver{Root: root, NoSync: true, MaxConns: 1, HandshakeTimeout: 300 * time.Millisecond, HeaderTimeout: 5 * time.Second}
			addr, out := serve(t, r, srv)
			_, err := sendTo(t, addr, tc.client, src, "refused")
			if err == nil || (tc.wantSend != nil && !errors.Is(err, tc.wantSend)) || !strings.Contains(err.Error(), tc.sendText) || !strings.Contains(err.Error(), addr) {
				t.Fatalf("sender: %v; want %v containing %q and the address", err, tc.wantSend, tc.sendText)
			}
			t.Log("sender:", err)
			d := next(t, out)
			if d.err == nil || !strings.Contains(d.err.Error(), tc.recvText) || (tc.recvDeadln && !errors.Is(d.err, ErrDeadline)) {
				t.Errorf("receiver: %v; want an error containing %q", d.err, tc.recvText)
			}
			t.Log("receiver:", d.err)
			assertRootClean(t, root)

			// the slot is free again: a matching sender gets through at once
			var good *tls.Config
			if tc.serverTLS {
				good = clientTLS(t, sendFiles)
			}
			if _, err := sendTo(t, addr, good, src, "after"); err != nil {
				t.Fatalf("next sender: %v", err)
			}
			if d := next(t, out); d.err != nil {
				t.Fatalf("receiver, next sender: %v", d.err)
			}
		})
	}
}

// countingConn is a net.Conn that records its writes.
type countingConn struct {
	net.Conn
	writes int
	data   bytes.Buffer
	err    error
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes++
	if c.err != nil {
		return 0, c.err
	}
	return c.data.Write(p)
}

// TestCoalescer: while a stream is sent, TLS records (16 KiB writes) reach the socket in writes
// of up to coalesceBytes, in order, all of them once the stream's flush ran; otherwise each
// write goes through at once; a failed write is the flush's error.
func TestCoalescer(t *testing.T) {
	under := &countingConn{}
	c := &coalescer{Conn: under}
	if _, err := c.Write([]byte("hello")); err != nil || under.writes != 1 {
		t.Fatalf("before the stream: %d writes, %v; want 1 write through", under.writes, err)
	}
	tc := tls.Client(c, &tls.Config{})
	done := coalesceWrites(Greeted{tc})
	var want bytes.Buffer
	want.WriteString("hello")
	record := make([]byte, 16<<10)
	for i := range 64 {
		record[0] = byte(i)
		want.Write(record)
		if _, err := c.Write(record); err != nil {
			t.Fatal(err)
		}
	}
	if err := done(); err != nil {
		t.Fatal(err)
	}
	if got, most := under.writes-1, 64*len(record)/coalesceBytes; got > most {
		t.Errorf("64 records of 16 KiB took %d writes, want at most %d", got, most)
	}
	if !bytes.Equal(under.data.Bytes(), want.Bytes()) {
		t.Error("the bytes written differ from those given, or are out of order")
	}
	before := under.writes
	if _, err := c.Write([]byte("after")); err != nil || under.writes != before+1 {
		t.Errorf("after the stream: %d writes, %v; want 1 more, through", under.writes-before, err)
	}

	under.err = errors.New("connection reset")
	done = coalesceWrites(Greeted{tc})
	if _, err := c.Write(record); err != nil {
		t.Fatalf("a gathered write failed at once: %v", err)
	}
	if err := done(); !errors.Is(err, under.err) {
		t.Errorf("flush: got %v, want %v", err, under.err)
	}
	if done := coalesceWrites(&countingConn{}); done() != nil {
		t.Error("a connection without TLS: flush failed")
	}
}
