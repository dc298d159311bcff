package registry

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

const (
	testUser     = "berth"
	testPassword = "berth-test-password" // testdata/htpasswd
)

// makeCheckpoint writes a checkpoint directory of about 6 MiB in the kubelet/berth layout, with
// its berth.json, and returns it.
func makeCheckpoint(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "ckpt")
	random := func(n int) []byte {
		b := make([]byte, n)
		if _, err := rand.Read(b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	files := map[string][]byte{
		"checkpoint/pages-1.img":     random(4 << 20),
		"checkpoint/pages-2.img":     random(1 << 20),
		"checkpoint/pagemap-1.img":   random(3000),
		"checkpoint/core-1.img":      []byte("core"),
		"checkpoint/core-2.img":      []byte("core"), // same content as core-1: one blob
		"checkpoint/empty.img":       nil,
		"checkpoint/nested/deep.img": random(100),
		"spec.dump":                  []byte(`{"ociVersion":"1.2.0"}`),
		"config.dump":                []byte(`{"id":"infer"}`),
		"rootfs-diff.tar":            random(700 << 10),
		"dump.log":                   []byte("(00.000000) Dumping finished successfully\n"),
	}
	for p, data := range files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m := &checkpoint.Manifest{
		Created: time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC),
		Container: checkpoint.ContainerInfo{ID: "infer", Namespace: "k8s.io", Image: "example.com/infer:v1",
			ImageDigest: "sha256:" + strings.Repeat("ab", 32)},
		Fingerprint: fingerprint.Fingerprint{Arch: "amd64", Kernel: "6.1.0-test"},
	}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	return dir
}

