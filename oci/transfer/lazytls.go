package transfer

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"syscall"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// lazyTLSLifetime is how long the certificates of one lazy dump are valid: CRIU checks them
// when the relay connects, seconds after they were made; the rest is slack for a slow send of
// the non-memory images.
const lazyTLSLifetime = 24 * time.Hour

// newLazyTLS makes the TLS identities of one lazy dump: a CA of its own (ECDSA P-256, its key
// dropped once it signed), the certificate and key of CRIU's lazy page server (written to
// checkpoint.LazyTLSDir by the caller), and the relay's client configuration (TLS 1.3, its
// certificate, the server verified against that CA alone). Both certificates are for the IP
// address 127.0.0.1: CRIU verifies its client's against the address it listens on.
func newLazyTLS(now time.Time) (checkpoint.LazyTLS, *tls.Config, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	serial := func() (*big.Int, error) { return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127)) }
	sn, err := serial()
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber: sn, Subject: pkix.Name{CommonName: "berth lazy page server CA"},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(lazyTLSLifetime),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	leaf := func(cn string, usage x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey, error) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, nil, err
		}
		sn, err := serial()
		if err != nil {
			return nil, nil, err
		}
		der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
			SerialNumber: sn, Subject: pkix.Name{CommonName: cn},
			NotBefore: now.Add(-time.Minute), NotAfter: now.Add(lazyTLSLifetime),
			IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
			KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}, ca, &k.PublicKey, caKey)
		return der, k, err
	}
	srvDER, srvKey, err := leaf("berth lazy page server", x509.ExtKeyUsageServerAuth)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	cliDER, cliKey, err := leaf("berth lazy page relay", x509.ExtKeyUsageClientAuth)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(srvKey)
	if err != nil {
		return checkpoint.LazyTLS{}, nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	files := checkpoint.LazyTLS{
		CA:   pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srvDER}),
		Key:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}
	conf := &tls.Config{
		MinVersion: tls.VersionTLS13, RootCAs: pool, ServerName: "127.0.0.1",
		Certificates: []tls.Certificate{{Certificate: [][]byte{cliDER}, PrivateKey: cliKey}},
	}
	return files, conf, nil
}

// dialLazyServer connects to CRIU's lazy page server at addr (on 127.0.0.1) as its one client:
// the socket must be root's (rootPeer: the shim's CRIU), and the TLS handshake must show the
// server certificate of this dump's CA and present conf's client certificate. It returns the
// TLS connection. Errors name the address and the step (dial, owner, handshake), each wrapping
// ErrPageStream.
func dialLazyServer(addr string, conf *tls.Config, timeout time.Duration) (*tls.Conn, error) {
	raw, err := net.DialTimeout("tcp", addr, timeout)
	if errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("%w: CRIU's lazy page server at %s no longer listens: it serves one connection, so another local process connected first (it was served no page), or CRIU's dump ended (the source's containerd log, from berth's shim, says which): %w",
			ErrPageStream, addr, err)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: CRIU's lazy page server at %s: %w", ErrPageStream, addr, err)
	}
	if !rootPeer(raw) {
		raw.Close()
		return nil, fmt.Errorf("%w: the socket at %s is not root's (not the shim's CRIU)", ErrPageStream, addr)
	}
	c := tls.Client(raw, conf)
	_ = c.SetDeadline(time.Now().Add(timeout))
	if err := c.Handshake(); err != nil {
		raw.Close()
		return nil, fmt.Errorf("%w: CRIU's lazy page server at %s: TLS handshake (the server must show the certificate made for this dump): %w",
			ErrPageStream, addr, err)
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}
