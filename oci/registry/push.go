package registry

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/quote"
)

// Push uploads the checkpoint at src to the registry as ref ("host[:port]/repository:tag") and
// returns the descriptor of the OCI manifest it tagged. src is a checkpoint directory (berth.json
// at its top) or a checkpoint archive file (a tar as oci/archive writes it, optionally
// gzip-compressed), which is extracted safely into Options.TempDir first and removed afterwards.
// A CRI checkpoint archive (the kubelet's checkpoint API, `crictl checkpoint --export`), whose
// only berth.json is checkpoint/berth.json, is signed while extracted (checkpoint.SignCRICheckpoint):
// the CRIU images are verified against it and a top-level berth.json covering every file is
// written, so the pulled checkpoint is verified whole.
//
// The checkpoint is verified against its berth.json (checkpoint.Verify) and Options.Verify before
// anything is uploaded; its berth.sig, if any, is uploaded as the last layer, and with
// Options.Signer the pushed manifest is signed cosign's way once tagged (see the package doc);
// blobs the registry already has are not uploaded again, so pushing again after a failure only
// sends what is missing. The tag is written last: a reader never sees a partial checkpoint under
// it. Up to Options.Concurrency blobs are uploaded at once.
//
// Errors (wrapped, naming the reference and the registry): ErrNoTag for a reference without a
// tag; ErrUnauthorized when the registry wants credentials or refuses them; checkpoint.ReadManifest's and checkpoint.Verify's errors for a checkpoint that is not intact;
// archive.Extract's for a bad archive; the registry's errors (oras-go's errcode.ErrorResponse,
// for example 401 for wrong credentials) and network errors, naming the file being uploaded;
// ctx's error when cancelled.
func Push(ctx context.Context, src, ref string, opts Options) (Descriptor, error) {
	desc, err := push(ctx, src, ref, opts)
	if err != nil {
		return Descriptor{}, fmt.Errorf("push %s to %s: %w", src, refName(ref), classify(err))
	}
	return desc, nil
}

// refName names ref and its registry for an error message, even when ref does not parse; a
// reference that does not parse is quoted cut and without credentials (quote.Ref).
func refName(ref string) string {
	r, err := parseRef(ref)
	if err != nil {
		return quote.Ref(ref)
	}
	return (&target{ref: r}).String()
}

