package signature_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-dev/berth/oci/signature"
)

// privateCopy copies testdata/name to a 0600 file (git keeps no modes) and returns its path.
func privateCopy(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func abs(t *testing.T, name string) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// checkpointDir returns a directory holding a berth.json with body.
func checkpointDir(t *testing.T, body string) string {
	t.Helper()
	d := t.TempDir()
	if err := os.WriteFile(filepath.Join(d, signature.ManifestFile), []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return d
}

func TestLoadKey(t *testing.T) {
	for _, tc := range []struct {
		name, file string
		private    bool
		wantErr    string
	}{
		{"ecdsa private", "node1.key", true, ""},
		{"ed25519 private", "node2.key", true, ""},
		{"ecdsa public", "node1.pub", false, ""},
		{"ed25519 public", "node2.pub", false, ""},
		{"garbage", "garbage.pem", false, "unusable key"},
		{"missing", "nope.pem", false, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := abs(t, tc.file)
			if tc.private {
				p = privateCopy(t, tc.file)
			}
			k, err := signature.LoadKey(p)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, signature.ErrBadKey) {
					t.Fatalf("LoadKey(%s) = %v, want ErrBadKey containing %q", tc.file, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if k.Private() != tc.private || !strings.HasPrefix(k.ID, "SHA256:") {
				t.Fatalf("key %+v: private %v id %q", k, k.Private(), k.ID)
			}
		})
	}
}

func TestPrivateKeyReadableByOthersRefused(t *testing.T) {
	p := privateCopy(t, "node1.key")
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := signature.LoadKey(p)
	if !errors.Is(err, signature.ErrBadKey) || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("LoadKey of a 0644 private key = %v, want a refusal naming chmod 600", err)
	}
}

func TestPublicKeyIDMatchesPrivate(t *testing.T) {
	priv, err := signature.LoadKey(privateCopy(t, "node1.key"))
	if err != nil {
		t.Fatal(err)
	}
	pub, err := signature.LoadKey(abs(t, "node1.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if priv.ID != pub.ID {
		t.Fatalf("ids differ: %s vs %s", priv.ID, pub.ID)
	}
	pem, err := priv.PublicPEM()
	if err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(abs(t, "node1.pub"))
	if string(pem) != string(want) {
		t.Fatalf("PublicPEM:\n%s\nwant\n%s", pem, want)
	}
}

// policy builds a Policy signing with signKey (a testdata private key, "" for none) and trusting
// the given public keys, each "file" or "file:ns1,ns2".
func policy(t *testing.T, signKey string, allowUnsigned bool, trust ...string) *signature.Policy {
	t.Helper()
	c := signature.TrustConfig{AllowUnsigned: allowUnsigned}
	if signKey != "" {
		c.SigningKey = privateCopy(t, signKey)
	}
	for _, tr := range trust {
		file, nss, _ := strings.Cut(tr, ":")
		tk := signature.TrustedKey{Path: abs(t, file)}
		if nss != "" {
			tk.Namespaces = strings.Split(nss, ",")
		}
		c.TrustedKeys = append(c.TrustedKeys, tk)
	}
	p, err := signature.LoadPolicy(c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestVerify(t *testing.T) {
	ctx := context.Background()
	const manifest = `{"version":1,"files":[]}`
	node1 := policy(t, "node1.key", false)
	attacker := policy(t, "attacker.key", false)
	for _, tc := range []struct {
		name    string
		signer  *signature.Policy            // nil: unsigned
		edit    func(t *testing.T, d string) // after signing
		verify  *signature.Policy
		ns      string
		wantErr error
		wantIn  string
		warning bool
	}{
		{name: "own key", signer: node1, verify: node1},
		{name: "trusted public key", signer: node1, verify: policy(t, "", false, "node1.pub")},
		{name: "ed25519", signer: policy(t, "node2.key", false), verify: policy(t, "", false, "node2.pub")},
		{name: "one of several keys", signer: node1, verify: policy(t, "node2.key", false, "node1.pub")},
		{name: "unsigned", verify: node1, wantErr: signature.ErrUnsigned, wantIn: "berth.sig"},
		{name: "unknown key", signer: attacker, verify: node1, wantErr: signature.ErrUntrustedKey, wantIn: attacker.Signer.ID},
		{name: "namespace allowed", signer: node1, verify: policy(t, "", false, "node1.pub:team-a,team-b"), ns: "team-b"},
		{name: "key for another namespace", signer: node1, verify: policy(t, "", false, "node1.pub:team-a"), ns: "team-b",
			wantErr: signature.ErrUntrustedKey, wantIn: `not trusted for namespace "team-b"`},
		{name: "namespaced key outside kubernetes", signer: node1, verify: policy(t, "", false, "node1.pub:team-a"),
			wantErr: signature.ErrUntrustedKey},
		{name: "manifest edited after signing", signer: node1, verify: node1, wantErr: signature.ErrBadSignature, wantIn: "differs",
			edit: func(t *testing.T, d string) { write(t, d, signature.ManifestFile, `{"version":1,"files":[{}]}`) }},
		{name: "payload swapped, signature kept", signer: node1, verify: node1, wantErr: signature.ErrUntrustedKey,
			edit: func(t *testing.T, d string) { swapPayload(t, d, `{"version":1,"files":[{}]}`) }},
		{name: "other payload type", signer: node1, verify: node1, wantErr: signature.ErrBadSignature, wantIn: "payload type",
			edit: func(t *testing.T, d string) {
				editEnvelope(t, d, func(e map[string]any) { e["payloadType"] = "text/plain" })
			}},
		{name: "no signatures", signer: node1, verify: node1, wantErr: signature.ErrUnsigned,
			edit: func(t *testing.T, d string) { editEnvelope(t, d, func(e map[string]any) { e["signatures"] = []any{} }) }},
		{name: "not json", signer: node1, verify: node1, wantErr: signature.ErrBadSignature,
			edit: func(t *testing.T, d string) { write(t, d, signature.File, "{") }},
		{name: "unsigned allowed", verify: policy(t, "node1.key", true), warning: true},
		{name: "unknown key allowed", signer: attacker, verify: policy(t, "node1.key", true), warning: true},
		{name: "tampering never allowed", signer: node1, verify: policy(t, "node1.key", true), wantErr: signature.ErrBadSignature,
			edit: func(t *testing.T, d string) { write(t, d, signature.ManifestFile, `{"version":2}`) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := checkpointDir(t, manifest)
			if tc.signer != nil {
				id, err := tc.signer.Sign(ctx, d)
				if err != nil || id != tc.signer.Signer.ID {
					t.Fatalf("Sign = %q, %v", id, err)
				}
				if fi, err := os.Stat(filepath.Join(d, signature.File)); err != nil || fi.Mode().Perm() != 0o600 {
					t.Fatalf("berth.sig: %v %v, want mode 0600", fi, err)
				}
			}
			if tc.edit != nil {
				tc.edit(t, d)
			}
			v, err := tc.verify.Verify(ctx, d, tc.ns)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) || !strings.Contains(err.Error(), tc.wantIn) {
					t.Fatalf("Verify = %v, want %v containing %q", err, tc.wantErr, tc.wantIn)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.warning {
				if v.Warning == nil || v.Manifest != nil {
					t.Fatalf("Verify under allow_unsigned = %+v, want a warning and no manifest", v)
				}
				return
			}
			if string(v.Manifest) != manifest || v.KeyID != tc.signer.Signer.ID || v.Warning != nil {
				t.Fatalf("Verify = %+v", v)
			}
		})
	}
}

func write(t *testing.T, dir, name, body string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
}

func editEnvelope(t *testing.T, dir string, edit func(map[string]any)) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, signature.File))
	if err != nil {
		t.Fatal(err)
	}
	var e map[string]any
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	edit(e)
	b, _ = json.Marshal(e)
	write(t, dir, signature.File, string(b))
}

// swapPayload replaces the signed payload (and berth.json, so they agree) but keeps the
// signature: what an attacker who cannot sign would try.
func swapPayload(t *testing.T, dir, body string) {
	t.Helper()
	write(t, dir, signature.ManifestFile, body)
	editEnvelope(t, dir, func(e map[string]any) { e["payload"] = base64.StdEncoding.EncodeToString([]byte(body)) })
}

func TestLoadPolicyErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    signature.TrustConfig
		want string
	}{
		{"relative signing key", signature.TrustConfig{SigningKey: "node.key"}, "signing_key \"node.key\": must be an absolute path"},
		{"relative trusted key", signature.TrustConfig{TrustedKeys: []signature.TrustedKey{{Path: "a.pub"}}}, "trusted_keys[0].path"},
		{"public key as signing key", signature.TrustConfig{SigningKey: abs(t, "node1.pub")}, "is a public key"},
		{"missing trusted key", signature.TrustConfig{TrustedKeys: []signature.TrustedKey{{Path: "/nonexistent/a.pub"}}}, "/nonexistent/a.pub"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := signature.LoadPolicy(tc.c)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("LoadPolicy = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestPolicyWithoutSignerSignsNothing(t *testing.T) {
	p := policy(t, "", false, "node1.pub")
	d := checkpointDir(t, "{}")
	id, err := p.Sign(context.Background(), d)
	if err != nil || id != "" {
		t.Fatalf("Sign = %q, %v", id, err)
	}
	if _, err := os.Stat(filepath.Join(d, signature.File)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("berth.sig written without a signing key: %v", err)
	}
}

// TestSigner: a private key's Signer signs what its Public key verifies (stdlib crypto); a
// public key has no Signer.
func TestSigner(t *testing.T) {
	for _, name := range []string{"node1", "node2"} {
		priv, err := signature.LoadKey(privateCopy(t, name+".key"))
		if err != nil {
			t.Fatal(err)
		}
		pub, err := signature.LoadKey(abs(t, name+".pub"))
		if err != nil {
			t.Fatal(err)
		}
		if pub.Signer() != nil {
			t.Errorf("%s.pub has a Signer", name)
		}
		s := priv.Signer()
		if s == nil {
			t.Fatalf("%s.key has no Signer", name)
		}
		msg := []byte("berth")
		switch k := pub.Public().(type) {
		case *ecdsa.PublicKey:
			h := sha256.Sum256(msg)
			sig, err := s.Sign(rand.Reader, h[:], crypto.SHA256)
			if err != nil || !ecdsa.VerifyASN1(k, h[:], sig) {
				t.Errorf("%s: ECDSA signature does not verify: %v", name, err)
			}
		case ed25519.PublicKey:
			sig, err := s.Sign(rand.Reader, msg, crypto.Hash(0))
			if err != nil || !ed25519.Verify(k, msg, sig) {
				t.Errorf("%s: Ed25519 signature does not verify: %v", name, err)
			}
		default:
			t.Errorf("%s: public key of type %T", name, k)
		}
	}
}
