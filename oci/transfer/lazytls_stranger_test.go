package transfer

import (
	"crypto/tls"
	"net"
	"strings"
	"testing"
	"time"
)

// TestLazyServerTLSStrangerHandshakes: a stranger that speaks TLS itself (not garbage) and
// skips the server's verification is still refused by CRIU: without a client certificate, with
// a self-signed one, or with one another dump's CA issued for 127.0.0.1 (as the relay's is).
// CRIU must verify the client's certificate against this dump's CA, not only ask for one.
func TestLazyServerTLSStrangerHandshakes(t *testing.T) {
	_, otherConf, err := newLazyTLS(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		certs []tls.Certificate
		max   uint16
	}{
		{"no client certificate", nil, tls.VersionTLS13},
		{"another dump's client certificate", otherConf.Certificates, tls.VersionTLS13},
		{"another dump's client certificate, TLS 1.2", otherConf.Certificates, tls.VersionTLS12},
	} {
		t.Run(tc.name, func(t *testing.T) {
			files, _, err := newLazyTLS(time.Now())
			if err != nil {
				t.Fatal(err)
			}
			addr, wait := criuTLSPageServer(t, files)
			conf := &tls.Config{InsecureSkipVerify: true, Certificates: tc.certs, MaxVersion: tc.max}
			c, err := dialWhenUp(t, func() (*tls.Conn, error) {
				return tls.DialWithDialer(&net.Dialer{Timeout: time.Second}, "tcp", addr, conf)
			})
			if err == nil {
				// TLS 1.3: the client's handshake ends before the server checked its certificate;
				// CRIU's refusal arrives on the first read
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				_, _ = c.Write(make([]byte, 32))
				var b [64]byte
				n, rerr := c.Read(b[:])
				c.Close()
				if n > 0 {
					t.Errorf("CRIU answered a stranger's TLS session with %d bytes", n)
				}
				t.Logf("stranger's read: %v", rerr)
			} else {
				t.Logf("stranger's handshake: %v", err)
			}
			log, werr := wait()
			// CRIU logs "TLS handshake completed" before it verifies the client's certificate: what
			// shows a session served is page-xfer's start, what shows the refusal is tls's error
			if strings.Contains(log, "page-xfer:") || !strings.Contains(log, "Error (criu/tls.c") {
				t.Errorf("CRIU did not refuse a stranger's TLS session:\n%s", tail(log, 10))
			}
			if werr == nil {
				t.Errorf("CRIU's page server exited successfully after a stranger's session:\n%s", tail(log, 10))
			}
			t.Logf("CRIU: %s", tail(log, 4))
		})
	}
}
