package signature

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// DefaultSigningKey is where a node keeps the key it signs its checkpoints with when its
// configuration names none: generated on first use (EnsureKey), trusted by the node itself, as a
// host trusts its own SSH host key.
const DefaultSigningKey = "/etc/berth/node.key"

// PublicKeyPath returns where EnsureKey writes the public key of the private key at priv: priv
// with its ".key" suffix replaced by ".pub" (or ".pub" appended).
func PublicKeyPath(priv string) string {
	return strings.TrimSuffix(priv, ".key") + ".pub"
}

// EnsureKey makes sure a private key exists at priv (an absolute path): when nothing is there,
// it generates an ECDSA P-256 key (PKCS#8 PEM, mode 0600; its directory is made 0755 if
// missing) and writes its public key beside it (PublicKeyPath, PKIX PEM, 0644), for the
// operator to distribute to the nodes that should restore this node's checkpoints. An existing
// file is left as it is (LoadKey checks it). Concurrent callers (every container's shim) agree:
// the key is created once, with O_EXCL, and a caller that loses the race uses the winner's.
// It reports whether it created the key.
func EnsureKey(priv string) (created bool, err error) {
	if !filepath.IsAbs(priv) {
		return false, fmt.Errorf("signing key %q: must be an absolute path", priv)
	}
	if _, err := os.Lstat(priv); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return false, fmt.Errorf("generate signing key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return false, err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		return false, err
	}
	if err := os.MkdirAll(filepath.Dir(priv), 0o755); err != nil {
		return false, fmt.Errorf("signing key %s: %w", priv, err)
	}
	// the public key is written to a temporary file first and renamed into place once the
	// private key exists, so that a public key on disk always belongs to the private key
	pub := PublicKeyPath(priv)
	tf, err := os.CreateTemp(filepath.Dir(pub), filepath.Base(pub)+".*.tmp")
	if err != nil {
		return false, fmt.Errorf("signing key %s: %w", priv, err)
	}
	tmp := tf.Name()
	_, werr := tf.Write(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}))
	if cerr := tf.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Chmod(tmp, 0o644)
	}
	if werr != nil {
		os.Remove(tmp)
		return false, fmt.Errorf("signing key %s: %w", priv, werr)
	}
	f, err := os.OpenFile(priv, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		os.Remove(tmp)
		return false, nil // another process made it meanwhile
	}
	if err != nil {
		os.Remove(tmp)
		return false, fmt.Errorf("signing key %s: %w", priv, err)
	}
	_, werr = f.Write(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}))
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(tmp, pub)
	}
	if werr != nil {
		os.Remove(priv)
		os.Remove(tmp)
		return false, fmt.Errorf("signing key %s: %w", priv, werr)
	}
	return true, nil
}
