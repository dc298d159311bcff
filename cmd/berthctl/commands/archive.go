package commands

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
)

// A checkpoint archive read in place: berth's own archives (berth.json at the top) and the
// kubelet's (the checkpoint API, `crictl checkpoint --export`), where the only berth manifest is
// the one the shim wrote and signed beside the CRIU images, checkpoint/berth.json. Nothing is
// extracted: the manifest and its signature are read from the tar (bounded), and --verify hashes
// the files the manifest covers as the tar streams by.

// maxArchiveEntries bounds how many tar headers are read in one pass over an archive.
const maxArchiveEntries = 1 << 17

// maxSignatureBytes bounds a berth.sig read from an archive, in bytes.
const maxSignatureBytes = 1 << 20

// archiveManifest is the berth manifest of a checkpoint archive.
type archiveManifest struct {
	// Dir is where in the archive the manifest lies: "" for a berth archive (berth.json at the
	// top), checkpoint.ImagesDir for a kubelet (CRI) archive, whose other files the manifest does
	// not cover.
	Dir      string
	Manifest *checkpoint.Manifest
	// Raw is berth.json byte for byte (what a signature covers); Sig is berth.sig beside it, nil
	// when the archive has none.
	Raw, Sig []byte
}

// covers says in words which files of the archive the manifest's digests (and so a signature)
// cover.
func (a *archiveManifest) covers() string {
	if a.Dir == "" {
		return "every file of the archive"
	}
	return "the CRIU images (" + a.Dir + "/) only: the rest of a kubelet archive (rootfs-diff.tar, spec.dump, config.dump) is written by containerd after the shim signed, is never read by a restore, and may hold nothing else"
}

// archiveName returns an entry's name, cleaned and relative ("./checkpoint/x" is "checkpoint/x").
func archiveName(h *tar.Header) string {
	return path.Clean(strings.TrimPrefix(h.Name, "./"))
}

// openArchive opens p as an uncompressed tar.
func openArchive(p string) (*os.File, *tar.Reader, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, nil, fmt.Errorf("checkpoint archive: %w", err)
	}
	magic := make([]byte, 2)
	if n, _ := io.ReadFull(f, magic); n == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		f.Close()
		return nil, nil, fmt.Errorf("checkpoint archive %s: gzip-compressed; decompress it first", p)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
	}
	return f, tar.NewReader(f), nil
}

// readSmall reads a regular tar entry of at most limit bytes.
func readSmall(p string, h *tar.Header, tr io.Reader, limit int64, sentinel error) ([]byte, error) {
	if h.Typeflag != tar.TypeReg {
		return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, h.Name, checkpoint.ErrUnsupportedFile)
	}
	if h.Size > limit {
		return nil, fmt.Errorf("checkpoint archive %s: %s: %w: %d bytes, more than %d", p, h.Name, sentinel, h.Size, limit)
	}
	b, err := io.ReadAll(io.LimitReader(tr, limit+1))
	if err != nil {
		return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, h.Name, err)
	}
	return b, nil
}