// sameCheckpoint fails unless got has the same berth.json bytes and files as want.
func sameCheckpoint(t *testing.T, want, got string) {
	t.Helper()
	wantManifest, err := os.ReadFile(filepath.Join(want, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	gotManifest, err := os.ReadFile(filepath.Join(got, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(wantManifest, gotManifest) {
		t.Fatalf("berth.json differs after the round trip")
	}
	wantFiles, _, err := checkpoint.DigestDir(want)
	if err != nil {
		t.Fatal(err)
	}
	gotFiles, _, err := checkpoint.DigestDir(got)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(wantFiles, gotFiles) {
		t.Fatalf("files differ:\nwant %v\ngot  %v", wantFiles, gotFiles)
	}
	// root only: checkpoints hold process memory
	err = filepath.WalkDir(got, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if perm := info.Mode().Perm(); perm&0o077 != 0 {
			t.Errorf("%s: mode %v, want no group or other bits", p, perm)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// progressRecorder records Progress calls and checks they never go backwards.
type progressRecorder struct {
	mu          sync.Mutex
	t           *testing.T
	calls       int
	done, total int64
}

func (p *progressRecorder) fn(done, total int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if done < p.done || (p.calls > 0 && total != p.total) || done > total {
		p.t.Errorf("progress went from %d/%d to %d/%d", p.done, p.total, done, total)
	}
	p.calls++
	p.done, p.total = done, total
}

func (p *progressRecorder) complete(t *testing.T) {
	t.Helper()
	if p.calls == 0 || p.done != p.total || p.total == 0 {
		t.Fatalf("progress ended at %d of %d bytes after %d calls", p.done, p.total, p.calls)
	}
}

func TestPushPullRoundTrip(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	src := makeCheckpoint(t)
	m, err := checkpoint.ReadManifest(src)
	if err != nil {
		t.Fatal(err)
	}
	ref := r.ref("berth/infer:ckpt-1")

	pushed := &progressRecorder{t: t}
	desc, err := Push(ctx, src, ref, Options{PlainHTTP: true, Progress: pushed.fn})
	if err != nil {
		t.Fatal(err)
	}
	pushed.complete(t)
	if desc.MediaType != ocispec.MediaTypeImageManifest || desc.ArtifactType != ArtifactType {
		t.Fatalf("pushed descriptor %+v", desc)
	}
	berthJSON, _ := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	// config + distinct file contents (core-1 and core-2 share one)
	if want := int64(len(berthJSON)) + m.ImageSize - 4; pushed.total != want {
		t.Errorf("push progress total %d bytes, want %d", pushed.total, want)
	}

	// The artifact as the registry has it: the layout of the package documentation.
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	rd, rc, err := repo.FetchReference(ctx, "ckpt-1")
	if err != nil {
		t.Fatal(err)
	}
	var man ocispec.Manifest
	err = json.NewDecoder(rc).Decode(&man)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	if rd.Digest != desc.Digest {
		t.Errorf("tag resolves to %s, Push returned %s", rd.Digest, desc.Digest)
	}
	if man.ArtifactType != ArtifactType || man.Config.MediaType != ConfigMediaType ||
		man.Config.Digest != digest.FromBytes(berthJSON) || len(man.Layers) != len(m.Files) {
		t.Fatalf("manifest %+v", man)
	}
	for i, l := range man.Layers {
		f := m.Files[i]
		if l.MediaType != FileMediaType || l.Annotations[ocispec.AnnotationTitle] != f.Path ||
			l.Digest.String() != f.Digest || l.Size != f.Size {
			t.Errorf("layers[%d] = %+v, file %+v", i, l, f)
		}
	}
	wantAnn := map[string]string{
		ocispec.AnnotationCreated:    "2026-05-01T12:00:00Z",
		AnnotationContainerID:        "infer",
		AnnotationContainerNamespace: "k8s.io",
		AnnotationImage:              "example.com/infer:v1",
		AnnotationImageDigest:        m.Container.ImageDigest,
		AnnotationFingerprintHash:    m.Fingerprint.Hash(),
	}
	for k, v := range wantAnn {
		if man.Annotations[k] != v {
			t.Errorf("annotation %s = %q, want %q", k, man.Annotations[k], v)
		}
	}

	// Pull by tag and by digest.
	for _, pullRef := range []string{ref, r.ref("berth/infer@" + desc.Digest.String())} {
		dst := filepath.Join(t.TempDir(), "pulled")
		pulled := &progressRecorder{t: t}
		if err := Pull(ctx, pullRef, dst, Options{PlainHTTP: true, Progress: pulled.fn, Concurrency: 3}); err != nil {
			t.Fatal(err)
		}
		pulled.complete(t)
		if want := int64(len(berthJSON)) + m.ImageSize; pulled.total != want {
			t.Errorf("pull progress total %d bytes, want %d", pulled.total, want)
		}
		sameCheckpoint(t, src, dst)
	}

	// The same checkpoint as an archive file (plain and gzip) is the same artifact.
	tarPath := filepath.Join(t.TempDir(), "ckpt.tar")
	f, err := os.Create(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := archive.Write(f, src); err != nil {
		t.Fatal(err)
	}
	f.Close()
	again := &progressRecorder{t: t}
	desc2, err := Push(ctx, tarPath, r.ref("berth/infer:from-archive"), Options{PlainHTTP: true, Progress: again.fn})
	if err != nil {
		t.Fatal(err)
	}
	if desc2.Digest != desc.Digest {
		t.Errorf("archive pushed as %s, directory as %s", desc2.Digest, desc.Digest)
	}
	again.complete(t) // every blob already there: counted as done

	// A pull into an existing directory is refused and leaves it alone.
	existing := t.TempDir()
	err = Pull(ctx, ref, existing, Options{PlainHTTP: true})
	if !errors.Is(err, fs.ErrExist) {
		t.Fatalf("pull into an existing directory: %v, want fs.ErrExist", err)
	}

	// An unknown tag names the registry and the reference.
	err = Pull(ctx, r.ref("berth/infer:nope"), filepath.Join(t.TempDir(), "x"), Options{PlainHTTP: true})
	if err == nil || !strings.Contains(err.Error(), "registry "+r.addr) || !strings.Contains(err.Error(), "berth/infer:nope") {
		t.Fatalf("pull of an unknown tag: %v", err)
	}
}

func TestBasicAuth(t *testing.T) {
	r := startRegistry(t, "testdata/htpasswd")
	ctx := testContext(t)
	src := makeCheckpoint(t)
	ref := r.ref("berth/auth:v1")

	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"anonymous", Options{PlainHTTP: true}},
		{"wrong password", Options{PlainHTTP: true, Username: testUser, Password: "wrong"}},
		{"unknown user", Options{PlainHTTP: true, Username: "mallory", Password: testPassword}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Push(ctx, src, ref, tc.opts)
			if err == nil {
				t.Fatal("push succeeded")
			}
			if !errors.Is(err, ErrUnauthorized) || !strings.Contains(err.Error(), "registry "+r.addr) {
				t.Fatalf("push error is not ErrUnauthorized naming the registry: %v", err)
			}
			t.Logf("push: %v", err)
		})
	}
	right := Options{PlainHTTP: true, Username: testUser, Password: testPassword}
	if _, err := Push(ctx, src, ref, right); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "pulled")
	err := Pull(ctx, ref, dst, Options{PlainHTTP: true, Username: testUser, Password: "wrong"})
	if !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("pull with a wrong password: %v", err)
	}
	noDir(t, dst)
	if err := Pull(ctx, ref, dst, right); err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, src, dst)

	// Credentials from a Docker config.json.
	cfg := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte(testUser + ":" + testPassword))
	if err := os.WriteFile(cfg, fmt.Appendf(nil, `{"auths":{%q:{"auth":%q}}}`, r.addr, auth), 0o600); err != nil {
		t.Fatal(err)
	}
	dst2 := filepath.Join(t.TempDir(), "pulled")
	if err := Pull(ctx, ref, dst2, Options{PlainHTTP: true, DockerConfig: cfg}); err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, src, dst2)
}

