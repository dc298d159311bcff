// Package keys writes the key material of berth's trust model for tests and the demo: a node's
// checkpoint signing key pair (package oci/signature) and a cluster CA that issues each node's
// transfer certificate (package oci/transfer), as an operator would create them with openssl or
// cert-manager. Keys are ECDSA P-256 from the standard library.
//
// What belongs here: generating and writing such files. What does not: reading or using them
// (oci/signature, oci/transfer).
package keys

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/berth-dev/berth/oci/transfer"
)

// SigningKey writes a new signing key pair into dir: name.key (PKCS#8 "PRIVATE KEY", mode 0600)
// and name.pub (PKIX "PUBLIC KEY", mode 0644), and returns their absolute paths.
func SigningKey(dir, name string) (priv, pub string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return "", "", err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	if dir, err = filepath.Abs(dir); err != nil {
		return "", "", err
	}
	priv, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
	if err := writePEM(priv, "PRIVATE KEY", der, 0o600); err != nil {
		return "", "", err
	}
	if err := writePEM(pub, "PUBLIC KEY", pubDER, 0o644); err != nil {
		return "", "", err
	}
	return priv, pub, nil
}

// CA is a cluster CA for transfer certificates, its files under Dir (ca.crt).
type CA struct {
	Dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// NewCA creates a CA named name (its common name) with its certificate in dir/ca.crt. Its
// certificates are valid from an hour ago for a day.
func NewCA(dir, name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	if dir, err = filepath.Abs(dir); err != nil {
		return nil, err
	}
	if err := writePEM(filepath.Join(dir, "ca.crt"), "CERTIFICATE", der, 0o644); err != nil {
		return nil, err
	}
	return &CA{Dir: dir, cert: cert, key: key}, nil
}

// Node issues the certificate of node name, as cert-manager would for a berth node: common name
// name, DNS names localhost and name, IP address 127.0.0.1, key usages server and client auth.
// It writes Dir/name/tls.crt and tls.key (mode 0600) and returns the three files.
func (ca *CA) Node(name string) (transfer.TLSFiles, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return transfer.TLSFiles{}, err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return transfer.TLSFiles{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name, Organization: []string{"berth"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"localhost", name},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return transfer.TLSFiles{}, err
	}
	pkcs8, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return transfer.TLSFiles{}, err
	}
	dir := filepath.Join(ca.Dir, name)
	f := transfer.TLSFiles{CA: filepath.Join(ca.Dir, "ca.crt"), Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key")}
	if err := writePEM(f.Cert, "CERTIFICATE", der, 0o600); err != nil {
		return transfer.TLSFiles{}, err
	}
	if err := writePEM(f.Key, "PRIVATE KEY", pkcs8, 0o600); err != nil {
		return transfer.TLSFiles{}, err
	}
	return f, nil
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return os.Chmod(path, mode) // WriteFile keeps the mode of a file that existed
}
