package signature

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// TrustConfig is the trust section of a node's configuration (the shim's TOML; berthctl reads the
// same keys): the key this node signs with, the keys whose checkpoints it restores, and the opt-out.
type TrustConfig struct {
	// SigningKey is this node's private key (PEM, absolute path, mode 0600): every checkpoint
	// berth writes on the node is signed with it. "" signs nothing (checkpoints are then refused
	// by every node that does not opt out).
	SigningKey string `toml:"signing_key"`
	// TrustedKeys are the public keys whose signatures restore here.
	TrustedKeys []TrustedKey `toml:"trusted_keys"`
	// AllowUnsigned restores unsigned checkpoints and checkpoints signed by unknown keys, with a
	// warning on every restore. For single-node labs only: whoever can place a checkpoint where a
	// restore reads it then runs any code as any user the images name, up to the spec's limits.
	AllowUnsigned bool `toml:"allow_unsigned"`
}

// TrustedKey is one public key of TrustConfig.TrustedKeys.
type TrustedKey struct {
	// Path is the public key file (PEM, PKIX "PUBLIC KEY"; absolute).
	Path string `toml:"path"`
	// Namespaces limits the key to checkpoints restored into these Kubernetes namespaces; empty
	// trusts it for every namespace and for containers outside Kubernetes.
	Namespaces []string `toml:"namespaces"`
}

// Validate checks paths are absolute. It does not read the files (LoadPolicy does).
func (c TrustConfig) Validate() error {
	if c.SigningKey != "" && !filepath.IsAbs(c.SigningKey) {
		return fmt.Errorf("signing_key %q: must be an absolute path", c.SigningKey)
	}
	for i, k := range c.TrustedKeys {
		if !filepath.IsAbs(k.Path) {
			return fmt.Errorf("trusted_keys[%d].path %q: must be an absolute path", i, k.Path)
		}
	}
	return nil
}

// Policy is a loaded TrustConfig: the signer and the trusted public keys.
type Policy struct {
	// Signer signs new checkpoints; nil when no signing_key is configured.
	Signer *Key
	// AllowUnsigned is TrustConfig.AllowUnsigned.
	AllowUnsigned bool
	trusted       []trusted
}

type trusted struct {
	key        *Key
	namespaces []string
}

// LoadPolicy reads the keys c names. Errors name the file (ErrBadKey). The signing key's own
// public key is trusted for every namespace when no trusted key has the same id, so a node always
// restores its own checkpoints.
func LoadPolicy(c TrustConfig) (*Policy, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	p := &Policy{AllowUnsigned: c.AllowUnsigned}
	for _, tk := range c.TrustedKeys {
		k, err := LoadKey(tk.Path)
		if err != nil {
			return nil, err
		}
		p.trusted = append(p.trusted, trusted{key: k, namespaces: tk.Namespaces})
	}
	if c.SigningKey != "" {
		k, err := LoadKey(c.SigningKey)
		if err != nil {
			return nil, err
		}
		if !k.Private() {
			return nil, fmt.Errorf("signing_key %s is a public key: %w", c.SigningKey, ErrBadKey)
		}
		p.Signer = k
		if !slices.ContainsFunc(p.trusted, func(t trusted) bool { return t.key.ID == k.ID }) {
			p.trusted = append(p.trusted, trusted{key: k})
		}
	}
	return p, nil
}

// keysFor returns the keys trusted for checkpoints restored into Kubernetes namespace ns ("" for
// a container outside Kubernetes: only keys without a namespace list).
func (p *Policy) keysFor(ns string) []*Key {
	var out []*Key
	for _, t := range p.trusted {
		if len(t.namespaces) == 0 || (ns != "" && slices.Contains(t.namespaces, ns)) {
			out = append(out, t.key)
		}
	}
	return out
}

// TrustedFor reports whether the key with id keyID is trusted for checkpoints of Kubernetes
// namespace ns ("" outside Kubernetes: only keys without a namespace list), as keysFor decides.
// A restore asks it for the namespace its signed manifest records, beside the destination's
// that Verify chose the keys for: a key trusted only for "staging" signs for "staging" alone,
// whatever a spec or a mapping says of the destination.
func (p *Policy) TrustedFor(keyID, ns string) bool {
	return slices.ContainsFunc(p.keysFor(ns), func(k *Key) bool { return k.ID == keyID })
}

