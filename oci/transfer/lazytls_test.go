package transfer

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// TestLazyTLSIdentities: the server's files are a key pair issued by the dump's CA for
// 127.0.0.1, and the relay's client certificate verifies against that CA as a client's; another
// dump's CA verifies neither.
func TestLazyTLSIdentities(t *testing.T) {
	files, conf, err := newLazyTLS(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(files.Cert, files.Key)
	if err != nil {
		t.Fatalf("server certificate and key: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(files.CA) {
		t.Fatal("CA: no certificate")
	}
	srv, _ := x509.ParseCertificate(pair.Certificate[0])
	if _, err := srv.Verify(x509.VerifyOptions{Roots: pool, DNSName: "127.0.0.1"}); err != nil {
		t.Errorf("server certificate: %v", err)
	}
	cli, _ := x509.ParseCertificate(conf.Certificates[0].Certificate[0])
	if _, err := cli.Verify(x509.VerifyOptions{Roots: pool, DNSName: "127.0.0.1", KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("client certificate: %v", err)
	}
	other, _, err := newLazyTLS(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	opool := x509.NewCertPool()
	opool.AppendCertsFromPEM(other.CA)
	if _, err := cli.Verify(x509.VerifyOptions{Roots: opool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("the client certificate verifies against another dump's CA")
	}
}

// criuTLSPageServer runs the real `criu page-server` with the TLS identity files (as the shim
// configures CRIU's lazy page server) on a free 127.0.0.1 port, and returns its address and a
// function that waits for it to exit and returns its log and exit error.
func criuTLSPageServer(t *testing.T, files checkpoint.LazyTLS) (string, func() (string, error)) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("CRIU's page server must be root's (the relay serves only a root socket): run as root (make test does)")
	}
	criu := lazyCRIU(t)
	work := filepath.Join(t.TempDir(), "ck")
	if err := os.Mkdir(work, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.WriteLazyTLS(work, files); err != nil {
		t.Fatal(err)
	}
	d := checkpoint.LazyTLSDir(work)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	_, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command(criu, "page-server", "--tls",
		"--tls-cacert", filepath.Join(d, checkpoint.LazyTLSCA), "--tls-cert", filepath.Join(d, checkpoint.LazyTLSCert),
		"--tls-key", filepath.Join(d, checkpoint.LazyTLSKey), "--address", "127.0.0.1", "--port", port,
		"-D", work, "-o", "ps.log", "-v4")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-waited
	})
	return addr, func() (string, error) {
		select {
		case err := <-waited:
			waited <- err
			b, _ := os.ReadFile(filepath.Join(work, "ps.log"))
			return string(b), err
		case <-time.After(10 * time.Second):
			t.Fatal("criu page-server did not exit 10s after its client left")
			return "", nil
		}
	}
}

// dialWhenUp calls dial until the server listens (connection refused before that), for 10s.
func dialWhenUp[C any](t *testing.T, dial func() (C, error)) (C, error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := dial()
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) || time.Now().After(deadline) {
			return c, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLazyServerTLSWithCRIU: CRIU's own page server (GnuTLS) with the identity a LazyRelay makes
// completes the handshake with the relay's client and with nobody else: a stranger that connects
// first is served nothing (no page-server answer, only TLS's refusal, and CRIU gives up), and a
// relay of another dump refuses a server that shows this dump's certificate.
func TestLazyServerTLSWithCRIU(t *testing.T) {
	t.Run("the relay", func(t *testing.T) {
		files, conf, err := newLazyTLS(time.Now())
		if err != nil {
			t.Fatal(err)
		}
		addr, wait := criuTLSPageServer(t, files)
		c, err := dialWhenUp(t, func() (*tls.Conn, error) { return dialLazyServer(addr, conf, 5*time.Second) })
		if err != nil {
			t.Fatalf("the relay's handshake with CRIU: %v", err)
		}
		if v := c.ConnectionState().Version; v != tls.VersionTLS13 {
			t.Errorf("TLS version %#x, want 1.3", v)
		}
		c.Close()
		log, _ := wait()
		// CRIU logs "TLS handshake completed" before it verifies the client's certificate (a
		// refused one then logs tls's error): the session is served once page-xfer starts
		if !strings.Contains(log, "TLS handshake completed") || strings.Contains(log, "Error (criu/tls.c") || !strings.Contains(log, "page-xfer: Created xfer pipe") {
			t.Errorf("CRIU's log does not show the relay verified and served:\n%s", tail(log, 10))
		}
	})
	t.Run("a stranger first", func(t *testing.T) {
		files, conf, err := newLazyTLS(time.Now())
		if err != nil {
			t.Fatal(err)
		}
		addr, wait := criuTLSPageServer(t, files)
		c, err := dialWhenUp(t, func() (net.Conn, error) { return net.DialTimeout("tcp", addr, time.Second) })
		if err != nil {
			t.Fatal(err)
		}
		// a page-server request as CRIU's lazy-pages daemon sends it: PS_IOV_GET of one page of
		// pid 1 (struct page_server_iov: u32 cmd, 4 bytes of padding, u64 nr_pages, vaddr, and
		// dst_id, for a GET the pid as it is)
		req := make([]byte, 32)
		binary.LittleEndian.PutUint32(req[0:], 7)
		binary.LittleEndian.PutUint64(req[8:], 1)
		binary.LittleEndian.PutUint64(req[16:], 0x400000)
		binary.LittleEndian.PutUint64(req[24:], 1)
		_, _ = c.Write(req)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var got bytes.Buffer
		_, _ = got.ReadFrom(c)
		c.Close()
		if got.Len() > 0 && got.Bytes()[0] != 0x15 { // a TLS alert record, if anything
			t.Errorf("CRIU answered a stranger's page request with %d bytes (first %#x), not a TLS alert", got.Len(), got.Bytes()[0])
		}
		log, err := wait()
		if err == nil {
			t.Errorf("CRIU's page server exited successfully after a stranger's connection:\n%s", tail(log, 10))
		}
		if strings.Contains(log, "TLS handshake completed") {
			t.Errorf("CRIU completed a handshake with a stranger:\n%s", tail(log, 10))
		}
		if _, err := dialLazyServer(addr, conf, time.Second); err == nil || !errors.Is(err, ErrPageStream) {
			t.Errorf("the relay after the stranger: %v; want a refused connection (CRIU serves one client)", err)
		}
	})
	t.Run("another dump's relay", func(t *testing.T) {
		files, _, err := newLazyTLS(time.Now())
		if err != nil {
			t.Fatal(err)
		}
		_, otherConf, err := newLazyTLS(time.Now())
		if err != nil {
			t.Fatal(err)
		}
		addr, wait := criuTLSPageServer(t, files)
		_, err = dialWhenUp(t, func() (*tls.Conn, error) { return dialLazyServer(addr, otherConf, 5*time.Second) })
		if err == nil || !strings.Contains(err.Error(), "TLS handshake") || !strings.Contains(err.Error(), addr) {
			t.Fatalf("a relay of another dump: %v; want a failed TLS handshake naming %s", err, addr)
		}
		if log, err := wait(); err == nil {
			t.Errorf("CRIU's page server exited successfully after a failed handshake:\n%s", tail(log, 10))
		}
	})
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}
