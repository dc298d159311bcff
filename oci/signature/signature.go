// Package signature signs and verifies berth checkpoints. A checkpoint's manifest (berth.json)
// lists the size and sha256 of every file that decides a restore (CRIU images, spec and config
// dumps, rootfs diff); signing the manifest's exact bytes therefore covers every byte of the
// checkpoint. The signature is a DSSE envelope (Dead Simple Signing Envelope, the format of
// in-toto and Sigstore attestations; go-securesystemslib's dsse package) in the file berth.sig
// beside berth.json, with payload type PayloadType and the manifest as its payload.
//
// Keys are PEM files: a private key (PKCS#8, SEC 1 or PKCS#1) signs, a public key (PKIX)
// verifies; ECDSA, Ed25519 and RSA (PSS) are accepted, parsed and used by go-securesystemslib's
// signerverifier package over the standard library's crypto. A key is named by its SHA-256
// fingerprint in OpenSSH's form ("SHA256:..."), the same as `ssh-keygen -lf` prints.
//
// A Policy says which public keys may sign checkpoints, optionally per Kubernetes namespace, and
// whether unsigned checkpoints restore at all (never by default).
//
// What belongs here: the signature format, keys and the trust policy. What does not: the
// manifest format and digests (oci/checkpoint), and who calls Sign or Verify (the shim, berthctl).
package signature

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/secure-systems-lab/go-securesystemslib/dsse"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/secure-systems-lab/go-securesystemslib/signerverifier"
)

// PayloadType is the DSSE payload type of a signed berth manifest.
const PayloadType = "application/vnd.berth.checkpoint.manifest.v1+json"

// File is the name of the DSSE envelope beside a checkpoint's berth.json.
const File = checkpoint.SignatureFile

// ManifestFile is the name of the file a signature covers.
const ManifestFile = checkpoint.ManifestFile

// maxEnvelopeBytes bounds a signature file read from a checkpoint, in bytes (a manifest is at
// most 16 MiB; base64 and a few signatures add a third).
const maxEnvelopeBytes = 24 << 20

// maxKeyBytes bounds a key file, in bytes.
const maxKeyBytes = 64 << 10

// Sentinel errors; each is wrapped with the file, the key id or the reason.
var (
	// ErrUnsigned: the checkpoint has no berth.sig, or an envelope with no signature.
	ErrUnsigned = errors.New("checkpoint is not signed")
	// ErrUntrustedKey: no signature was made by a key the policy trusts (for this namespace).
	ErrUntrustedKey = errors.New("checkpoint is not signed by a trusted key")
	// ErrBadSignature: the envelope is malformed, of another payload type, does not verify, or
	// signs other bytes than the berth.json beside it.
	ErrBadSignature = errors.New("checkpoint signature is invalid")
	// ErrBadKey: a key file cannot be read or parsed, or is not of the expected kind.
	ErrBadKey = errors.New("unusable key")
)

// Key is a parsed key: a signer when it holds a private key, a verifier always.
type Key struct {
	// ID is the key's SHA-256 fingerprint in OpenSSH's form ("SHA256:<base64>").
	ID string
	// Path is the file the key was read from ("" when parsed from bytes).
	Path   string
	sv     dsse.SignerVerifier
	priv   bool
	signer crypto.Signer // the private key, for signatures in other formats (Signer)
}

// keyIDVerifier gives a go-securesystemslib signer/verifier berth's key id.
type keyIDVerifier struct {
	dsse.SignerVerifier
	id string
}

func (k keyIDVerifier) KeyID() (string, error) { return k.id, nil }

