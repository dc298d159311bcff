package registry

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2/content"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/fsutil"
	"github.com/berth-dev/berth/oci/internal/quote"
)

// Pull downloads the checkpoint artifact ref ("host[:port]/repository:tag" or "...@sha256:...")
// into dir, which must not exist: Pull creates it (mode 0700; its parent must exist), with files
// of mode 0600 and directories of mode 0700, since a checkpoint holds process memory. On any
// error, dir and everything in it are removed: a failed Pull leaves nothing behind.
//
// Before writing anything, Pull checks the OCI manifest (digest, media types), every layer title
// (archive.ErrUnsafePath for an absolute path, "..", or berth.json), the number of files and
// their sizes against Options.Limits, and that the layers are exactly the files berth.json
// lists. It fills a staging directory beside dir: berth.json and berth.sig first, then
// Options.Verify (the signature check) before any other file is fetched. Each blob's size and
// digest are checked while it streams, and the result is verified again with
// checkpoint.ReadManifest and checkpoint.Verify before the staging directory is renamed to dir.
// Up to Options.Concurrency files are downloaded at once. A successful Pull leaves a verification stamp (checkpoint.WriteStamp, in <parent>/.verified/)
// so a shim restoring from dir skips re-reading files that have not changed since.
//
// Errors (wrapped, naming the reference, the registry and dir): an error wrapping fs.ErrExist
// when dir exists; Options.Verify's (signature.ErrUnsigned, ErrUntrustedKey, ErrBadSignature);
// ErrCredentialsInReference; ErrUnauthorized when the registry wants credentials or refuses them;
// ErrNotCheckpoint, ErrLayerMismatch; archive.ErrUnsafePath,
// archive.ErrDuplicateEntry, archive.ErrTooManyEntries, archive.ErrFileTooLarge,
// archive.ErrTotalTooLarge; checkpoint.ErrDigestMismatch for a blob whose content does not match its
// digest (together with oras-go's content.ErrMismatchedDigest) or a file that fails checkpoint.Verify,
// and checkpoint.Verify's other errors; checkpoint.ParseManifest's for a bad berth.json; the registry's errors
// (errdef.ErrNotFound for an unknown reference, errcode.ErrorResponse for 401 and others) and
// network errors; ctx's error when cancelled.
func Pull(ctx context.Context, ref, dir string, opts Options) error {
	if err := pull(ctx, ref, dir, opts); err != nil {
		return fmt.Errorf("pull %s into %s: %w", refName(ref), dir, classify(err))
	}
	return nil
}

