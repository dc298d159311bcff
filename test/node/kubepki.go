package node

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// kubePKI is the cluster's certificate authority and the files signed by it, all under Dir:
// ca.crt, the API server's serving certificate (apiserver.crt/key), its client certificate for
// the kubelets (apiserver-kubelet-client.crt/key, group system:masters as kubeadm does), the
// service account signing key pair (sa.key, sa.pub) and the static token file (tokens.csv).
// Nothing here is meant to outlive a test cluster: keys are P-256, certificates last one day.
type kubePKI struct {
	Dir    string
	caCert *x509.Certificate
	caKey  *ecdsa.PrivateKey
	// AdminToken authenticates kubectl (user admin, group system:masters).
	AdminToken string
	// NodeTokens authenticate each kubelet as system:node:NAME (group system:nodes).
	NodeTokens map[string]string
}

func (p *kubePKI) path(name string) string { return filepath.Join(p.Dir, name) }

// newKubePKI creates the CA, the API server's certificates, the service account key and a token
// per node (nodes are the Kubernetes node names).
func newKubePKI(dir string, nodes []string) (*kubePKI, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	p := &kubePKI{Dir: dir, NodeTokens: map[string]string{}}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "berth-test-kubernetes-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("CA certificate: %w", err)
	}
	if p.caCert, err = x509.ParseCertificate(der); err != nil {
		return nil, err
	}
	p.caKey = key
	if err := writePEM(p.path("ca.crt"), "CERTIFICATE", der); err != nil {
		return nil, err
	}
	if err := p.sign("apiserver", pkix.Name{CommonName: "kube-apiserver"}, x509.ExtKeyUsageServerAuth,
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		[]net.IP{net.IPv4(127, 0, 0, 1), net.ParseIP(kubeServiceIP)}); err != nil {
		return nil, err
	}
	if err := p.sign("apiserver-kubelet-client", pkix.Name{CommonName: "kube-apiserver-kubelet-client", Organization: []string{"system:masters"}},
		x509.ExtKeyUsageClientAuth, nil, nil); err != nil {
		return nil, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	saDER, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return nil, err
	}
	saPub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(p.path("sa.key"), "EC PRIVATE KEY", saDER); err != nil {
		return nil, err
	}
	if err := writePEM(p.path("sa.pub"), "PUBLIC KEY", saPub); err != nil {
		return nil, err
	}
	if p.AdminToken, err = randomToken(); err != nil {
		return nil, err
	}
	csv := fmt.Sprintf("%s,admin,admin,system:masters\n", p.AdminToken)
	for _, n := range nodes {
		tok, err := randomToken()
		if err != nil {
			return nil, err
		}
		p.NodeTokens[n] = tok
		csv += fmt.Sprintf("%s,system:node:%s,node-%s,system:nodes\n", tok, n, n)
	}
	if err := os.WriteFile(p.path("tokens.csv"), []byte(csv), 0o600); err != nil {
		return nil, err
	}
	return p, nil
}

// sign writes NAME.crt and NAME.key, a certificate for subject signed by the CA.
func (p *kubePKI) sign(name string, subject pkix.Name, usage x509.ExtKeyUsage, dns []string, ips []net.IP) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      subject,
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, p.caKey)
	if err != nil {
		return fmt.Errorf("certificate %s: %w", name, err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(p.path(name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return writePEM(p.path(name+".key"), "EC PRIVATE KEY", kder)
}

// kubeconfig writes NAME.kubeconfig: the API server at server, verified against the CA, and token.
func (p *kubePKI) kubeconfig(name, server, token string) (string, error) {
	path := p.path(name + ".kubeconfig")
	body := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: berth-test
  cluster:
    server: %q
    certificate-authority: %q
users:
- name: %s
  user:
    token: %q
contexts:
- name: %s
  context: {cluster: berth-test, user: %s}
current-context: %s
`, server, p.path("ca.crt"), name, token, name, name, name)
	return path, os.WriteFile(path, []byte(body), 0o600)
}

func writePEM(path, typ string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

func randomToken() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}