// ParseKey parses a PEM-encoded private or public key (ECDSA, Ed25519 or RSA). name labels the
// key in errors. It returns an error wrapping ErrBadKey for anything else.
func ParseKey(pemBytes []byte, name string) (*Key, error) {
	sk, err := signerverifier.LoadKey(pemBytes)
	if err != nil {
		return nil, fmt.Errorf("key %s: %w: %w", name, ErrBadKey, err)
	}
	var sv dsse.SignerVerifier
	switch sk.KeyType {
	case signerverifier.ECDSAKeyType:
		sv, err = signerverifier.NewECDSASignerVerifierFromSSLibKey(sk)
	case signerverifier.ED25519KeyType:
		sv, err = signerverifier.NewED25519SignerVerifierFromSSLibKey(sk)
	case signerverifier.RSAKeyType:
		sv, err = signerverifier.NewRSAPSSSignerVerifierFromSSLibKey(sk)
	default:
		return nil, fmt.Errorf("key %s: type %q: %w", name, sk.KeyType, ErrBadKey)
	}
	if err != nil {
		return nil, fmt.Errorf("key %s: %w: %w", name, ErrBadKey, err)
	}
	id, err := KeyID(sv.Public())
	if err != nil {
		return nil, fmt.Errorf("key %s: %w: %w", name, ErrBadKey, err)
	}
	k := &Key{ID: id, sv: keyIDVerifier{sv, id}, priv: sk.KeyVal.Private != ""}
	if k.priv {
		if k.signer, err = parsePrivateKey(pemBytes); err != nil {
			return nil, fmt.Errorf("key %s: %w: %w", name, ErrBadKey, err)
		}
	}
	return k, nil
}

// parsePrivateKey returns the private key of the first PEM block that holds one (PKCS#8, SEC 1
// or PKCS#1), with the standard library's parsers.
func parsePrivateKey(pemBytes []byte) (crypto.Signer, error) {
	for rest := pemBytes; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			return nil, errors.New("no private key PEM block")
		}
		var (
			k   any
			err error
		)
		switch b.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(b.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, err
		}
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("private key of type %T cannot sign", k)
		}
		return s, nil
	}
}

// KeyID returns pub's SHA-256 fingerprint in OpenSSH's form ("SHA256:<base64>").
func KeyID(pub crypto.PublicKey) (string, error) {
	return dsse.SHA256KeyID(pub)
}

// LoadKey reads and parses the PEM key file at path (ParseKey). It returns an error naming the
// file and wrapping ErrBadKey when the file is missing, larger than 64 KiB or not a key. A
// private key file that group or others may read is refused (a node key signs what restores as
// root).
func LoadKey(path string) (*Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("key %s: %w: %w", path, ErrBadKey, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxKeyBytes+1))
	if err != nil {
		return nil, fmt.Errorf("key %s: %w: %w", path, ErrBadKey, err)
	}
	if len(b) > maxKeyBytes {
		return nil, fmt.Errorf("key %s: larger than %d bytes: %w", path, maxKeyBytes, ErrBadKey)
	}
	k, err := ParseKey(b, path)
	if err != nil {
		return nil, err
	}
	k.Path = path
	if k.priv {
		if fi, err := f.Stat(); err == nil && fi.Mode().Perm()&0o077 != 0 {
			return nil, fmt.Errorf("private key %s: mode %v lets others read it (chmod 600): %w", path, fi.Mode().Perm(), ErrBadKey)
		}
	}
	return k, nil
}

// Private reports whether k can sign.
func (k *Key) Private() bool { return k.priv }

// Signer returns k's private key as a crypto.Signer (an *ecdsa.PrivateKey, ed25519.PrivateKey or
// *rsa.PrivateKey), for signatures in formats other than DSSE (a cosign signature of a pushed
// checkpoint, package oci/registry); nil for a public key.
func (k *Key) Signer() crypto.Signer { return k.signer }

// Public returns k's public key.
func (k *Key) Public() crypto.PublicKey { return k.sv.Public() }

// PublicPEM returns k's public key as a PEM "PUBLIC KEY" block (PKIX), the file to distribute to
// the nodes that trust it.
func (k *Key) PublicPEM() ([]byte, error) {
	return publicPEM(k.sv.Public())
}

