package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ctroci "github.com/containerd/containerd/v2/pkg/oci"
	"google.golang.org/protobuf/proto"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// Each case of TestTrust is an attack that restored before berth checked signatures and
// privileges (issue 9); each must now be refused before anything is created, naming why, and
// leave the checkpoint as it was. The legitimate restores around them keep working.
//
// One CRI checkpoint (the kubelet's path: crictl checkpoint --export, signed by node1's shim) of
// the workload in Kubernetes namespace "default" is the material: restored as it is, edited, and
// re-packed. A second one is of a privileged container (uid 0, every capability).

// trustMarker is a file the source container writes into its root filesystem, trustDeleted one
// of its image it deletes, before the checkpoint.
const trustMarker, trustDeleted = "var/berth-trust-marker", "etc/nsswitch.conf"

// trustSecurity are CRI security contexts (linux.security_context of a container config).
const (
	// trustPlain is the workload's ordinary context: root, the runtime's default capabilities.
	trustPlain = `{"namespace_options": {"pid": 1}}`
	// trustPrivileged is uid 0 with every capability.
	trustPrivileged = `{"namespace_options": {"pid": 1}, "run_as_user": {"value": 0}, "capabilities": {"add_capabilities": ["ALL"]}}`
	// trustHardened is a restricted pod's: every capability dropped, uid 1000, no_new_privs,
	// seccomp RuntimeDefault (profile_type 0).
	trustHardened = `{"namespace_options": {"pid": 1}, "run_as_user": {"value": 1000}, "capabilities": {"drop_capabilities": ["ALL"]}, "no_new_privs": true, "seccomp": {"profile_type": 0}}`
)

// trustContainer creates (not starts) a workload container named name in pod with the given
// security context and annotations, and returns its id.
func trustContainer(t *testing.T, ctx context.Context, n *node.Node, dir, pod, podName, name, security string, annotations map[string]string) string {
	t.Helper()
	ann, _ := json.Marshal(annotations)
	cfg := fmt.Sprintf(`{"metadata": {"name": %q}, "image": {"image": %q},
 "command": [%q, "-listen", "127.0.0.1:8080", "-weights-mib", "16", "-delay-ms", "0"],
 "annotations": %s, "log_path": %q, "linux": {"security_context": %s}}`,
		name, image.WorkloadRef, image.WorkloadBinary, ann, name+".log", security)
	p := filepath.Join(dir, podName+"-"+name+".json")
	fltNoErr(t, os.WriteFile(p, []byte(cfg), 0o644))
	id, err := n.Crictl(ctx, "create", pod, p, filepath.Join(dir, podName+".json"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = n.Crictl(context.Background(), "rm", "-f", id) })
	return id
}

// trustRestore creates a container restoring ref in pod and starts it; it returns crictl
// start's error (nil when restored), and removes a container that did not start.
func trustRestore(t *testing.T, ctx context.Context, n *node.Node, dir, pod, podName, name, security, ref string) (string, error) {
	t.Helper()
	id := trustContainer(t, ctx, n, dir, pod, podName, name, security, map[string]string{oci.AnnotationRestoreFrom: ref})
	_, err := n.Crictl(ctx, "start", id)
	if err != nil {
		_, _ = n.Crictl(ctx, "rm", "-f", id)
	}
	return id, err
}

// trustRefused checks that err refuses, naming every want, and that the refusal left no
// extracted archive behind.
func trustRefused(t *testing.T, n *node.Node, what string, err error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: restored; want a refusal", what)
	}
	msg := strings.ReplaceAll(err.Error(), `\"`, `"`) // crictl quotes the runtime's message
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("%s: error does not name %q:\n%v", what, w, err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(n.CheckpointRoot, ".restore-*")); len(left) > 0 {
		t.Errorf("%s: extraction left behind: %v", what, left)
	}
	t.Logf("%s: refused: %s", what, trustCut(err.Error(), 2000))
}

