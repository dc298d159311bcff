package transfer

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// makeCRIArchive writes, at dst, a CRI checkpoint archive as containerd's CRI plugin writes it
// for the berth runtime: the CRIU images and the shim's checkpoint/berth.json, then
// containerd's own files, which no manifest covers; berth.json is not the first entry.
// tamper, if set, changes a byte of checkpoint/pages-1.img after the manifest was written.
func makeCRIArchive(t testing.TB, dst string, tamper bool) {
	t.Helper()
	makeCRIArchiveSize(t, dst, 2<<20, tamper)
}

// makeCRIArchiveSize is makeCRIArchive with size bytes of CRIU images.
func makeCRIArchiveSize(t testing.TB, dst string, size int, tamper bool) {
	t.Helper()
	makeCRIArchiveWith(t, dst, size, tamper, nil)
}

// makeCRIArchiveWith is makeCRIArchiveSize with more files at the archive's top (planted: no
// manifest lists them).
func makeCRIArchiveWith(t testing.TB, dst string, size int, tamper bool, planted map[string]string) {
	t.Helper()
	dir := t.TempDir()
	makeCheckpoint(t, dir, size)
	if err := os.Remove(filepath.Join(dir, checkpoint.ManifestFile)); err != nil {
		t.Fatal(err)
	}
	images := filepath.Join(dir, checkpoint.ImagesDir)
	if err := checkpoint.WriteManifest(images, &checkpoint.Manifest{Container: checkpoint.ContainerInfo{ID: "c1", KubernetesNamespace: "ns"}}); err != nil {
		t.Fatal(err)
	}
	top := map[string]string{"config.dump": `{"id":"c1"}`, "rootfs-diff.tar": ""}
	for name, body := range planted {
		top[name] = body
	}
	for name, body := range top {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if tamper {
		p := filepath.Join(images, "pages-1.img")
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		b[10] ^= 1
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestCRIArchiveRoundTrip: a kubelet archive sent as it is arrives as a directory of the same
// layout, its CRIU images verified against checkpoint/berth.json, and Verify sees checkpoint/.
func TestCRIArchiveRoundTrip(t *testing.T) {
	tmp := t.TempDir()
	ar := filepath.Join(tmp, "checkpoint-infer_ns-infer-2026.tar")
	makeCRIArchive(t, ar, false)
	root := t.TempDir()
	var verified string
	addr, out := startReceiver(t, &Receiver{Root: root, Verify: func(_ context.Context, dir string) error {
		verified = dir
		return nil
	}})
	res, err := SendCRIArchive(context.Background(), dial(t, addr), ar, "ns-infer-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	o := wait(t, out)
	final := filepath.Join(root, "ns-infer-1")
	if o.err != nil || o.path != final || res.Path != final {
		t.Fatalf("receiver %v %q, sender %q; want %q", o.err, o.path, res.Path, final)
	}
	if fi, _ := os.Stat(ar); res.Bytes != fi.Size() {
		t.Errorf("sent %d bytes, the archive has %d", res.Bytes, fi.Size())
	}
	if !strings.HasSuffix(verified, string(filepath.Separator)+checkpoint.ImagesDir) {
		t.Errorf("Verify called on %q, want the staged checkpoint/", verified)
	}
	m, err := checkpoint.ReadManifest(filepath.Join(final, checkpoint.ImagesDir))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.Verify(filepath.Join(final, checkpoint.ImagesDir), m); err != nil {
		t.Error(err)
	}
	if used, err := checkpoint.VerifyStamped(filepath.Join(final, checkpoint.ImagesDir), m); err != nil || !used {
		t.Errorf("the receiver's stamp of checkpoint/: used %v, %v", used, err)
	}
	if b, err := os.ReadFile(filepath.Join(final, "config.dump")); err != nil || string(b) != `{"id":"c1"}` {
		t.Errorf("config.dump: %q %v", b, err)
	}
	assertRootClean(t, root, "ns-infer-1")
}

// TestCRIArchiveRefused: a tampered CRIU image, a verification that refuses, and files that are
// not CRI archives leave nothing under the root.
func TestCRIArchiveRefused(t *testing.T) {
	tmp := t.TempDir()
	tampered := filepath.Join(tmp, "tampered.tar")
	makeCRIArchive(t, tampered, true)
	good := filepath.Join(tmp, "good.tar")
	makeCRIArchive(t, good, false)
	root := t.TempDir()
	refuse := errors.New("no trusted key signed it")
	addr, out := startReceiver(t, &Receiver{Root: root, Verify: func(_ context.Context, dir string) error {
		if strings.Contains(dir, "untrusted") {
			return refuse
		}
		return nil
	}})

	_, err := SendCRIArchive(context.Background(), dial(t, addr), tampered, "tampered", nil)
	if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), "checkpoint/pages-1.img") {
		t.Errorf("tampered: %v, want ErrRejected naming checkpoint/pages-1.img", err)
	}
	if o := wait(t, out); !errors.Is(o.err, checkpoint.ErrDigestMismatch) {
		t.Errorf("receiver: %v, want ErrDigestMismatch", o.err)
	}
	// a signed archive with an unsigned file planted at its top (berth-rootfs-diff.tar, which a
	// restore once took): no receiver keeps it
	planted := filepath.Join(tmp, "planted.tar")
	makeCRIArchiveWith(t, planted, 2<<20, false, map[string]string{checkpoint.ImagesRootfsDiffFile: "#!/bin/sh\n"})
	_, err = SendCRIArchive(context.Background(), dial(t, addr), planted, "planted", nil)
	if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), checkpoint.ImagesRootfsDiffFile) {
		t.Errorf("planted: %v, want ErrRejected naming %s", err, checkpoint.ImagesRootfsDiffFile)
	}
	if o := wait(t, out); !errors.Is(o.err, checkpoint.ErrExtraFile) {
		t.Errorf("receiver: %v, want ErrExtraFile", o.err)
	}
	_, err = SendCRIArchive(context.Background(), dial(t, addr), good, "untrusted", nil)
	if !errors.Is(err, ErrRejected) || !strings.Contains(err.Error(), refuse.Error()) {
		t.Errorf("refused by Verify: %v", err)
	}
	if o := wait(t, out); !errors.Is(o.err, refuse) {
		t.Errorf("receiver: %v, want Verify's error", o.err)
	}
	assertRootClean(t, root)

	// not CRI archives: nothing is sent
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("x"))
	_ = zw.Close()
	plain := filepath.Join(tmp, "plain.tar")
	f, err := os.Create(plain)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	_ = tw.WriteHeader(&tar.Header{Name: "spec.dump", Mode: 0o600, Size: 2, Typeflag: tar.TypeReg})
	_, _ = tw.Write([]byte("{}"))
	_ = tw.Close()
	f.Close()
	zipped := filepath.Join(tmp, "zipped.tar")
	if err := os.WriteFile(zipped, gz.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{plain, zipped, tmp} {
		if _, err := SendCRIArchive(context.Background(), nil, p, "x", nil); !errors.Is(err, ErrNotCRIArchive) {
			t.Errorf("%s: %v, want ErrNotCRIArchive", filepath.Base(p), err)
		}
	}
}