// Sign returns the DSSE envelope (JSON) signing manifest, the exact bytes of a berth.json. It
// returns an error wrapping ErrBadKey when k holds no private key.
func (k *Key) Sign(ctx context.Context, manifest []byte) ([]byte, error) {
	if !k.priv {
		return nil, fmt.Errorf("sign with %s: a public key cannot sign: %w", k.ID, ErrBadKey)
	}
	es, err := dsse.NewEnvelopeSigner(k.sv)
	if err != nil {
		return nil, fmt.Errorf("sign with %s: %w", k.ID, err)
	}
	env, err := es.SignPayload(ctx, PayloadType, manifest)
	if err != nil {
		return nil, fmt.Errorf("sign with %s: %w", k.ID, err)
	}
	return json.Marshal(env)
}

// SignDir signs dir/berth.json with k and writes the envelope to dir/berth.sig (mode 0600,
// through a temporary file renamed into place). It returns the key id, or an error naming the
// file.
func SignDir(ctx context.Context, dir string, k *Key) error {
	m, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return fmt.Errorf("sign checkpoint %s: %w", dir, err)
	}
	env, err := k.Sign(ctx, m)
	if err != nil {
		return fmt.Errorf("sign checkpoint %s: %w", dir, err)
	}
	p := filepath.Join(dir, File)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, env, 0o600); err != nil {
		return fmt.Errorf("sign checkpoint %s: %w", dir, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("sign checkpoint %s: %w", dir, err)
	}
	return nil
}

// Envelope is a parsed berth.sig.
type Envelope struct {
	env dsse.Envelope
}

// ParseEnvelope parses a DSSE envelope (JSON) of PayloadType. It returns an error wrapping
// ErrBadSignature for malformed JSON or another payload type, ErrUnsigned for no signatures.
func ParseEnvelope(b []byte) (*Envelope, error) {
	var e Envelope
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&e.env); err != nil {
		return nil, fmt.Errorf("%w: not a DSSE envelope: %w", ErrBadSignature, err)
	}
	if e.env.PayloadType != PayloadType {
		return nil, fmt.Errorf("%w: payload type %q, want %q", ErrBadSignature, cut(e.env.PayloadType), PayloadType)
	}
	if len(e.env.Signatures) == 0 {
		return nil, ErrUnsigned
	}
	return &e, nil
}

// KeyIDs returns the key ids the envelope's signatures name, in order ("" for a signature that
// names none).
func (e *Envelope) KeyIDs() []string {
	var ids []string
	for _, s := range e.env.Signatures {
		ids = append(ids, cut(s.KeyID))
	}
	return ids
}

// Verify checks the envelope against keys and returns the signed payload and the id of the first
// key that verified it. It returns an error wrapping ErrUntrustedKey (naming the key ids the
// envelope claims) when none of keys made a valid signature.
func (e *Envelope) Verify(ctx context.Context, keys []*Key) ([]byte, string, error) {
	var vs []dsse.Verifier
	for _, k := range keys {
		vs = append(vs, k.sv)
	}
	if len(vs) == 0 {
		return nil, "", fmt.Errorf("signed by %v: %w (no key is trusted)", e.KeyIDs(), ErrUntrustedKey)
	}
	ev, err := dsse.NewMultiEnvelopeVerifier(1, vs...)
	if err != nil {
		return nil, "", err
	}
	accepted, payload, err := ev.VerifyAndDecode(ctx, &e.env)
	if err != nil || len(accepted) == 0 {
		return nil, "", fmt.Errorf("signed by %v: %w", e.KeyIDs(), ErrUntrustedKey)
	}
	return payload, accepted[0].KeyID, nil
}

// ReadEnvelope reads dir/berth.sig. A missing file is ErrUnsigned (wrapped, naming the file).
func ReadEnvelope(dir string) (*Envelope, error) {
	p := filepath.Join(dir, File)
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", p, ErrUnsigned)
	}
	if err != nil {
		return nil, fmt.Errorf("read signature: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxEnvelopeBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read signature %s: %w", p, err)
	}
	if len(b) > maxEnvelopeBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes: %w", p, maxEnvelopeBytes, ErrBadSignature)
	}
	e, err := ParseEnvelope(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	return e, nil
}

// cut quotes at most 80 bytes of a value read from a checkpoint in messages.
func cut(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