func trustCut(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// trustExtract extracts the archive src into a new directory dst.
func trustExtract(t *testing.T, src, dst string) {
	t.Helper()
	f, err := os.Open(src)
	fltNoErr(t, err)
	defer f.Close()
	fltNoErr(t, archive.Extract(f, dst, archive.Limits{}))
}

// trustForge edits a checkpoint's CRIU images as an attacker would: every thread's credentials
// get every capability (core-*.img, rewritten with go-criu's bindings), and a byte of its memory
// (pages-1.img) changes; then the digests and berth.json of the directory that holds berth.json
// are written again. The old berth.sig stays.
func trustForge(t *testing.T, dir, images string) {
	t.Helper()
	cores, _ := filepath.Glob(filepath.Join(images, "core-*.img"))
	if len(cores) == 0 {
		t.Fatalf("no core images in %s", images)
	}
	for _, p := range cores {
		b, err := os.ReadFile(p)
		fltNoErr(t, err)
		if len(b) < 12 {
			t.Fatalf("%s: %d bytes", p, len(b))
		}
		// two magics, then one entry: size and a CoreEntry
		size := int(uint32(b[8]) | uint32(b[9])<<8 | uint32(b[10])<<16 | uint32(b[11])<<24)
		var core criucore.CoreEntry
		fltNoErr(t, proto.Unmarshal(b[12:12+size], &core))
		if c := core.GetThreadCore().GetCreds(); c != nil {
			all := []uint32{0xffffffff, 0x1ff}
			c.CapEff, c.CapPrm, c.CapBnd, c.CapInh = all, all, all, all
		}
		raw, err := proto.Marshal(&core)
		fltNoErr(t, err)
		out := append(append([]byte{}, b[:8]...), byte(len(raw)), byte(len(raw)>>8), byte(len(raw)>>16), byte(len(raw)>>24))
		out = append(out, raw...)
		fltNoErr(t, os.WriteFile(p, append(out, b[12+size:]...), 0o600))
	}
	pages := filepath.Join(images, "pages-1.img")
	fltFlipByte(t, pages, fltFileSize(t, pages)/2)
	m, err := checkpoint.ReadManifest(dir)
	fltNoErr(t, err)
	m.Files, m.ImageSize = nil, 0
	fltNoErr(t, checkpoint.WriteManifest(dir, m))
}

// trustKey writes a key pair an attacker made under dir and returns it.
func trustKey(t *testing.T, dir string) *signature.Key {
	t.Helper()
	priv, pub := filepath.Join(dir, "attacker.key"), filepath.Join(dir, "attacker.pub")
	fltNoErr(t, node.WriteKeyPair(priv, pub))
	k, err := signature.LoadKey(priv)
	fltNoErr(t, err)
	return k
}

// trustTar is an uncompressed tar of the named regular files (mode 0755).
func trustTar(t *testing.T, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		fltNoErr(t, tw.WriteHeader(&tar.Header{Name: name, Mode: 0o755, Size: int64(len(body)), Typeflag: tar.TypeReg}))
		_, err := tw.Write([]byte(body))
		fltNoErr(t, err)
	}
	fltNoErr(t, tw.Close())
	return buf.Bytes()
}

// trustBomb is a gzipped tar holding one file of size zero bytes (1 GiB is about 1 MB).
func trustBomb(t *testing.T, size int64) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	tw := tar.NewWriter(zw)
	fltNoErr(t, tw.WriteHeader(&tar.Header{Name: "var/lib/bomb", Mode: 0o644, Size: size, Typeflag: tar.TypeReg}))
	zero := make([]byte, 4<<20)
	for left := size; left > 0; left -= int64(len(zero)) {
		_, err := tw.Write(zero[:min(left, int64(len(zero)))])
		fltNoErr(t, err)
	}
	fltNoErr(t, tw.Close())
	fltNoErr(t, zw.Close())
	return buf.Bytes()
}

