package signature_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/berth-dev/berth/oci/signature"
)

// FuzzVerify feeds arbitrary bytes as berth.sig beside a fixed berth.json. Verify must never
// panic, and must accept only an envelope that the trusted key made over exactly that berth.json:
// the fuzzer cannot forge one, so anything else is refused with one of the package's sentinels.
func FuzzVerify(f *testing.F) {
	ctx := context.Background()
	const manifest = `{"version":1,"files":[]}`
	keyPath := filepath.Join(f.TempDir(), "node1.key")
	b, err := os.ReadFile(filepath.Join("testdata", "node1.key"))
	if err != nil {
		f.Fatal(err)
	}
	if err := os.WriteFile(keyPath, b, 0o600); err != nil {
		f.Fatal(err)
	}
	p, err := signature.LoadPolicy(signature.TrustConfig{SigningKey: keyPath})
	if err != nil {
		f.Fatal(err)
	}
	valid, err := p.Signer.Sign(ctx, []byte(manifest))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(valid)
	f.Add([]byte(`{"payloadType":"application/vnd.berth.checkpoint.manifest.v1+json","payload":"","signatures":[{"keyid":"x","sig":""}]}`))
	f.Add([]byte(`{"payloadType":"text/plain","payload":"e30=","signatures":[]}`))
	f.Add([]byte(`{`))
	f.Fuzz(func(t *testing.T, env []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, signature.ManifestFile), []byte(manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, signature.File), env, 0o600); err != nil {
			t.Fatal(err)
		}
		v, err := p.Verify(ctx, dir, "")
		if err == nil {
			if string(v.Manifest) != manifest || v.KeyID != p.Signer.ID {
				t.Fatalf("accepted %q as %+v", env, v)
			}
			return
		}
		if !errors.Is(err, signature.ErrUnsigned) && !errors.Is(err, signature.ErrUntrustedKey) && !errors.Is(err, signature.ErrBadSignature) {
			t.Fatalf("refusal without a sentinel: %v", err)
		}
	})
}