func TestRegistryGoesAwayMidPush(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	src := makeCheckpoint(t)
	ref := r.ref("berth/flaky:v1")

	var killed atomic.Bool
	_, err := Push(ctx, src, ref, Options{PlainHTTP: true, Concurrency: 2, Progress: func(done, total int64) {
		if done > 1<<20 && !killed.Swap(true) {
			r.kill()
		}
	}})
	if !killed.Load() {
		t.Fatal("the registry was never killed")
	}
	if err == nil {
		t.Fatal("push succeeded although the registry went away")
	}
	if !strings.Contains(err.Error(), "registry "+r.addr) {
		t.Fatalf("error does not name the registry: %v", err)
	}
	t.Logf("push: %v", err)

	// Same storage, same address: a second push completes (sending only what is missing).
	r.start()
	if _, err := Push(ctx, src, ref, Options{PlainHTTP: true}); err != nil {
		t.Fatalf("push after the registry came back: %v\n%s", err, r.log())
	}
	dst := filepath.Join(t.TempDir(), "pulled")
	if err := Pull(ctx, ref, dst, Options{PlainHTTP: true}); err != nil {
		t.Fatal(err)
	}
	sameCheckpoint(t, src, dst)

	// And mid-pull: an error naming the registry, and no directory left.
	killed.Store(false)
	dst2 := filepath.Join(t.TempDir(), "pulled")
	err = Pull(ctx, ref, dst2, Options{PlainHTTP: true, Concurrency: 2, Progress: func(done, total int64) {
		if done > 1<<20 && !killed.Swap(true) {
			r.kill()
		}
	}})
	if !killed.Load() || err == nil || !strings.Contains(err.Error(), "registry "+r.addr) {
		t.Fatalf("pull from a registry that went away (killed: %v): %v", killed.Load(), err)
	}
	t.Logf("pull: %v", err)
	noDir(t, dst2)
}

func TestPullTamperedBlob(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	src := makeCheckpoint(t)
	m, err := checkpoint.ReadManifest(src)
	if err != nil {
		t.Fatal(err)
	}
	berthJSON, _ := os.ReadFile(filepath.Join(src, checkpoint.ManifestFile))
	var pages string
	for _, f := range m.Files {
		if f.Path == "checkpoint/pages-2.img" {
			pages = f.Digest
		}
	}
	for _, tc := range []struct{ name, digest string }{
		{"pages image", pages},
		{"berth.json", digest.FromBytes(berthJSON).String()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ref := r.ref("berth/tampered-" + strings.ReplaceAll(tc.name, " ", "-") + ":v1")
			if _, err := Push(ctx, src, ref, Options{PlainHTTP: true}); err != nil {
				t.Fatal(err)
			}
			// flip one byte in the registry's storage, keeping the size
			blob := r.blobPath(tc.digest)
			data, err := os.ReadFile(blob)
			if err != nil {
				t.Fatal(err)
			}
			orig := slices.Clone(data)
			data[len(data)/2] ^= 0xff
			if err := os.WriteFile(blob, data, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.WriteFile(blob, orig, 0o644) })

			dst := filepath.Join(t.TempDir(), "pulled")
			err = Pull(ctx, ref, dst, Options{PlainHTTP: true})
			if !errors.Is(err, checkpoint.ErrDigestMismatch) {
				t.Fatalf("pull of a tampered blob: %v, want checkpoint.ErrDigestMismatch", err)
			}
			t.Logf("pull: %v", err)
			noDir(t, dst)
		})
	}
}