func pull(ctx context.Context, ref, dir string, opts Options) (retErr error) {
	t, err := newTarget(ref, opts)
	if err != nil {
		return err
	}
	if t.ref.Reference == "" {
		return fmt.Errorf("reference %s names no tag or digest (add :TAG or @sha256:...): %w", quote.Ref(ref), ErrNoTag)
	}
	if err := t.ref.ValidateReference(); err != nil {
		return err
	}
	if _, err := os.Lstat(dir); err == nil {
		return fmt.Errorf("%s: %w", dir, fs.ErrExist)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}

	desc, rc, err := t.repo.FetchReference(ctx, t.ref.Reference)
	if err != nil {
		return fmt.Errorf("fetch manifest: %w", err)
	}
	if desc.Size > maxOCIManifestBytes {
		rc.Close()
		return fmt.Errorf("%w: manifest of %d bytes (at most %d)", ErrNotCheckpoint, desc.Size, maxOCIManifestBytes)
	}
	body, err := content.ReadAll(rc, desc)
	rc.Close()
	if err != nil {
		return fmt.Errorf("fetch manifest %s: %w", desc.Digest, digestErr(err))
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(body, &man); err != nil {
		return fmt.Errorf("%w: manifest %s: %w", ErrNotCheckpoint, desc.Digest, err)
	}
	if desc.MediaType != ocispec.MediaTypeImageManifest || man.MediaType != ocispec.MediaTypeImageManifest ||
		man.ArtifactType != ArtifactType || man.Config.MediaType != ConfigMediaType {
		return fmt.Errorf("%w: manifest %s has media type %s, artifact type %s, config media type %s (want %q, %q, %q)",
			ErrNotCheckpoint, desc.Digest, quote.Value(man.MediaType), quote.Value(man.ArtifactType), quote.Value(man.Config.MediaType),
			ocispec.MediaTypeImageManifest, ArtifactType, ConfigMediaType)
	}
	files, sigLayer, err := splitLayers(man.Layers)
	if err != nil {
		return fmt.Errorf("manifest %s: %w", desc.Digest, err)
	}
	if err := checkLayers(files, opts.Limits.WithDefaults()); err != nil {
		return fmt.Errorf("manifest %s: %w", desc.Digest, err)
	}
	if man.Config.Size > checkpoint.MaxManifestBytes || man.Config.Size < 0 {
		return fmt.Errorf("manifest %s: %w: config of %d bytes", desc.Digest, checkpoint.ErrInvalidManifest, man.Config.Size)
	}

	pr := &progress{fn: opts.Progress, total: man.Config.Size}
	for _, l := range man.Layers {
		pr.total += l.Size
	}
	pr.start()
	config, err := fetchSmall(ctx, t, man.Config)
	if err != nil {
		return fmt.Errorf("fetch %s (%s): %w", checkpoint.ManifestFile, man.Config.Digest, err)
	}
	pr.add(int64(len(config)))
	m, err := checkpoint.ParseManifest(config)
	if err != nil {
		return fmt.Errorf("%s (%s): %w", checkpoint.ManifestFile, man.Config.Digest, err)
	}
	if err := matchLayers(files, m); err != nil {
		return fmt.Errorf("manifest %s: %w", desc.Digest, err)
	}
	var sig []byte
	if sigLayer != nil {
		if sig, err = fetchSmall(ctx, t, *sigLayer); err != nil {
			return fmt.Errorf("fetch %s (%s): %w", checkpoint.SignatureFile, sigLayer.Digest, err)
		}
		pr.add(int64(len(sig)))
	}

	// Everything that can be checked without the files was: create a staging directory beside
	// dir, so that nothing half-pulled or unverified is ever at dir.
	staging, err := stagingDir(dir)
	if err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			os.RemoveAll(staging)
		}
	}()
	root, err := os.OpenRoot(staging)
	if err != nil {
		return err
	}
	defer root.Close()
	if err := writeFile(root, checkpoint.ManifestFile, config); err != nil {
		return err
	}
	if sig != nil {
		if err := writeFile(root, checkpoint.SignatureFile, sig); err != nil {
			return err
		}
	}
	// the signature covers berth.json, which covers every file: check it before fetching them
	if opts.Verify != nil {
		if err := opts.Verify(ctx, staging); err != nil {
			return err
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.concurrency())
	for i, l := range files {
		p := m.Files[i].Path
		g.Go(func() error {
			if err := pullFile(gctx, t, root, l, p, pr); err != nil {
				return fmt.Errorf("fetch %s (%s, %d bytes): %w", p, l.Digest, l.Size, shortURL(err))
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	got, err := checkpoint.ReadManifest(staging)
	if err != nil {
		return err
	}
	if err := checkpoint.Verify(staging, got); err != nil {
		return err
	}
	if err := fsutil.RenameNoReplace(staging, dir); err != nil {
		return err
	}
	// Record the verification (<parent>/.verified/<name>.json), so that a shim restoring from
	// dir need not read every file again while they stay unchanged. Best effort: without the
	// stamp the shim verifies in full.
	_ = checkpoint.WriteStamp(dir, got)
	return nil
}

// StagingPrefix starts the name of the directory Pull fills beside its destination before it
// renames it into place: StagingPrefix + name + "-" + 16 hex digits.
const StagingPrefix = ".pulling-"

// stagingDir creates (mode 0700) a new, empty staging directory beside dir.
func stagingDir(dir string) (string, error) {
	var suffix [8]byte
	_, _ = rand.Read(suffix[:]) // never fails
	p := filepath.Join(filepath.Dir(dir), StagingPrefix+filepath.Base(dir)+"-"+hex.EncodeToString(suffix[:]))
	if err := os.Mkdir(p, 0o700); err != nil {
		return "", err
	}
	return p, nil
}

// splitLayers separates the file layers from the signature layer, which, when there is one, is
// the last layer, with media type SignatureMediaType and title berth.sig.
func splitLayers(layers []ocispec.Descriptor) (files []ocispec.Descriptor, sig *ocispec.Descriptor, err error) {
	for i, l := range layers {
		if l.MediaType != SignatureMediaType {
			continue
		}
		if i != len(layers)-1 || l.Annotations[ocispec.AnnotationTitle] != checkpoint.SignatureFile {
			return nil, nil, fmt.Errorf("%w: layers[%d] %s: a signature layer must be the last one, titled %q (it is titled %s)",
				ErrNotCheckpoint, i, l.Digest, checkpoint.SignatureFile, quote.Value(l.Annotations[ocispec.AnnotationTitle]))
		}
		if l.Size < 0 || l.Size > maxSignatureBytes {
			return nil, nil, fmt.Errorf("%w: %s layer of %d bytes (at most %d)", ErrNotCheckpoint, checkpoint.SignatureFile, l.Size, maxSignatureBytes)
		}
		return layers[:i], &layers[i], nil
	}
	return layers, nil, nil
}

// checkLayers checks what an OCI manifest says about the files before anything is fetched.
func checkLayers(layers []ocispec.Descriptor, lim archive.Limits) error {
	if len(layers) > lim.MaxEntries {
		return fmt.Errorf("%w: %d files (at most %d)", archive.ErrTooManyEntries, len(layers), lim.MaxEntries)
	}
	seen := make(map[string]bool, len(layers))
	var total int64
	for i, l := range layers {
		title, ok := l.Annotations[ocispec.AnnotationTitle]
		if l.MediaType != FileMediaType || !ok {
			return fmt.Errorf("%w: layers[%d] %s: media type %s, title %s", ErrNotCheckpoint, i, l.Digest, quote.Value(l.MediaType), quote.Value(title))
		}
		if !checkpoint.ValidFilePath(title) {
			return fmt.Errorf("layers[%d] %s: %w: not a clean relative path inside the checkpoint", i, quote.Value(title), archive.ErrUnsafePath)
		}
		if seen[title] {
			return fmt.Errorf("layers[%d] %s: %w", i, quote.Value(title), archive.ErrDuplicateEntry)
		}
		seen[title] = true
		if l.Size < 0 || l.Size > lim.MaxFileBytes {
			return fmt.Errorf("layers[%d] %s: %w: %d bytes (at most %d)", i, quote.Value(title), archive.ErrFileTooLarge, l.Size, lim.MaxFileBytes)
		}
		total += l.Size
		if total > lim.MaxTotalBytes {
			return fmt.Errorf("%w: more than %d bytes", archive.ErrTotalTooLarge, lim.MaxTotalBytes)
		}
	}
	return nil
}

// matchLayers checks that layers are exactly m's files, in order.
func matchLayers(layers []ocispec.Descriptor, m *checkpoint.Manifest) error {
	if len(layers) != len(m.Files) {
		return fmt.Errorf("%w: %d layers, %d files", ErrLayerMismatch, len(layers), len(m.Files))
	}
	for i, f := range m.Files {
		l := layers[i]
		if title := l.Annotations[ocispec.AnnotationTitle]; title != f.Path || l.Size != f.Size || l.Digest.String() != f.Digest {
			return fmt.Errorf("%w: layers[%d] is %s (%d bytes, %s), berth.json has %s (%d bytes, %s)",
				ErrLayerMismatch, i, quote.Value(title), l.Size, l.Digest, quote.Value(f.Path), f.Size, quote.Value(f.Digest))
		}
	}
	return nil
}

// fetchSmall fetches and verifies a blob read into memory (berth.json, berth.sig), whose size
// the caller bounded.
func fetchSmall(ctx context.Context, t *target, desc ocispec.Descriptor) ([]byte, error) {
	rc, err := t.repo.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := content.ReadAll(rc, desc)
	if err != nil {
		return nil, digestErr(err)
	}
	return data, nil
}

// writeFile writes a small file under root, mode 0600; it must not exist.
func writeFile(root *os.Root, name string, data []byte) error {
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// pullFile streams one blob into root/name (mode 0600, parents 0700), verifying its size and
// digest on the way.
func pullFile(ctx context.Context, t *target, root *os.Root, desc ocispec.Descriptor, name string, pr *progress) (retErr error) {
	if parent := path.Dir(name); parent != "." {
		if err := root.MkdirAll(parent, 0o700); err != nil {
			return err
		}
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err := f.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()
	rc, err := t.repo.Fetch(ctx, desc)
	if err != nil {
		return err
	}
	defer rc.Close()
	vr := content.NewVerifyReader(rc, desc)
	buf := make([]byte, 1<<20)
	if _, err := io.CopyBuffer(fsutil.WriterOnly{W: f}, reader{r: vr, p: pr}, buf); err != nil {
		return digestErr(err)
	}
	return digestErr(vr.Verify())
}

// digestErr adds checkpoint.ErrDigestMismatch to oras-go's digest and size verification errors, so a
// caller needs one sentinel for "the bytes are not what the digests say".
func digestErr(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, content.ErrMismatchedDigest) || errors.Is(err, content.ErrTrailingData) {
		return fmt.Errorf("%w: %w", checkpoint.ErrDigestMismatch, err)
	}
	return err
}
