package node

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-dev/berth/oci/signature"
)

// Every node has a key of its own: SigningKey (PEM PKCS#8, ECDSA P-256, mode 0600) and its
// public key PublicKey, generated when the node starts, under its directory. The node's shim
// signs every checkpoint with it (signing_key in shim.toml), and a cluster's nodes trust each
// other's public keys (trusted_keys, written by StartClusterWith), as nodes of a real cluster
// would be configured.

// WriteKeyPair generates a key pair (ECDSA P-256) into priv (PKCS#8 PEM, 0600) and pub (PKIX PEM, 0644).
func WriteKeyPair(priv, pub string) error {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return err
	}
	pubDer, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		return err
	}
	if err := os.WriteFile(priv, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("node key: %w", err)
	}
	if err := os.WriteFile(pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDer}), 0o644); err != nil {
		return fmt.Errorf("node key: %w", err)
	}
	return nil
}

// Key returns the node's signing key (parsed; its ID is the key id errors and logs name).
func (n *Node) Key() (*signature.Key, error) { return signature.LoadKey(n.SigningKey) }

// Sign signs the checkpoint directory dir's berth.json with the node's key (berth.sig), as
// berth does for every checkpoint it writes on this node, and returns the key id.
func (n *Node) Sign(ctx context.Context, dir string) (string, error) {
	k, err := n.Key()
	if err != nil {
		return "", err
	}
	if err := signature.SignDir(ctx, dir, k); err != nil {
		return "", err
	}
	return k.ID, nil
}

// Trust is the part of a node's shim configuration that says whose checkpoints restore there.
type Trust struct {
	// Keys are trusted_keys (the node's own key is always trusted).
	Keys []signature.TrustedKey
	// AllowUnsigned is allow_unsigned.
	AllowUnsigned bool
}

// SetTrust replaces trusted_keys and allow_unsigned in the node's shim.toml (other keys, those
// AppendShimConfig added included, stay) and returns a function that puts the previous file back.
// Shims started afterwards read it.
func (n *Node) SetTrust(t Trust) (restore func() error, err error) {
	p := n.ShimConfig()
	old, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("shim config of %s: %w", n.Name, err)
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(string(old), "\n"), "\n") {
		if k, _, _ := strings.Cut(l, "="); strings.TrimSpace(k) == "trusted_keys" || strings.TrimSpace(k) == "allow_unsigned" {
			continue
		}
		lines = append(lines, l)
	}
	lines = append(lines, trustedKeysLine(t.Keys), fmt.Sprintf("allow_unsigned = %v", t.AllowUnsigned))
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		return nil, fmt.Errorf("shim config of %s: %w", n.Name, err)
	}
	return func() error { return os.WriteFile(p, old, 0o644) }, nil
}

// trustedKeysLine is keys as one TOML line (inline tables), so that keys appended after it stay
// top-level keys.
func trustedKeysLine(keys []signature.TrustedKey) string {
	var items []string
	for _, k := range keys {
		item := fmt.Sprintf("{path = %q", k.Path)
		if len(k.Namespaces) > 0 {
			var ns []string
			for _, x := range k.Namespaces {
				ns = append(ns, fmt.Sprintf("%q", x))
			}
			item += ", namespaces = [" + strings.Join(ns, ", ") + "]"
		}
		items = append(items, item+"}")
	}
	return "trusted_keys = [" + strings.Join(items, ", ") + "]"
}

// EnvShimConfig is the environment variable that names a shim configuration file; berthctl
// reads its trust keys (signing_key, trusted_keys) from the same file.
const EnvShimConfig = "BERTH_SHIM_CONFIG"

// writeBerthctlConfig gives the cluster an operator key of its own (dir/berthctl.key, .pub) and
// writes dir/berthctl.toml, the configuration berthctl runs with in the cluster's tests and demo
// (EnvShimConfig names it): it signs what berthctl writes (the top-level manifest of a move, a
// pushed CRI archive) with the operator key and trusts every node's key and its own, as an
// operator's berthctl would be set up. Every node trusts the operator key (TrustEachOther).
func (c *Cluster) writeBerthctlConfig(dir string) error {
	c.BerthctlKey, c.BerthctlPublicKey = filepath.Join(dir, "berthctl.key"), filepath.Join(dir, "berthctl.pub")
	if err := WriteKeyPair(c.BerthctlKey, c.BerthctlPublicKey); err != nil {
		return err
	}
	c.BerthctlConfig = filepath.Join(dir, "berthctl.toml")
	body := fmt.Sprintf("signing_key = %q\n%s\n", c.BerthctlKey, trustedKeysLine(c.Trusted().Keys))
	return os.WriteFile(c.BerthctlConfig, []byte(body), 0o644)
}

// TrustEachOther sets every node's trusted_keys to the public keys of all nodes of the cluster
// and of its operator key (Trusted), allow_unsigned off: signing is on, as on a real cluster.
func (c *Cluster) TrustEachOther() error {
	for _, n := range c.Nodes {
		if _, err := n.SetTrust(c.Trusted()); err != nil {
			return err
		}
	}
	return nil
}

// Trusted is the trust of the cluster's nodes (TrustEachOther's): every node's public key and the
// operator key, for every namespace.
func (c *Cluster) Trusted() Trust {
	var t Trust
	for _, n := range c.Nodes {
		t.Keys = append(t.Keys, signature.TrustedKey{Path: n.PublicKey})
	}
	if c.BerthctlPublicKey != "" {
		t.Keys = append(t.Keys, signature.TrustedKey{Path: c.BerthctlPublicKey})
	}
	return t
}