// Verified is the outcome of Policy.Verify.
type Verified struct {
	// Manifest is the exact signed berth.json; nil when the checkpoint restores unverified under
	// allow_unsigned.
	Manifest []byte
	// KeyID is the key that signed it; "" when unsigned.
	KeyID string
	// Warning is set when the checkpoint passes only because of allow_unsigned: the reason it
	// would otherwise be refused. Callers log it on every restore.
	Warning error
}

// Verify checks dir's berth.sig against the keys trusted for Kubernetes namespace ns and that it
// signs the berth.json beside it byte for byte. It returns the signed manifest bytes and the key
// id. Refusals wrap ErrUnsigned, ErrUntrustedKey (naming the key ids the signature claims and,
// when a key signed it that is trusted only for other namespaces, saying so) or ErrBadSignature.
// Under AllowUnsigned a refusal becomes Verified.Warning instead, except ErrBadSignature for
// a signature that a trusted key made over other bytes (tampering is never allowed).
func (p *Policy) Verify(ctx context.Context, dir, ns string) (Verified, error) {
	v, err := p.verify(ctx, dir, ns)
	if err != nil && p.AllowUnsigned && (errors.Is(err, ErrUnsigned) || errors.Is(err, ErrUntrustedKey)) {
		return Verified{Warning: err}, nil
	}
	return v, err
}

// VerifyAnyNamespace is Verify with every trusted key, whatever namespaces it is trusted for:
// whether some key this node trusts signed dir's berth.json byte for byte. A receiver asks it
// as soon as berth.json and berth.sig arrive, before the rest of a checkpoint (Verify, with the
// namespace, judges the whole). Refusals and allow_unsigned are Verify's.
func (p *Policy) VerifyAnyNamespace(ctx context.Context, dir string) (Verified, error) {
	v, err := p.verifyWith(ctx, dir, "", p.allKeys())
	if err != nil && p.AllowUnsigned && (errors.Is(err, ErrUnsigned) || errors.Is(err, ErrUntrustedKey)) {
		return Verified{Warning: err}, nil
	}
	return v, err
}

func (p *Policy) verify(ctx context.Context, dir, ns string) (Verified, error) {
	return p.verifyWith(ctx, dir, ns, p.keysFor(ns))
}

func (p *Policy) verifyWith(ctx context.Context, dir, ns string, keys []*Key) (Verified, error) {
	env, err := ReadEnvelope(dir)
	if err != nil {
		return Verified{}, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	payload, id, err := env.Verify(ctx, keys)
	if err != nil {
		if errors.Is(err, ErrUntrustedKey) {
			if _, other, oerr := env.Verify(ctx, p.allKeys()); oerr == nil {
				return Verified{}, fmt.Errorf("checkpoint %s: signed by %s, which is not trusted for namespace %q: %w", dir, other, ns, ErrUntrustedKey)
			}
		}
		return Verified{}, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	onDisk, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return Verified{}, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	if !bytes.Equal(onDisk, payload) {
		return Verified{}, fmt.Errorf("checkpoint %s: %s differs from the manifest %s signed: %w", dir, ManifestFile, id, ErrBadSignature)
	}
	return Verified{Manifest: payload, KeyID: id}, nil
}

func (p *Policy) allKeys() []*Key {
	var out []*Key
	for _, t := range p.trusted {
		out = append(out, t.key)
	}
	return out
}

// Sign signs dir/berth.json with the policy's signing key (SignDir). Without a signing key it
// does nothing and returns "": the checkpoint stays unsigned.
func (p *Policy) Sign(ctx context.Context, dir string) (string, error) {
	if p == nil || p.Signer == nil {
		return "", nil
	}
	if err := SignDir(ctx, dir, p.Signer); err != nil {
		return "", err
	}
	return p.Signer.ID, nil
}

func publicPEM(pub crypto.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}