// BenchmarkSendCRIArchiveTLS sends a 256 MiB CRI archive over mutual TLS on loopback, as the
// berth agents do (receiver without fsync): read, encrypt, decrypt, extract, hash, write, and the
// verdict. MB/s is the archive's size over the time SendCRIArchive takes. Run it pinned to one
// CPU (taskset -c 0) to see what the agents get on a node whose other cores are pinned.
func BenchmarkSendCRIArchiveTLS(b *testing.B) {
	const size = 256 << 20
	ar := filepath.Join(b.TempDir(), "checkpoint.tar")
	makeCRIArchiveSize(b, ar, size, false)
	fi, err := os.Stat(ar)
	if err != nil {
		b.Fatal(err)
	}
	ca := newTestCA(b, "ca")
	files := ca.node(b, "node")
	root := b.TempDir()
	addr, out := serve(b, &Receiver{Root: root, NoSync: true}, serverTLS(b, files))
	b.SetBytes(fi.Size())
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		conn, err := Dial(context.Background(), addr, clientTLS(b, files))
		if err != nil {
			b.Fatal(err)
		}
		res, err := SendCRIArchive(context.Background(), conn, ar, fmt.Sprintf("bench-%d", i), nil)
		conn.Close()
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if d := next(b, out); d.err != nil {
			b.Fatal(d.err)
		}
		if err := os.RemoveAll(res.Path); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