func TestTrust(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		fltNoErr(t, n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]))
	}
	dir := t.TempDir()
	root := dst.CheckpointRoot
	srcKey, err := src.Key()
	fltNoErr(t, err)

	// the material: a CRI checkpoint of the workload in namespace "default", and one of a
	// privileged container, both taken by node1's shim (signed with node1's key)
	take := func(podName, security, archiveName string) string {
		pod := criPod(t, ctx, src, dir, podName, "default")
		id := trustContainer(t, ctx, src, dir, pod, podName, "infer", security, nil)
		if _, err := src.Crictl(ctx, "start", id); err != nil {
			t.Fatal(err)
		}
		pid := criPID(t, ctx, src, id)
		tgt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(pid)}
		fltNoErr(t, client.WaitReady(ctx, tgt, 100*time.Millisecond))
		// the container's own writes to its root filesystem: a file added, one of the image deleted
		croot := fmt.Sprintf("/proc/%d/root", pid)
		fltNoErr(t, os.WriteFile(filepath.Join(croot, trustMarker), []byte(podName), 0o644))
		fltNoErr(t, os.Remove(filepath.Join(croot, trustDeleted)))
		p := filepath.Join(root, archiveName)
		if out, err := src.Crictl(ctx, "checkpoint", "--export="+p, id); err != nil {
			t.Fatalf("crictl checkpoint: %v %s", err, out)
		}
		t.Cleanup(func() { os.Remove(p) })
		_, _ = src.Crictl(ctx, "stop", "-t", "0", id)
		return p
	}
	plain := take("trust-src", trustPlain, "trust-plain.tar")
	privileged := take("trust-priv", trustPrivileged, "trust-priv.tar")
	plainSums := fltDigests(t, plain)
	// the shim signed the CRIU images it wrote, with node1's key
	ex := filepath.Join(dir, "plain-x")
	trustExtract(t, plain, ex)
	if v, err := signature.LoadPolicy(signature.TrustConfig{TrustedKeys: []signature.TrustedKey{{Path: src.PublicKey}}}); err != nil {
		t.Fatal(err)
	} else if got, err := v.Verify(ctx, filepath.Join(ex, checkpoint.ImagesDir), "default"); err != nil || got.KeyID != srcKey.ID {
		t.Fatalf("the CRI checkpoint's images are not signed by node1: %+v %v", got, err)
	}
	m, err := checkpoint.ReadManifest(filepath.Join(ex, checkpoint.ImagesDir))
	fltNoErr(t, err)
	if m.Container.KubernetesNamespace != "default" || m.Container.Pod != "trust-src" || m.Container.ContainerName != "infer" || m.Security == nil {
		t.Errorf("the shim's manifest records %+v, security %v", m.Container, m.Security)
	}
	if _, err := os.Stat(filepath.Join(ex, checkpoint.ImagesDir, checkpoint.ImagesRootfsDiffFile)); err != nil {
		t.Errorf("no rootfs diff of the shim's beside the images: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(ex, checkpoint.ImagesDir, "pages-1.img")); err == nil && fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("pages-1.img is mode %v", fi.Mode().Perm())
	}

	podA := criPod(t, ctx, dst, dir, "trust-dst", "default")

	t.Run("legitimate CRI restore", func(t *testing.T) {
		id, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", "legit", trustPlain, filepath.Base(plain))
		if err != nil {
			t.Fatalf("restore of a checkpoint node1 signed: %v", err)
		}
		pid := criPID(t, ctx, dst, id)
		tgt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(pid)}
		if _, err := client.Stats(ctx, tgt); err != nil {
			t.Errorf("restored workload does not answer: %v", err)
		}
		// the rootfs diff applied is the shim's signed copy (containerd's rootfs-diff.tar is covered
		// by no signature): the source's writes are there
		croot := fmt.Sprintf("/proc/%d/root", pid)
		if b, err := os.ReadFile(filepath.Join(croot, trustMarker)); err != nil || string(b) != "trust-src" {
			t.Errorf("%s in the restored container: %q %v", trustMarker, b, err)
		}
		if _, err := os.Stat(filepath.Join(croot, trustDeleted)); !os.IsNotExist(err) {
			t.Errorf("%s, deleted in the source, is in the restored container: %v", trustDeleted, err)
		}
		_, _ = dst.Crictl(ctx, "stop", "-t", "0", id)
	})

	t.Run("privileged checkpoint into an unprivileged pod", func(t *testing.T) {
		sums := fltDigests(t, privileged)
		_, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", "priv", trustHardened, filepath.Base(privileged))
		trustRefused(t, dst, "privileged into unprivileged", err,
			"exceeds what the destination spec grants", "process 1 (", "uid: 0, destination 1000")
		fltRequireSums(t, privileged, sums, "")
	})

	// forged: credentials (every capability) and memory edited, digests and berth.json
	// regenerated; as a directory and as an archive; the old signature, none, or the attacker's
	forged := filepath.Join(root, "trust-forged")
	trustExtract(t, plain, forged)
	t.Cleanup(func() { os.RemoveAll(forged) })
	trustForge(t, filepath.Join(forged, checkpoint.ImagesDir), filepath.Join(forged, checkpoint.ImagesDir))
	attacker := trustKey(t, dir)
	variants := []struct {
		name string
		sign func(dir string)
		want []string
	}{
		{"node1's signature kept", func(string) {}, []string{"differs from the manifest " + srcKey.ID + " signed", "checkpoint signature is invalid"}},
		{"unsigned", func(d string) { fltNoErr(t, os.Remove(filepath.Join(d, checkpoint.SignatureFile))) },
			[]string{"berth.sig: checkpoint is not signed"}},
		{"signed by an unknown key", func(d string) { fltNoErr(t, signature.SignDir(ctx, d, attacker)) },
			[]string{"signed by [" + attacker.ID + "]", "not signed by a trusted key"}},
	}
	for i, v := range variants {
		t.Run("forged credentials and memory, "+v.name, func(t *testing.T) {
			d := filepath.Join(root, fmt.Sprintf("trust-forged-%d", i))
			fltCopyDir(t, forged, d)
			t.Cleanup(func() { os.RemoveAll(d) })
			v.sign(filepath.Join(d, checkpoint.ImagesDir))
			sums := fltDigests(t, d)
			_, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", fmt.Sprintf("forged-dir-%d", i), trustPlain, filepath.Base(d))
			trustRefused(t, dst, "forged directory ("+v.name+")", err, v.want...)
			fltRequireSums(t, d, sums, "")
			ar := fltWriteArchive(t, d, d+".tar")
			_, err = trustRestore(t, ctx, dst, dir, podA, "trust-dst", fmt.Sprintf("forged-tar-%d", i), trustPlain, filepath.Base(ar))
			trustRefused(t, dst, "forged archive ("+v.name+")", err, v.want...)
		})
	}

	t.Run("unsigned rootfs diff planted at the top of a signed archive", func(t *testing.T) {
		// the shim's signed checkpoint/berth-rootfs-diff.tar stays; a berth-rootfs-diff.tar of
		// the attacker's beside it replaces /bin/sh and drops a marker: once it was applied
		d := filepath.Join(dir, "planted")
		trustExtract(t, plain, d)
		planted := trustTar(t, map[string]string{"bin/sh": "#!/bin/busybox sh\necho planted > /planted\n", "planted-marker": "x"})
		fltNoErr(t, os.WriteFile(filepath.Join(d, checkpoint.ImagesRootfsDiffFile), planted, 0o600))
		ar := fltWriteArchive(t, d, filepath.Join(root, "trust-planted.tar"))
		sums := fltDigests(t, ar)
		_, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", "planted", trustPlain, filepath.Base(ar))
		trustRefused(t, dst, "planted rootfs diff", err, checkpoint.ImagesRootfsDiffFile+": file not in manifest")
		fltRequireSums(t, ar, sums, "")
	})

	t.Run("spec.dump edited to another namespace", func(t *testing.T) {
		d := filepath.Join(dir, "specdump")
		trustExtract(t, plain, d)
		p := filepath.Join(d, checkpoint.SpecFile)
		b, err := os.ReadFile(p)
		fltNoErr(t, err)
		edited := strings.ReplaceAll(string(b), `"io.kubernetes.cri.sandbox-namespace":"default"`, `"io.kubernetes.cri.sandbox-namespace":"other"`)
		if edited == string(b) {
			t.Fatalf("spec.dump has no sandbox namespace annotation to edit")
		}
		fltNoErr(t, os.WriteFile(p, []byte(edited), 0o600))
		ar := fltWriteArchive(t, d, filepath.Join(root, "trust-specdump.tar"))
		podB := criPod(t, ctx, dst, dir, "trust-other", "other")
		_, err = trustRestore(t, ctx, dst, dir, podB, "trust-other", "specdump", trustPlain, filepath.Base(ar))
		trustRefused(t, dst, "spec.dump edited", err, `taken in Kubernetes namespace "default"`, `may not be restored into namespace "other"`)
	})

	t.Run("decompression bomb in a signed archive", func(t *testing.T) {
		// as `berthctl checkpoint push` signs a CRI archive whole: a top-level berth.json covering
		// every file, rootfs-diff.tar included, signed by node1
		d := filepath.Join(dir, "bomb")
		trustExtract(t, plain, d)
		b := trustBomb(t, 1<<30)
		t.Logf("bomb: %d bytes of gzip, 1 GiB expanded", len(b))
		fltNoErr(t, os.WriteFile(filepath.Join(d, checkpoint.RootfsDiffFile), b, 0o600))
		_, err := checkpoint.SignCRICheckpoint(d)
		fltNoErr(t, err)
		_, err = src.Sign(ctx, d)
		fltNoErr(t, err)
		ar := fltWriteArchive(t, d, filepath.Join(root, "trust-bomb.tar"))
		start := time.Now()
		_, err = trustRestore(t, ctx, dst, dir, podA, "trust-dst", "bomb", trustPlain, filepath.Base(ar))
		trustRefused(t, dst, "decompression bomb", err, "rootfs-diff.tar", "max_rootfs_diff_bytes", "rootfs diff exceeds its limits")
		if d := time.Since(start); d > time.Minute {
			t.Errorf("the refusal took %v", d)
		}
	})

	t.Run("credentials in a registry reference", func(t *testing.T) {
		_, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", "password", trustPlain, "oci://robot:s3cr3t-pw@127.0.0.1:5000/berth/ck:v1")
		trustRefused(t, dst, "password in a reference", err, "carries credentials")
		if strings.Contains(err.Error(), "s3cr3t-pw") {
			t.Errorf("the password comes back in the error")
		}
		logText, _ := os.ReadFile(dst.Log)
		if bytes.Contains(logText, []byte("s3cr3t-pw")) {
			t.Errorf("the password is in containerd's log %s", dst.Log)
		}
	})

	t.Run("oversized annotation value", func(t *testing.T) {
		_, err := trustRestore(t, ctx, dst, dir, podA, "trust-dst", "oversized", trustPlain, strings.Repeat("a", 1<<20))
		trustRefused(t, dst, "oversized annotation", err, "1048576 bytes, more than 4096")
		if len(err.Error()) > 4096 {
			t.Errorf("error of %d bytes", len(err.Error()))
		}
	})

	t.Run("key trusted only for another namespace", func(t *testing.T) {
		restore, err := dst.SetTrust(node.Trust{Keys: []signature.TrustedKey{{Path: src.PublicKey, Namespaces: []string{"prod"}}}})
		fltNoErr(t, err)
		defer func() { fltNoErr(t, restore()) }()
		pod := criPod(t, ctx, dst, dir, "trust-ns", "default") // its shim reads the new policy
		_, err = trustRestore(t, ctx, dst, dir, pod, "trust-ns", "nskey", trustPlain, filepath.Base(plain))
		trustRefused(t, dst, "key for another namespace", err, srcKey.ID, `not trusted for namespace "default"`)
	})

	t.Run("allow_unsigned restores with a warning", func(t *testing.T) {
		d := filepath.Join(root, "trust-unsigned")
		trustExtract(t, plain, d)
		t.Cleanup(func() { os.RemoveAll(d) })
		fltNoErr(t, os.Remove(filepath.Join(d, checkpoint.ImagesDir, checkpoint.SignatureFile)))
		restore, err := dst.SetTrust(node.Trust{AllowUnsigned: true})
		fltNoErr(t, err)
		pod := criPod(t, ctx, dst, dir, "trust-lab", "default")
		id, err := trustRestore(t, ctx, dst, dir, pod, "trust-lab", "unsigned", trustPlain, filepath.Base(d))
		fltNoErr(t, restore())
		if err != nil {
			t.Fatalf("allow_unsigned: restore of an unsigned checkpoint: %v", err)
		}
		_, _ = dst.Crictl(ctx, "stop", "-t", "0", id)
		logText, _ := os.ReadFile(dst.Log)
		if !bytes.Contains(logText, []byte("allow_unsigned: restoring a checkpoint that no trusted key signed")) {
			t.Errorf("no warning in containerd's log %s", dst.Log)
		}
		// the same checkpoint in a pod of a node that does not opt out
		_, err = trustRestore(t, ctx, dst, dir, podA, "trust-dst", "unsigned-strict", trustPlain, filepath.Base(d))
		trustRefused(t, dst, "unsigned without allow_unsigned", err, "checkpoint is not signed")
	})

	fltRequireSums(t, plain, plainSums, "")
}

