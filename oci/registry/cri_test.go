package registry

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// makeCRIArchive writes a CRI checkpoint archive as `crictl checkpoint --export` leaves it for a
// container of the berth handler: checkpoint/ with the shim's berth.json covering only the CRIU
// images, and containerd's config.dump, spec.dump, rootfs-diff.tar, status beside it, unsigned.
// It returns the archive path. tamper, if set, changes a CRIU image after the shim signed it.
func makeCRIArchive(t *testing.T, tamper bool) string {
	t.Helper()
	base := t.TempDir()
	dir := filepath.Join(base, "cri")
	images := filepath.Join(dir, checkpoint.ImagesDir)
	if err := os.MkdirAll(images, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(p string, data string) {
		if err := os.WriteFile(filepath.Join(dir, filepath.FromSlash(p)), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("checkpoint/pages-1.img", strings.Repeat("p", 1<<16))
	write("checkpoint/core-1.img", "core")
	inner := &checkpoint.Manifest{
		Created:     time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC),
		Container:   checkpoint.ContainerInfo{ID: "task-id", Runtime: "io.containerd.berth.v2"},
		Fingerprint: fingerprint.Fingerprint{Arch: "amd64", Kernel: "6.1.0-test"},
		CRIU:        checkpoint.CRIUStats{PagesWritten: 16},
		Phases:      []checkpoint.Phase{{Name: "criu-dump", Ms: 12}},
		GPU: &checkpoint.GPUState{Driver: "580.65.06", CUDA: "12.8",
			Devices: []checkpoint.GPUDevice{{UUID: "GPU-node1-0", Name: "Fake H200", MemoryTotal: 4 << 30, MemoryUsed: 1 << 20}}},
	}
	if err := checkpoint.WriteManifest(images, inner); err != nil {
		t.Fatal(err)
	}
	if tamper {
		write("checkpoint/core-1.img", "CORE")
	}
	write(checkpoint.ConfigFile, `{"id":"3f2a","name":"infer","rootfsImage":"sha256:`+strings.Repeat("cd", 32)+`","rootfsImageRef":"sha256:`+strings.Repeat("ef", 32)+`","rootfsImageName":"localhost/berth/infer:e2e","runtime":"io.containerd.berth.v2","createdTime":"2026-05-01T11:00:00Z","checkpointedTime":"2026-05-01T12:00:00Z","restoredTime":"0001-01-01T00:00:00Z","restored":false}`)
	write(checkpoint.SpecFile, `{"ociVersion":"1.2.0","annotations":{"io.kubernetes.cri.sandbox-namespace":"default"}}`)
	write(checkpoint.RootfsDiffFile, "diff")
	write("status", `{"Pid":42}`)
	out := filepath.Join(base, "cri.tar")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := archive.Write(f, dir); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPushCRIArchive pushes a CRI checkpoint archive, whose only berth.json is the shim's
// checkpoint/berth.json: Push signs the whole archive, so the pulled checkpoint has a top-level
// berth.json covering every file (containerd's files and checkpoint/berth.json included), with
// the fingerprint, CRIU statistics and GPU state of the shim's manifest and the container of
// config.dump. An archive whose CRIU images changed after the shim signed them is refused.
func TestPushCRIArchive(t *testing.T) {
	r := startRegistry(t, "")
	ctx := testContext(t)
	src := makeCRIArchive(t, false)
	ref := r.ref("berth/cri:v1")
	if _, err := Push(ctx, src, ref, Options{PlainHTTP: true, TempDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "pulled")
	if err := Pull(ctx, ref, dir, Options{PlainHTTP: true}); err != nil {
		t.Fatal(err)
	}
	m, err := checkpoint.ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, f := range m.Files {
		paths = append(paths, f.Path)
	}
	want := []string{"checkpoint/berth.json", "checkpoint/core-1.img", "checkpoint/pages-1.img", "config.dump", "rootfs-diff.tar", "spec.dump", "status"}
	if !slices.Equal(paths, want) {
		t.Errorf("signed files %v, want %v", paths, want)
	}
	if c := m.Container; c.ID != "3f2a" || c.Image != "localhost/berth/infer:e2e" || c.ImageDigest != "sha256:"+strings.Repeat("ef", 32) || c.Runtime != "io.containerd.berth.v2" {
		t.Errorf("container %+v", c)
	}
	if m.Fingerprint.Kernel != "6.1.0-test" || m.CRIU.PagesWritten != 16 || m.GPU == nil || m.GPU.Devices[0].UUID != "GPU-node1-0" ||
		!m.Created.Equal(time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)) || len(m.Phases) != 1 {
		t.Errorf("signed manifest lost the shim's: %+v", m)
	}
	if err := checkpoint.Verify(dir, m); err != nil {
		t.Error(err)
	}

	// Resolve gives the digest a restore pulls by.
	desc, err := Resolve(ctx, ref, Options{PlainHTTP: true})
	if err != nil || desc.Digest == "" {
		t.Fatalf("Resolve: %+v %v", desc, err)
	}
	if _, err := Resolve(ctx, r.ref("berth/cri:nope"), Options{PlainHTTP: true}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("Resolve of an unknown tag: %v", err)
	}

	// Tampered CRIU images: refused before anything is uploaded.
	bad := makeCRIArchive(t, true)
	_, err = Push(ctx, bad, r.ref("berth/cri:bad"), Options{PlainHTTP: true})
	if !errors.Is(err, checkpoint.ErrSizeMismatch) && !errors.Is(err, checkpoint.ErrDigestMismatch) {
		t.Fatalf("push of a CRI archive with changed images: %v; want a digest mismatch", err)
	}
	if !strings.Contains(err.Error(), "checkpoint/core-1.img") {
		t.Errorf("error does not name the file: %v", err)
	}
	if _, err := Resolve(ctx, r.ref("berth/cri:bad"), Options{PlainHTTP: true}); err == nil {
		t.Error("the refused checkpoint was tagged")
	}

	// A CRI checkpoint directory (not an archive) is refused with a hint.
	_, err = Push(context.Background(), filepath.Join(filepath.Dir(src), "cri"), r.ref("berth/cri:dir"), Options{PlainHTTP: true})
	if !errors.Is(err, checkpoint.ErrNotCRICheckpoint) || !strings.Contains(err.Error(), "push the archive") {
		t.Errorf("push of a CRI directory: %v", err)
	}
}