// readArchive reads the berth manifest of the tar archive p: the top-level berth.json when there
// is one, else checkpoint/berth.json (a kubelet archive), each with the berth.sig beside it. Only
// headers and those small files are read; file contents are skipped by seeking.
func readArchive(p string) (*archiveManifest, error) {
	f, tr, err := openArchive(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	found := map[string]*archiveManifest{} // by Dir
	get := func(dir string) *archiveManifest {
		if found[dir] == nil {
			found[dir] = &archiveManifest{Dir: dir}
		}
		return found[dir]
	}
	inner := path.Join(checkpoint.ImagesDir, checkpoint.ManifestFile)
	innerSig := path.Join(checkpoint.ImagesDir, checkpoint.SignatureFile)
	for i := 0; ; i++ {
		if i == maxArchiveEntries {
			return nil, fmt.Errorf("checkpoint archive %s: no %s in the first %d entries", p, checkpoint.ManifestFile, maxArchiveEntries)
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		top := found["."]
		if err != nil {
			if top != nil && top.Raw != nil {
				break // berth's archive: its manifest first, whatever follows
			}
			return nil, fmt.Errorf("checkpoint archive %s: %w", p, err)
		}
		name := archiveName(h)
		if top != nil && top.Raw != nil && name != checkpoint.SignatureFile {
			break // berth's archives hold berth.json and berth.sig first
		}
		dir := "."
		if strings.HasPrefix(name, checkpoint.ImagesDir+"/") {
			dir = checkpoint.ImagesDir
		}
		switch name {
		case checkpoint.ManifestFile, inner:
			b, err := readSmall(p, h, tr, checkpoint.MaxManifestBytes, checkpoint.ErrInvalidManifest)
			if err != nil {
				return nil, err
			}
			get(dir).Raw = b
		case checkpoint.SignatureFile, innerSig:
			b, err := readSmall(p, h, tr, maxSignatureBytes, signature.ErrBadSignature)
			if err != nil {
				return nil, err
			}
			get(dir).Sig = b
		}
	}
	a := found["."]
	if a == nil || a.Raw == nil {
		a = found[checkpoint.ImagesDir]
	}
	if a == nil || a.Raw == nil {
		return nil, fmt.Errorf("checkpoint archive %s: no %s and no %s (was it taken with the berth runtime handler?)", p, checkpoint.ManifestFile, inner)
	}
	if a.Dir == "." {
		a.Dir = ""
	}
	m, err := checkpoint.ParseManifest(a.Raw)
	if err != nil {
		return nil, fmt.Errorf("checkpoint archive %s: %s: %w", p, path.Join(a.Dir, checkpoint.ManifestFile), err)
	}
	a.Manifest = m
	return a, nil
}

// verifyArchive checks the archive p whose manifest readArchive returned: berth.sig must be the
// signature of a key that policy trusts (for the Kubernetes namespace the manifest records) over
// berth.json byte for byte, and every file under a.Dir must be the one the manifest lists (size
// and sha256), with none missing and none extra; in a kubelet archive, every other entry must be
// one of the files containerd writes beside checkpoint/ (checkpoint.CheckCRIEntry). It returns the signing key's id, "" when the
// archive passes only thanks to allow_unsigned (reported on warn).
func verifyArchive(ctx context.Context, policy *signature.Policy, p string, a *archiveManifest, warn io.Writer) (string, error) {
	// the policy verifies a directory: the two small files, in a private temporary one
	tmp, err := os.MkdirTemp("", "berthctl-verify-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := os.WriteFile(filepath.Join(tmp, checkpoint.ManifestFile), a.Raw, 0o600); err != nil {
		return "", err
	}
	if a.Sig != nil {
		if err := os.WriteFile(filepath.Join(tmp, checkpoint.SignatureFile), a.Sig, 0o600); err != nil {
			return "", err
		}
	}
	v, err := policy.Verify(ctx, tmp, a.Manifest.Container.KubernetesNamespace)
	if err != nil {
		return "", fmt.Errorf("checkpoint archive %s: %s: %w", p, path.Join(a.Dir, checkpoint.SignatureFile), unwrapTmp(err, tmp))
	}
	if v.Warning != nil {
		fmt.Fprintf(warn, "berthctl: warning: accepted only because allow_unsigned is set: %v\n", unwrapTmp(v.Warning, tmp))
	}
	if err := verifyArchiveDigests(p, a); err != nil {
		return "", err
	}
	return v.KeyID, nil
}

// unwrapTmp keeps err's chain but drops the temporary directory's name from its message.
func unwrapTmp(err error, tmp string) error {
	return tmpError{err: err, msg: strings.ReplaceAll(err.Error(), tmp+"/", "")}
}

type tmpError struct {
	err error
	msg string
}

func (e tmpError) Error() string { return e.msg }
func (e tmpError) Unwrap() error { return e.err }

// verifyArchiveDigests streams p and checks every regular file under a.Dir against a.Manifest.
func verifyArchiveDigests(p string, a *archiveManifest) error {
	f, tr, err := openArchive(p)
	if err != nil {
		return err
	}
	defer f.Close()
	want := make(map[string]checkpoint.File, len(a.Manifest.Files))
	for _, file := range a.Manifest.Files {
		want[file.Path] = file
	}
	seen := make(map[string]bool, len(want))
	buf := make([]byte, 1<<20)
	prefix := ""
	if a.Dir != "" {
		prefix = a.Dir + "/"
	}
	for i := 0; ; i++ {
		if i == maxArchiveEntries {
			return fmt.Errorf("checkpoint archive %s: more than %d entries", p, maxArchiveEntries)
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("checkpoint archive %s: %w", p, err)
		}
		name, ok := strings.CutPrefix(archiveName(h), prefix)
		if !ok {
			// a kubelet archive outside checkpoint/: containerd's files only, none of them read
			// by a restore (what the shim and a receiver refuse, --verify refuses too)
			if err := checkpoint.CheckCRIEntry(archiveName(h), h.Typeflag == tar.TypeDir); err != nil {
				return fmt.Errorf("checkpoint archive %s: %w", p, err)
			}
			if h.Typeflag != tar.TypeDir && h.Typeflag != tar.TypeReg {
				return fmt.Errorf("checkpoint archive %s: %s: %w", p, h.Name, checkpoint.ErrUnsupportedFile)
			}
			continue
		}
		if name == "." || name == checkpoint.ManifestFile || name == checkpoint.SignatureFile {
			continue
		}
		switch h.Typeflag {
		case tar.TypeDir:
			continue
		case tar.TypeReg:
		default:
			return fmt.Errorf("checkpoint archive %s: %s: %w", p, h.Name, checkpoint.ErrUnsupportedFile)
		}
		file, listed := want[name]
		if !listed {
			return fmt.Errorf("checkpoint archive %s: %s: %w: %d bytes", p, prefix+name, checkpoint.ErrExtraFile, h.Size)
		}
		if seen[name] {
			return fmt.Errorf("checkpoint archive %s: %s: %w: twice in the archive", p, prefix+name, checkpoint.ErrExtraFile)
		}
		seen[name] = true
		if h.Size != file.Size {
			return fmt.Errorf("checkpoint archive %s: %s: %w: manifest %d bytes, archive %d", p, prefix+name, checkpoint.ErrSizeMismatch, file.Size, h.Size)
		}
		sum := sha256.New()
		if _, err := io.CopyBuffer(sum, tr, buf); err != nil {
			return fmt.Errorf("checkpoint archive %s: %s: %w", p, h.Name, err)
		}
		if d := "sha256:" + hex.EncodeToString(sum.Sum(nil)); d != file.Digest {
			return fmt.Errorf("checkpoint archive %s: %s: %w: manifest %s archive %s", p, prefix+name, checkpoint.ErrDigestMismatch, file.Digest, d)
		}
	}
	for _, file := range a.Manifest.Files {
		if !seen[file.Path] {
			return fmt.Errorf("checkpoint archive %s: %s: %w (manifest size %d bytes)", p, prefix+file.Path, checkpoint.ErrMissingFile, file.Size)
		}
	}
	return nil
}

// isArchive reports whether p is a regular file (a checkpoint archive) rather than a directory.
func isArchive(p string) (bool, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return false, fmt.Errorf("checkpoint %s: %w", p, err)
	}
	switch {
	case fi.IsDir():
		return false, nil
	case fi.Mode().IsRegular():
		return true, nil
	}
	return false, fmt.Errorf("checkpoint %s: not a directory or a regular file", p)
}
