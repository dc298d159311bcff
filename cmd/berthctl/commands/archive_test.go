package commands

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
)

// kubeletArchive writes a tar laid out as the kubelet's checkpoint API writes one: the shim's
// signed checkpoint directory under checkpoint/ (berth.json and berth.sig beside the CRIU
// images), and containerd's files at the top, without a berth.json there. edit may change the
// CRIU images after signing.
func kubeletArchive(t *testing.T, tr *testTrust, edit func(images string)) string {
	t.Helper()
	return kubeletArchiveWith(t, tr, edit, nil)
}

// kubeletArchiveWith is kubeletArchive with more files at the archive's top (planted: no
// manifest lists them), after containerd's.
func kubeletArchiveWith(t *testing.T, tr *testTrust, edit func(images string), planted map[string][]byte) string {
	t.Helper()
	images := checkpointDir(t, checkpointFingerprint()) // the shim's directory
	if err := os.Remove(filepath.Join(images, checkpoint.SpecFile)); err != nil {
		t.Fatal(err)
	}
	files, size, err := checkpoint.DigestDir(images)
	if err != nil {
		t.Fatal(err)
	}
	m := &checkpoint.Manifest{Version: checkpoint.ManifestVersion, Fingerprint: checkpointFingerprint(), Files: files, ImageSize: size}
	m.Container.KubernetesNamespace = "team-a"
	if err := checkpoint.WriteManifest(images, m); err != nil {
		t.Fatal(err)
	}
	if tr != nil {
		tr.sign(t, images)
	}
	if edit != nil {
		edit(images)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, body []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(body)
	}
	add("config.dump", []byte(`{"id":"abc"}`))
	add("spec.dump", []byte("{}"))
	tw.WriteHeader(&tar.Header{Name: "checkpoint/", Mode: 0o700, Typeflag: tar.TypeDir})
	err = filepath.WalkDir(images, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		rel, _ := filepath.Rel(images, p)
		add("checkpoint/"+filepath.ToSlash(rel), b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	add("rootfs-diff.tar", make([]byte, 1024))
	for name, body := range planted {
		add(name, body)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "checkpoint-infer_ns-infer-2026.tar")
	if err := os.WriteFile(p, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestKubeletArchive: selector and inspect read a kubelet archive in place; inspect --verify
// checks the shim's signature and the CRIU images' digests from the tar, and refuses an unsigned,
// untrusted or changed one.
func TestKubeletArchive(t *testing.T) {
	tr := newTrust(t)
	run := func(c func(*Globals) *cobra.Command, g *Globals, args ...string) (string, error) {
		cmd := c(g)
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(io.Discard)
		cmd.SetArgs(args)
		err := cmd.ExecuteContext(context.Background())
		return out.String(), err
	}
	signed := kubeletArchive(t, tr, nil)
	if out, err := runSelector(t, "-o", "json", signed); err != nil || !strings.Contains(out, "berth.dev/fingerprint") {
		t.Errorf("selector of a kubelet archive: %q, %v", out, err)
	}
	out, err := run(CheckpointInspect, tr.g, signed)
	if err != nil || !strings.Contains(out, "checkpoint/berth.json of a kubelet archive") {
		t.Errorf("inspect: %q, %v", out, err)
	}
	out, err = run(CheckpointInspect, tr.g, "--verify", signed)
	if err != nil || !strings.Contains(out, "signed by") || !strings.Contains(out, "SHA256:") || !strings.Contains(out, "digests") {
		t.Errorf("inspect --verify: %q, %v", out, err)
	}
	if _, err := run(CheckpointInspect, newTrust(t).g, "--verify", signed); !errors.Is(err, signature.ErrUntrustedKey) {
		t.Errorf("inspect --verify on a node that does not trust the key: %v", err)
	}
	if _, err := run(CheckpointInspect, tr.g, "--verify", kubeletArchive(t, nil, nil)); !errors.Is(err, signature.ErrUnsigned) {
		t.Errorf("inspect --verify of an unsigned archive: %v", err)
	}
	// the pages changed after the shim signed: the signature still covers berth.json, whose digest
	// no longer matches
	changed := kubeletArchive(t, tr, func(images string) {
		os.WriteFile(filepath.Join(images, checkpoint.ImagesDir, "pages-1.img"), []byte(strings.Repeat("X", 4096)), 0o600)
	})
	if _, err := run(CheckpointInspect, tr.g, "--verify", changed); !errors.Is(err, checkpoint.ErrDigestMismatch) {
		t.Errorf("inspect --verify of changed pages: %v", err)
	}
	extra := kubeletArchive(t, tr, func(images string) {
		os.WriteFile(filepath.Join(images, "core-99.img"), []byte("x"), 0o600)
	})
	if _, err := run(CheckpointInspect, tr.g, "--verify", extra); !errors.Is(err, checkpoint.ErrExtraFile) {
		t.Errorf("inspect --verify of an added image: %v", err)
	}
	// a file planted at the top, where the shim once took berth-rootfs-diff.tar from (a shell
	// script as /bin/sh inside it), or any name containerd does not write
	for _, name := range []string{checkpoint.ImagesRootfsDiffFile, "run.sh"} {
		planted := kubeletArchiveWith(t, tr, nil, map[string][]byte{name: []byte("#!/bin/sh\n")})
		if _, err := run(CheckpointInspect, tr.g, "--verify", planted); !errors.Is(err, checkpoint.ErrExtraFile) || !strings.Contains(err.Error(), name) {
			t.Errorf("inspect --verify of %s planted at the top: %v, want ErrExtraFile naming it", name, err)
		}
	}
	// a forged berth.json (new digests) with the old signature
	forged := kubeletArchive(t, tr, func(images string) { forge(t, images) })
	if _, err := run(CheckpointInspect, tr.g, "--verify", forged); !errors.Is(err, signature.ErrBadSignature) {
		t.Errorf("inspect --verify of a forged manifest: %v", err)
	}
}