// TestTrustStartRestoresWhatCreateVerified: a checkpoint directory swapped between the task's
// Create (which verified it) and Start restores the verified copy, never the swapped-in one; a
// file of the verified directory written in between is refused at Start.
func TestTrustStartRestoresWhatCreateVerified(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	w := fltStart(t, ctx, src, "trust-swap-src")
	cl, err := src.Client()
	fltNoErr(t, err)
	defer cl.Close()
	dir := filepath.Join(dst.CheckpointRoot, "trust-swap")
	t.Cleanup(func() { os.RemoveAll(dir); os.RemoveAll(dir + ".verified") })
	ck, err := move.Checkpoint(ctx, cl, move.CheckpointOptions{Namespace: node.Namespace, ID: w.id, Dir: dir})
	fltNoErr(t, err)
	fltNoErr(t, ck.Resume(namespaces.WithNamespace(ctx, node.Namespace)))
	fltNoErr(t, src.Remove(ctx, w.id)) // its cgroup and ports are the destination's to take
	// the shim's own image directory, signed by node1's shim
	ref := "trust-swap/" + checkpoint.ImagesDir

	dcl, err := dst.Client()
	fltNoErr(t, err)
	defer dcl.Close()
	nctx := namespaces.WithNamespace(ctx, node.Namespace)
	img, err := dcl.GetImage(nctx, image.WorkloadRef)
	fltNoErr(t, err)
	create := func(id string) containerd.Task {
		ctr, err := dcl.NewContainer(nctx, id, containerd.WithImage(img), containerd.WithNewSnapshot(id, img),
			containerd.WithRuntime(oci.RuntimeName, nil),
			containerd.WithNewSpec(ctroci.WithImageConfig(img),
				ctroci.WithProcessArgs(image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", fmt.Sprint(fltWeightsMiB)),
				ctroci.WithAnnotations(map[string]string{oci.AnnotationRestoreFrom: ref})))
		fltNoErr(t, err)
		t.Cleanup(func() { _ = dst.Remove(context.Background(), id) })
		task, err := ctr.NewTask(nctx, cio.LogFile(filepath.Join(dst.Dir, id+".log")))
		if err != nil {
			t.Fatalf("create task %s from %s: %v", id, ref, err)
		}
		return task
	}

	// swapped: the verified directory moves away; a copy with other memory takes its path
	task := create("trust-swap-1")
	fltNoErr(t, os.Rename(dir, dir+".verified"))
	fltCopyDir(t, dir+".verified", dir)
	pages := filepath.Join(dir, checkpoint.ImagesDir, "pages-1.img")
	for off := int64(0); off < fltFileSize(t, pages); off += 4096 {
		fltFlipByte(t, pages, off)
	}
	if err := task.Start(nctx); err != nil {
		t.Fatalf("Start after the swap: %v", err)
	}
	got, err := client.Stats(ctx, client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(task.Pid()))})
	if err != nil || got.WeightsChecksum != w.checksum {
		t.Fatalf("restored after the swap: weights %s (%v), want the verified checkpoint's %s", got.WeightsChecksum, err, w.checksum)
	}
	fltNoErr(t, dst.Remove(ctx, "trust-swap-1"))

	// written in place: the directory Create verified changes before Start
	fltNoErr(t, os.RemoveAll(dir))
	fltNoErr(t, os.Rename(dir+".verified", dir))
	task = create("trust-swap-2")
	fltFlipByte(t, pages, 0)
	err = task.Start(nctx)
	if err == nil || !strings.Contains(err.Error(), "is not what Create verified") || !strings.Contains(err.Error(), "pages-1.img") {
		t.Fatalf("Start after a file changed: %v; want a refusal naming pages-1.img", err)
	}
	_, _ = task.Delete(nctx, containerd.WithProcessKill)
}