// pushRaw pushes an artifact made by hand: blobs (content by digest) and a manifest.
func pushRaw(t *testing.T, ctx context.Context, ref string, man ocispec.Manifest, blobs ...[]byte) {
	t.Helper()
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	for _, b := range blobs {
		d := ocispec.Descriptor{MediaType: "application/octet-stream", Digest: digest.FromBytes(b), Size: int64(len(b))}
		if ok, _ := repo.Exists(ctx, d); ok {
			continue
		}
		if err := repo.Push(ctx, d, bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
	}
	body, err := json.Marshal(man)
	if err != nil {
		t.Fatal(err)
	}
	d := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(body), Size: int64(len(body))}
	if err := repo.PushReference(ctx, d, bytes.NewReader(body), repo.Reference.Reference); err != nil {
		t.Fatal(err)
	}
}

// TestPullRefusesBeforeWriting pulls hostile or foreign artifacts: each is refused before the
// destination directory is created, so nothing is written anywhere.
func TestPullRefusesBeforeWriting(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)

	evil := []byte("evil")
	// A berth.json that lists "evil" (a valid path), so only the layer title is wrong.
	bm := &checkpoint.Manifest{Version: checkpoint.ManifestVersion, ImageSize: int64(len(evil)),
		Files: []checkpoint.File{{Path: "evil", Size: int64(len(evil)), Digest: digest.FromBytes(evil).String()}}}
	config, err := json.Marshal(bm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := checkpoint.ParseManifest(config); err != nil {
		t.Fatal(err)
	}
	layer := func(title string) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: FileMediaType, Digest: digest.FromBytes(evil), Size: int64(len(evil)),
			Annotations: map[string]string{ocispec.AnnotationTitle: title}}
	}
	manifest := func(layers ...ocispec.Descriptor) ocispec.Manifest {
		return ocispec.Manifest{
			Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
			ArtifactType: ArtifactType,
			Config:       ocispec.Descriptor{MediaType: ConfigMediaType, Digest: digest.FromBytes(config), Size: int64(len(config))},
			Layers:       layers,
		}
	}
	foreign := manifest(layer("evil"))
	foreign.ArtifactType = "application/vnd.example.other"
	for _, tc := range []struct {
		name string
		man  ocispec.Manifest
		lim  archive.Limits
		want error
	}{
		{"dotdot title", manifest(layer("../evil")), archive.Limits{}, archive.ErrUnsafePath},
		{"nested dotdot title", manifest(layer("checkpoint/../../evil")), archive.Limits{}, archive.ErrUnsafePath},
		{"absolute title", manifest(layer("/tmp/evil")), archive.Limits{}, archive.ErrUnsafePath},
		{"berth.json title", manifest(layer(checkpoint.ManifestFile)), archive.Limits{}, archive.ErrUnsafePath},
		{"duplicate title", manifest(layer("evil"), layer("evil")), archive.Limits{}, archive.ErrDuplicateEntry},
		{"layer not in berth.json", manifest(layer("other")), archive.Limits{}, ErrLayerMismatch},
		{"foreign artifact", foreign, archive.Limits{}, ErrNotCheckpoint},
		{"too many files", manifest(layer("evil"), layer("evil2")), archive.Limits{MaxEntries: 1}, archive.ErrTooManyEntries},
		{"file too large", manifest(layer("evil")), archive.Limits{MaxFileBytes: 3}, archive.ErrFileTooLarge},
		{"total too large", manifest(layer("evil")), archive.Limits{MaxTotalBytes: 3}, archive.ErrTotalTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tag := strings.ReplaceAll(tc.name, " ", "-")
			ref := r.ref("berth/hostile:" + tag)
			pushRaw(t, ctx, ref, tc.man, config, evil)
			parent := t.TempDir()
			dst := filepath.Join(parent, "sub", "pulled")
			if err := os.Mkdir(filepath.Dir(dst), 0o700); err != nil {
				t.Fatal(err)
			}
			err := Pull(ctx, ref, dst, Options{PlainHTTP: true, Limits: tc.lim})
			if !errors.Is(err, tc.want) {
				t.Fatalf("pull: %v, want %v", err, tc.want)
			}
			t.Logf("pull: %v", err)
			noDir(t, dst)
			for _, p := range []string{filepath.Join(parent, "evil"), filepath.Join(parent, "sub", "evil")} {
				noDir(t, p)
			}
		})
	}
}
