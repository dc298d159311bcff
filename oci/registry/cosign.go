package registry

import (
	"bytes"
	"context"
	"crypto"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	sigstoresig "github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/payload"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/errdef"
)

// The signature of a pushed checkpoint in cosign's format (sigstore/cosign, "simple signing"):
// an OCI image manifest tagged CosignSignatureTag(digest) in the checkpoint's repository, one
// layer per signature, each the simple-signing payload (sigstore's payload.Cosign: the
// repository and the checkpoint manifest's digest) with the base64 signature of that payload in
// the annotation CosignSignatureAnnotation. `cosign verify --key node.pub REF` verifies it.
const (
	// CosignPayloadMediaType is the media type of a signature layer.
	CosignPayloadMediaType = "application/vnd.dev.cosign.simplesigning.v1+json"
	// CosignSignatureAnnotation holds a layer's base64 signature.
	CosignSignatureAnnotation = "dev.cosignproject.cosign/signature"
	// cosignSignatureSuffix ends cosign's signature tag.
	cosignSignatureSuffix = ".sig"
	// maxCosignManifestBytes bounds an existing signature manifest read before appending.
	maxCosignManifestBytes = 4 << 20
)

// CosignSignatureTag returns the tag cosign reads the signatures of the manifest d from:
// "sha256-<hex>.sig".
func CosignSignatureTag(d digest.Digest) string {
	return d.Algorithm().String() + "-" + d.Encoded() + cosignSignatureSuffix
}

// cosignSign signs the pushed manifest desc of t's repository with signer, cosign's way, and
// tags the signature manifest CosignSignatureTag(desc.Digest). A signature manifest already
// there (another node's signature, an earlier push) keeps its layers; this signature is added
// to them.
func cosignSign(ctx context.Context, t *target, desc ocispec.Descriptor, signer crypto.Signer) error {
	ref, err := name.NewDigest(t.ref.Registry+"/"+t.ref.Repository+"@"+desc.Digest.String(), name.WeakValidation)
	if err != nil {
		return fmt.Errorf("cosign signature: %w", err)
	}
	body, err := payload.Cosign{Image: ref}.MarshalJSON()
	if err != nil {
		return fmt.Errorf("cosign signature: %w", err)
	}
	sv, err := sigstoresig.LoadSignerVerifier(signer, crypto.SHA256)
	if err != nil {
		return fmt.Errorf("cosign signature: %w", err)
	}
	sig, err := sv.SignMessage(bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("cosign signature: sign: %w", err)
	}
	layer := ocispec.Descriptor{
		MediaType:   CosignPayloadMediaType,
		Digest:      digest.FromBytes(body),
		Size:        int64(len(body)),
		Annotations: map[string]string{CosignSignatureAnnotation: base64.StdEncoding.EncodeToString(sig)},
	}
	tag := CosignSignatureTag(desc.Digest)
	layers, err := existingCosignLayers(ctx, t, tag)
	if err != nil {
		return err
	}
	layers = append(layers, layer)

	// the image config cosign's own signature images carry: the layers as diff ids
	cfg := ocispec.Image{RootFS: ocispec.RootFS{Type: "layers"}}
	for _, l := range layers {
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, l.Digest)
	}
	cfgBody, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	man := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfgBody), Size: int64(len(cfgBody))},
		Layers:    layers,
	}
	manBody, err := json.Marshal(man)
	if err != nil {
		return err
	}
	for _, b := range []struct {
		desc ocispec.Descriptor
		data []byte
	}{{layer, body}, {man.Config, cfgBody}} {
		if err := pushIfMissing(ctx, t, b.desc, b.data); err != nil {
			return fmt.Errorf("cosign signature: upload %s: %w", b.desc.Digest, shortURL(err))
		}
	}
	mdesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(manBody), Size: int64(len(manBody))}
	if err := t.repo.PushReference(ctx, mdesc, bytes.NewReader(manBody), tag); err != nil {
		return fmt.Errorf("cosign signature: push %s: %w", tag, shortURL(err))
	}
	return nil
}

// existingCosignLayers returns the signature layers already tagged tag, none when the tag does
// not exist.
func existingCosignLayers(ctx context.Context, t *target, tag string) ([]ocispec.Descriptor, error) {
	desc, rc, err := t.repo.FetchReference(ctx, tag)
	if errors.Is(err, errdef.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cosign signature: fetch %s: %w", tag, shortURL(err))
	}
	defer rc.Close()
	if desc.Size > maxCosignManifestBytes {
		return nil, fmt.Errorf("cosign signature: %s: manifest of %d bytes", tag, desc.Size)
	}
	b, err := content.ReadAll(rc, desc)
	if err != nil {
		return nil, fmt.Errorf("cosign signature: fetch %s: %w", tag, err)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("cosign signature: %s: %w", tag, err)
	}
	var out []ocispec.Descriptor
	for _, l := range m.Layers {
		if l.MediaType == CosignPayloadMediaType && strings.TrimSpace(l.Annotations[CosignSignatureAnnotation]) != "" {
			out = append(out, l)
		}
	}
	return out, nil
}

// pushIfMissing uploads a small blob unless the registry has it.
func pushIfMissing(ctx context.Context, t *target, desc ocispec.Descriptor, data []byte) error {
	ok, err := t.repo.Exists(ctx, desc)
	if err != nil || ok {
		return err
	}
	return t.repo.Push(ctx, desc, io.NopCloser(bytes.NewReader(data)))
}
