package registry

import (
	"bytes"
	"context"
	"crypto"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	sigstoresig "github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/payload"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/test/keys"
)

// nodeKey is a node's signing key and the policy of a node that trusts only it.
type nodeKey struct {
	key    *signature.Key
	pub    string
	policy *signature.Policy
}

func newNodeKey(t *testing.T, name string) nodeKey {
	t.Helper()
	priv, pub, err := keys.SigningKey(t.TempDir(), name)
	if err != nil {
		t.Fatal(err)
	}
	p, err := signature.LoadPolicy(signature.TrustConfig{SigningKey: priv})
	if err != nil {
		t.Fatal(err)
	}
	return nodeKey{key: p.Signer, pub: pub, policy: p}
}

// verify is the Options.Verify hook of a node with policy p.
func (n nodeKey) verify(ctx context.Context, dir string) error {
	_, err := n.policy.Verify(ctx, dir, "")
	return err
}

func (n nodeKey) sign(ctx context.Context, dir string) error {
	_, err := n.policy.Sign(ctx, dir)
	return err
}

// fetchManifest returns the OCI manifest ref names.
func fetchManifest(t *testing.T, ctx context.Context, ref string) (ocispec.Descriptor, ocispec.Manifest) {
	t.Helper()
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	desc, rc, err := repo.FetchReference(ctx, repo.Reference.Reference)
	if err != nil {
		t.Fatalf("fetch %s: %v", ref, err)
	}
	defer rc.Close()
	b, err := content.ReadAll(rc, desc)
	if err != nil {
		t.Fatal(err)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return desc, m
}

// fetchBlob returns a blob of ref's repository.
func fetchBlob(t *testing.T, ctx context.Context, ref string, desc ocispec.Descriptor) []byte {
	t.Helper()
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	rc, err := repo.Fetch(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := content.ReadAll(rc, desc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// checkCosignSignatures checks that the cosign signature manifest of the checkpoint manifest
// desc in repository repoRef holds, for each key, a simple-signing payload naming desc's digest
// whose signature that key verifies, as sigstore's own verifier checks it.
func checkCosignSignatures(t *testing.T, ctx context.Context, repoRef string, desc ocispec.Descriptor, signers ...nodeKey) {
	t.Helper()
	_, sigMan := fetchManifest(t, ctx, repoRef+":"+CosignSignatureTag(desc.Digest))
	if len(sigMan.Layers) != len(signers) {
		t.Fatalf("cosign signature manifest has %d layers, want %d", len(sigMan.Layers), len(signers))
	}
	for i, l := range sigMan.Layers {
		if l.MediaType != CosignPayloadMediaType {
			t.Errorf("layer %d media type %q", i, l.MediaType)
		}
		body := fetchBlob(t, ctx, repoRef, l)
		var p payload.Cosign
		if err := json.Unmarshal(body, &p); err != nil {
			t.Fatalf("layer %d is not cosign's simple-signing payload: %v", i, err)
		}
		if p.Image.DigestStr() != desc.Digest.String() || !strings.HasSuffix(p.ClaimedIdentity, "/berth/signed") {
			t.Errorf("payload names %s (%s), want %s in berth/signed", p.Image.DigestStr(), p.ClaimedIdentity, desc.Digest)
		}
		sig, err := base64.StdEncoding.DecodeString(l.Annotations[CosignSignatureAnnotation])
		if err != nil {
			t.Fatal(err)
		}
		v, err := sigstoresig.LoadVerifier(signers[i].key.Public(), crypto.SHA256)
		if err != nil {
			t.Fatal(err)
		}
		if err := v.VerifySignature(bytes.NewReader(sig), bytes.NewReader(body)); err != nil {
			t.Errorf("signature %d does not verify with %s: %v", i, signers[i].key.ID, err)
		}
	}
}

// TestPushPullSigned: a signed checkpoint travels with its berth.sig (the artifact's last
// layer), its pushed manifest gets a cosign signature per pushing node, and Pull restores
// berth.sig and verifies it through Options.Verify.
func TestPushPullSigned(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	node1, node2 := newNodeKey(t, "node1"), newNodeKey(t, "node2")
	src := makeCheckpoint(t)
	if err := node1.sign(ctx, src); err != nil {
		t.Fatal(err)
	}
	ref := r.ref("berth/signed:v1")
	desc, err := Push(ctx, src, ref, Options{PlainHTTP: true, Verify: node1.verify, Signer: node1.key.Signer()})
	if err != nil {
		t.Fatal(err)
	}
	_, man := fetchManifest(t, ctx, ref)
	last := man.Layers[len(man.Layers)-1]
	sig, err := os.ReadFile(filepath.Join(src, checkpoint.SignatureFile))
	if err != nil {
		t.Fatal(err)
	}
	if last.MediaType != SignatureMediaType || last.Annotations[ocispec.AnnotationTitle] != checkpoint.SignatureFile || last.Digest != digest.FromBytes(sig) {
		t.Errorf("last layer %+v, want berth.sig", last)
	}
	checkCosignSignatures(t, ctx, r.ref("berth/signed"), desc, node1)

	// another node pushes the same bytes: same manifest, its signature added beside the first
	if err := node2.sign(ctx, src); err != nil { // berth.sig is node2's now: another manifest
		t.Fatal(err)
	}
	if err := node1.sign(ctx, src); err != nil {
		t.Fatal(err)
	}
	// (a new DSSE signature of the same bytes differs: push the original berth.sig back)
	if err := os.WriteFile(filepath.Join(src, checkpoint.SignatureFile), sig, 0o600); err != nil {
		t.Fatal(err)
	}
	trustBoth, err := signature.LoadPolicy(signature.TrustConfig{TrustedKeys: []signature.TrustedKey{{Path: node1.pub}, {Path: node2.pub}}})
	if err != nil {
		t.Fatal(err)
	}
	desc2, err := Push(ctx, src, ref, Options{PlainHTTP: true, Signer: node2.key.Signer(),
		Verify: func(ctx context.Context, dir string) error { _, err := trustBoth.Verify(ctx, dir, ""); return err }})
	if err != nil {
		t.Fatal(err)
	}
	if desc2.Digest != desc.Digest {
		t.Fatalf("same checkpoint pushed as %s, then %s", desc.Digest, desc2.Digest)
	}
	checkCosignSignatures(t, ctx, r.ref("berth/signed"), desc, node1, node2)

	dst := filepath.Join(t.TempDir(), "pulled")
	if err := Pull(ctx, ref, dst, Options{PlainHTTP: true, Verify: node1.verify}); err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, src, dst)
	got, err := os.ReadFile(filepath.Join(dst, checkpoint.SignatureFile))
	if err != nil || !bytes.Equal(got, sig) {
		t.Errorf("pulled berth.sig differs: %v", err)
	}
	if _, err := node1.policy.Verify(ctx, dst, ""); err != nil {
		t.Errorf("pulled checkpoint does not verify: %v", err)
	}
}

// TestPullRefusesUntrusted: an attacker with push access uploads a checkpoint whose CRIU image
// was edited and whose berth.json was regenerated (berth.sig kept, or dropped, or replaced by
// the attacker's own): Pull refuses each before any file is fetched and leaves nothing, neither
// at the destination nor beside it. Push with a Verify hook refuses to upload the forgery.
func TestPullRefusesUntrusted(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	node, attacker := newNodeKey(t, "node"), newNodeKey(t, "attacker")

	forged := func(t *testing.T, resign func(dir string)) string {
		dir := makeCheckpoint(t)
		if err := node.sign(ctx, dir); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, "checkpoint", "core-1.img")
		if err := os.WriteFile(p, []byte("uid=0 caps=all"), 0o600); err != nil {
			t.Fatal(err)
		}
		m, err := checkpoint.ReadManifest(dir)
		if err != nil {
			t.Fatal(err)
		}
		if m.Files, m.ImageSize, err = checkpoint.DigestDir(dir); err != nil {
			t.Fatal(err)
		}
		if err := checkpoint.WriteManifest(dir, m); err != nil {
			t.Fatal(err)
		}
		if resign != nil {
			resign(dir)
		}
		return dir
	}
	for _, tc := range []struct {
		name     string
		resign   func(dir string)
		sentinel error
	}{
		{"signature kept", nil, signature.ErrBadSignature},
		{"signature dropped", func(dir string) { os.Remove(filepath.Join(dir, checkpoint.SignatureFile)) }, signature.ErrUnsigned},
		{"attacker's key", func(dir string) {
			if err := attacker.sign(ctx, dir); err != nil {
				t.Fatal(err)
			}
		}, signature.ErrUntrustedKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := forged(t, tc.resign)
			ref := r.ref("berth/forged:" + strings.NewReplacer(" ", "-", "'", "").Replace(tc.name))
			// the node's own push refuses it
			if _, err := Push(ctx, src, ref, Options{PlainHTTP: true, Verify: node.verify}); !errors.Is(err, tc.sentinel) {
				t.Fatalf("push with Verify: %v, want %v", err, tc.sentinel)
			}
			if _, err := Resolve(ctx, ref, Options{PlainHTTP: true}); err == nil {
				t.Fatal("the refused checkpoint was tagged")
			}
			// the attacker's push (no Verify) goes through
			if _, err := Push(ctx, src, ref, Options{PlainHTTP: true}); err != nil {
				t.Fatal(err)
			}
			parent := t.TempDir()
			dst := filepath.Join(parent, "pulled")
			pr := &progressRecorder{t: t}
			err := Pull(ctx, ref, dst, Options{PlainHTTP: true, Verify: node.verify, Progress: pr.fn})
			if !errors.Is(err, tc.sentinel) {
				t.Fatalf("pull: %v, want %v", err, tc.sentinel)
			}
			noDir(t, dst)
			if es, _ := os.ReadDir(parent); len(es) != 0 {
				t.Errorf("pull left %v beside the destination", es)
			}
			if pr.done > 64<<10 {
				t.Errorf("pull fetched %d of %d bytes before refusing (berth.json and berth.sig are a few KiB)", pr.done, pr.total)
			}
		})
	}
}

// TestPushCRIArchiveSigned: a CRI archive's top-level berth.json, which covers spec.dump,
// config.dump and rootfs-diff.tar, is signed by the pushing node; editing spec.dump alone (and
// regenerating the digests) is then refused by a pull, where before only the CRIU images were
// covered.
func TestPushCRIArchiveSigned(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	node := newNodeKey(t, "node")
	ref := r.ref("berth/cri-signed:v1")
	if _, err := Push(ctx, makeCRIArchive(t, false), ref, Options{PlainHTTP: true, TempDir: t.TempDir(),
		SignCRI: node.sign, Verify: node.verify, Signer: node.key.Signer()}); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "pulled")
	if err := Pull(ctx, ref, dst, Options{PlainHTTP: true, Verify: node.verify}); err != nil {
		t.Fatal(err)
	}
	// the attacker moves it to another namespace by editing spec.dump alone
	spec := filepath.Join(dst, checkpoint.SpecFile)
	if err := os.WriteFile(spec, []byte(`{"ociVersion":"1.2.0","annotations":{"io.kubernetes.cri.sandbox-namespace":"kube-system"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := checkpoint.ReadManifest(dst)
	if err != nil {
		t.Fatal(err)
	}
	if m.Files, m.ImageSize, err = checkpoint.DigestDir(dst); err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.WriteManifest(dst, m); err != nil {
		t.Fatal(err)
	}
	evil := r.ref("berth/cri-signed:evil")
	if _, err := Push(ctx, dst, evil, Options{PlainHTTP: true}); err != nil {
		t.Fatal(err)
	}
	if err := Pull(ctx, evil, filepath.Join(t.TempDir(), "evil"), Options{PlainHTTP: true, Verify: node.verify}); !errors.Is(err, signature.ErrBadSignature) {
		t.Errorf("pull of a CRI checkpoint with an edited spec.dump: %v, want %v", err, signature.ErrBadSignature)
	}
}

// TestCredentialsNotEchoed: a password written into a reference never appears in an error, and
// a huge reference is quoted cut.
func TestCredentialsNotEchoed(t *testing.T) {
	ctx := context.Background()
	const secret = "s3cret-pw"
	src := makeCheckpoint(t)
	for _, ref := range []string{
		"berth:" + secret + "@127.0.0.1:1/ckpt/x:1",
		"oci://berth:" + secret + "@127.0.0.1:1/ckpt/x:1",
		"berth:" + secret + "@127.0.0.1:1/ckpt/x@sha256:" + strings.Repeat("a", 64),
		"berth:" + secret + "@127.0.0.1:1",
	} {
		var errs []error
		_, err := Push(ctx, src, ref, Options{PlainHTTP: true})
		errs = append(errs, err)
		errs = append(errs, Pull(ctx, ref, filepath.Join(t.TempDir(), "x"), Options{PlainHTTP: true}))
		_, err = Resolve(ctx, ref, Options{PlainHTTP: true})
		errs = append(errs, err)
		_, err = ParseRestoreFrom("oci://" + strings.TrimPrefix(ref, "oci://"))
		errs = append(errs, err)
		for i, err := range errs {
			if err == nil || strings.Contains(err.Error(), secret) {
				t.Errorf("%q: error %d: %v", ref, i, err)
			}
		}
	}
	long := "127.0.0.1:1/" + strings.Repeat("a", 1<<20) + ":1"
	for _, err := range []error{
		Pull(ctx, long, filepath.Join(t.TempDir(), "x"), Options{PlainHTTP: true}),
		func() error { _, err := ParseRestoreFrom("oci://" + long); return err }(),
		func() error { _, err := ParseRestoreFrom("oci://" + "u:p@" + long); return err }(),
	} {
		if err == nil || len(err.Error()) > 2<<10 {
			t.Errorf("error for a 1 MiB reference: %.300v", err)
		}
	}
}
