package signature

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// TestEnsureKey: a missing key is generated once (concurrent callers agree), 0600, with its
// public key beside it; the node trusts it; an existing key is kept.
func TestEnsureKey(t *testing.T) {
	dir := t.TempDir()
	priv := filepath.Join(dir, "etc-berth", "node.key")
	var wg sync.WaitGroup
	created := make(chan bool, 8)
	for range 8 {
		wg.Go(func() {
			c, err := EnsureKey(priv)
			if err != nil {
				t.Error(err)
			}
			created <- c
		})
	}
	wg.Wait()
	close(created)
	n := 0
	for c := range created {
		if c {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d callers created the key, want 1", n)
	}
	fi, err := os.Stat(priv)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("private key: %v %v", fi, err)
	}
	k, err := LoadKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := LoadKey(PublicKeyPath(priv))
	if err != nil || pub.ID != k.ID {
		t.Fatalf("public key %v beside the private key: %v", pub, err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "etc-berth", "*.tmp")); len(left) > 0 {
		t.Errorf("temporary files left: %v", left)
	}
	// the node trusts its own key: a checkpoint it signs verifies with no trusted_keys
	p, err := LoadPolicy(TrustConfig{SigningKey: priv})
	if err != nil {
		t.Fatal(err)
	}
	ck := t.TempDir()
	if err := os.WriteFile(filepath.Join(ck, ManifestFile), []byte(`{"version":1}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Sign(context.Background(), ck); err != nil {
		t.Fatal(err)
	}
	if v, err := p.Verify(context.Background(), ck, ""); err != nil || v.KeyID != k.ID {
		t.Errorf("own checkpoint: %+v %v", v, err)
	}
	if c, err := EnsureKey(priv); err != nil || c {
		t.Errorf("second EnsureKey: %v %v, want the key kept", c, err)
	}
}