func push(ctx context.Context, src, ref string, opts Options) (Descriptor, error) {
	t, err := newTarget(ref, opts)
	if err != nil {
		return Descriptor{}, err
	}
	if err := t.ref.ValidateReferenceAsTag(); err != nil {
		return Descriptor{}, fmt.Errorf("%w: %w", ErrNoTag, err)
	}
	dir, cleanup, err := checkpointDir(ctx, src, opts)
	if err != nil {
		return Descriptor{}, err
	}
	defer cleanup()

	config, err := checkpoint.ReadManifestBytes(dir)
	if err != nil {
		return Descriptor{}, err
	}
	m, err := checkpoint.ParseManifest(config)
	if err != nil {
		return Descriptor{}, fmt.Errorf("%s: %w", filepath.Join(dir, checkpoint.ManifestFile), err)
	}
	if err := checkpoint.Verify(dir, m); err != nil {
		return Descriptor{}, fmt.Errorf("checkpoint %s is not intact: %w", src, err)
	}
	if opts.Verify != nil {
		if err := opts.Verify(ctx, dir); err != nil {
			return Descriptor{}, fmt.Errorf("checkpoint %s: %w", src, err)
		}
	}
	sig, err := readSignature(dir)
	if err != nil {
		return Descriptor{}, err
	}

	manifest := artifactManifest(m, config, sig)
	body, err := json.Marshal(manifest)
	if err != nil {
		return Descriptor{}, err
	}

	// Blobs: the config and every distinct file content (identical files share a digest).
	type blob struct {
		desc ocispec.Descriptor
		path string // relative to dir; "" for the config
	}
	blobs := []blob{{desc: manifest.Config}}
	seen := map[digest.Digest]bool{manifest.Config.Digest: true}
	for i, l := range manifest.Layers {
		if !seen[l.Digest] {
			seen[l.Digest] = true
			p := checkpoint.SignatureFile
			if i < len(m.Files) {
				p = m.Files[i].Path
			}
			blobs = append(blobs, blob{desc: l, path: p})
		}
	}
	pr := &progress{fn: opts.Progress}
	for _, b := range blobs {
		pr.total += b.desc.Size
	}
	pr.start()

	root, err := os.OpenRoot(dir)
	if err != nil {
		return Descriptor{}, err
	}
	defer root.Close()
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.concurrency())
	for _, b := range blobs {
		g.Go(func() error {
			name := b.path
			if name == "" {
				name = checkpoint.ManifestFile
			}
			if err := pushBlob(gctx, t, root, b.desc, b.path, config, sig, pr); err != nil {
				return fmt.Errorf("upload %s (%s, %d bytes): %w", name, b.desc.Digest, b.desc.Size, shortURL(err))
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return Descriptor{}, err
	}

	desc := ocispec.Descriptor{
		MediaType:    ocispec.MediaTypeImageManifest,
		ArtifactType: ArtifactType,
		Digest:       digest.FromBytes(body),
		Size:         int64(len(body)),
	}
	if err := t.repo.PushReference(ctx, desc, bytes.NewReader(body), t.ref.Reference); err != nil {
		return Descriptor{}, fmt.Errorf("push manifest %s: %w", desc.Digest, err)
	}
	if opts.Signer != nil {
		if err := cosignSign(ctx, t, desc, opts.Signer); err != nil {
			return Descriptor{}, fmt.Errorf("pushed %s, but not its signature: %w", desc.Digest, err)
		}
	}
	return desc, nil
}

// readSignature returns dir's berth.sig, nil when there is none.
func readSignature(dir string) ([]byte, error) {
	p := filepath.Join(dir, checkpoint.SignatureFile)
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() || fi.Size() > maxSignatureBytes {
		return nil, fmt.Errorf("%s: %w: not a regular file of at most %d bytes", p, checkpoint.ErrUnsupportedFile, maxSignatureBytes)
	}
	return os.ReadFile(p)
}

// pushBlob uploads one blob unless the registry has it: the config and the signature from
// memory, a file from root.
func pushBlob(ctx context.Context, t *target, root *os.Root, desc ocispec.Descriptor, path string, config, sig []byte, pr *progress) error {
	ok, err := t.repo.Exists(ctx, desc)
	if err != nil {
		return err
	}
	if ok {
		pr.add(desc.Size)
		return nil
	}
	switch path {
	case "":
		return t.repo.Push(ctx, desc, reader{r: bytes.NewReader(config), p: pr})
	case checkpoint.SignatureFile:
		return t.repo.Push(ctx, desc, reader{r: bytes.NewReader(sig), p: pr})
	}
	f, err := root.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	// Size and digest were verified; the registry checks the digest again on upload, so a file
	// changed since is refused rather than stored under the wrong digest.
	return t.repo.Push(ctx, desc, reader{r: bufio.NewReaderSize(io.LimitReader(f, desc.Size), 1<<20), p: pr})
}

// artifactManifest is the OCI manifest of a checkpoint whose berth manifest is m, encoded as
// config, and whose berth.sig is sig (nil: unsigned) (see the package documentation).
func artifactManifest(m *checkpoint.Manifest, config, sig []byte) ocispec.Manifest {
	layers := make([]ocispec.Descriptor, len(m.Files), len(m.Files)+1)
	for i, f := range m.Files {
		layers[i] = ocispec.Descriptor{
			MediaType:   FileMediaType,
			Digest:      digest.Digest(f.Digest),
			Size:        f.Size,
			Annotations: map[string]string{ocispec.AnnotationTitle: f.Path},
		}
	}
	if sig != nil {
		layers = append(layers, ocispec.Descriptor{
			MediaType:   SignatureMediaType,
			Digest:      digest.FromBytes(sig),
			Size:        int64(len(sig)),
			Annotations: map[string]string{ocispec.AnnotationTitle: checkpoint.SignatureFile},
		})
	}
	ann := map[string]string{}
	set := func(k, v string) {
		if v != "" {
			ann[k] = v
		}
	}
	if !m.Created.IsZero() {
		set(ocispec.AnnotationCreated, m.Created.UTC().Format(time.RFC3339))
	}
	set(AnnotationContainerID, m.Container.ID)
	set(AnnotationContainerNamespace, m.Container.Namespace)
	set(AnnotationImage, m.Container.Image)
	set(AnnotationImageDigest, m.Container.ImageDigest)
	if m.Fingerprint.Arch != "" || m.Fingerprint.Kernel != "" {
		set(AnnotationFingerprintHash, m.Fingerprint.Hash())
	}
	if len(ann) == 0 {
		ann = nil
	}
	return ocispec.Manifest{
		Versioned:    specs.Versioned{SchemaVersion: 2},
		MediaType:    ocispec.MediaTypeImageManifest,
		ArtifactType: ArtifactType,
		Config: ocispec.Descriptor{
			MediaType: ConfigMediaType,
			Digest:    digest.FromBytes(config),
			Size:      int64(len(config)),
		},
		Layers:      layers,
		Annotations: ann,
	}
}

// checkpointDir returns the checkpoint directory for src: src itself when it is a directory, or
// a temporary extraction of the archive file src, removed by cleanup.
func checkpointDir(ctx context.Context, src string, opts Options) (dir string, cleanup func(), err error) {
	info, err := os.Stat(src)
	if err != nil {
		return "", nil, err
	}
	if info.IsDir() {
		if checkpoint.IsCRICheckpoint(src) {
			return "", nil, fmt.Errorf("%s is a CRI checkpoint directory without a top-level %s: push the archive (crictl checkpoint --export, the kubelet's checkpoint API) and it is signed while extracted: %w",
				src, checkpoint.ManifestFile, checkpoint.ErrNotCRICheckpoint)
		}
		return src, func() {}, nil
	}
	if !info.Mode().IsRegular() {
		return "", nil, fmt.Errorf("%s: %w", src, checkpoint.ErrUnsupportedFile)
	}
	f, err := os.Open(src)
	if err != nil {
		return "", nil, err
	}
	defer f.Close()
	tmp, err := os.MkdirTemp(opts.TempDir, "berth-push-")
	if err != nil {
		return "", nil, err
	}
	cleanup = func() { os.RemoveAll(tmp) }
	br := bufio.NewReaderSize(f, 1<<20)
	var r io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			cleanup()
			return "", nil, fmt.Errorf("archive %s: %w", src, err)
		}
		defer zr.Close()
		r = zr
	}
	dir = filepath.Join(tmp, "checkpoint")
	if err := archive.Extract(r, dir, archive.Limits{}); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("archive %s: %w", src, err)
	}
	if checkpoint.IsCRICheckpoint(dir) {
		// A CRI archive: only checkpoint/berth.json (the CRIU images) is signed; sign the whole
		// extracted archive so that a pull verifies every file.
		if _, err := checkpoint.SignCRICheckpoint(dir); err != nil {
			cleanup()
			return "", nil, fmt.Errorf("CRI checkpoint archive %s: %w", src, err)
		}
		if opts.SignCRI != nil {
			if err := opts.SignCRI(ctx, dir); err != nil {
				cleanup()
				return "", nil, fmt.Errorf("CRI checkpoint archive %s: %w", src, err)
			}
		}
	}
	return dir, cleanup, nil
}
