package shim

import (
	"archive/tar"
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
	"strings"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/signature"
)

// logCapture returns a context whose logger writes into the returned buffer.
func logCapture() (context.Context, *bytes.Buffer) {
	var buf bytes.Buffer
	l := logrus.New()
	l.Out = &buf
	return log.WithLogger(context.Background(), logrus.NewEntry(l)), &buf
}

// trustService is a node whose policy is p, with a small rootfs diff limit.
func trustService(t *testing.T, root string, p *signature.Policy) *Service {
	t.Helper()
	return NewService(nil, Config{Path: "/etc/berth/shim.toml", CheckpointRoot: root, MaxArchiveBytes: 1 << 30,
		MaxRootfsDiffBytes: 1 << 20, NamespaceMappings: []string{"staging:prod"}}, testDeps(p))
}

// restoreOf runs prepareRestore for spec; the plan is cleaned up when the test ends.
func restoreOf(t *testing.T, ctx context.Context, s *Service, spec *specs.Spec) (*restorePlan, error) {
	t.Helper()
	plan, err := s.prepareRestore(ctx, &taskAPI.CreateTaskRequest{ID: "c1"}, spec)
	if plan != nil {
		t.Cleanup(plan.cleanup)
	}
	return plan, err
}

// requireRefused checks err: it wraps sentinel, is of class, and its message contains want.
func requireRefused(t *testing.T, err, sentinel, class error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("restored; want a refusal wrapping %v", sentinel)
	}
	if sentinel != nil && !errors.Is(err, sentinel) {
		t.Errorf("error %q does not wrap %v", err, sentinel)
	}
	if class != nil && errorClass(err) != class {
		t.Errorf("error %q is of class %v, want %v", err, errorClass(err), class)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not contain %q", err, w)
		}
	}
}

// TestRestoreSignatures: only what a trusted key signed restores; the refusal names the reason
// and the key id; allow_unsigned restores the unsigned and the unknown with a warning, never a
// signature over other bytes.
func TestRestoreSignatures(t *testing.T) {
	root := t.TempDir()
	ck := func(name, signer string) string {
		return writeCheckpointWith(t, root, name, checkpointOpts{fp: nodeFP, signer: signer, namespace: "default"})
	}
	ck("signed", "node")
	ck("unsigned", "")
	ck("attacker", "attacker")
	ck("other", "other")
	writeCheckpointWith(t, root, "other-prod", checkpointOpts{fp: nodeFP, signer: "other", namespace: "prod"})
	// a key trusted only for prod signs a checkpoint its manifest says was taken in staging,
	// which namespace_mappings lets into prod
	writeCheckpointWith(t, root, "other-staging", checkpointOpts{fp: nodeFP, signer: "other", namespace: "staging"})
	// forged: an image edited, digests and berth.json regenerated; the node's signature left
	forged := ck("forged", "node")
	if err := os.WriteFile(filepath.Join(forged, "checkpoint/core-1.img"), []byte("uid 0"), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := checkpoint.ReadManifest(forged)
	if err != nil {
		t.Fatal(err)
	}
	m.Files, m.ImageSize = nil, 0
	if err := checkpoint.WriteManifest(forged, m); err != nil {
		t.Fatal(err)
	}
	// forged again, and signed by the attacker's key
	forgedSigned := filepath.Join(root, "forged-signed")
	if err := os.CopyFS(forgedSigned, os.DirFS(forged)); err != nil {
		t.Fatal(err)
	}
	signWith(t, forgedSigned, "attacker")

	trustedOther := signature.TrustedKey{Path: key(t, "other").pub, Namespaces: []string{"prod"}}
	strict := trustService(t, root, policy(t, false, trustedOther))
	lab := trustService(t, root, policy(t, true, trustedOther))
	attackerID, otherID := key(t, "attacker").key.ID, key(t, "other").key.ID

	tests := []struct {
		name, ref, ns string
		s             *Service
		sentinel      error
		want          []string
		warn          string
	}{
		{name: "signed by this node", ref: "signed", ns: "default", s: strict},
		{name: "unsigned", ref: "unsigned", ns: "default", s: strict, sentinel: signature.ErrUnsigned,
			want: []string{"unsigned/berth.sig", "checkpoint is not signed", "/etc/berth/shim.toml"}},
		{name: "unknown key", ref: "attacker", ns: "default", s: strict, sentinel: signature.ErrUntrustedKey,
			want: []string{attackerID, "not signed by a trusted key"}},
		{name: "key trusted for another namespace", ref: "other", ns: "default", s: strict, sentinel: signature.ErrUntrustedKey,
			want: []string{otherID, `not trusted for namespace "default"`}},
		{name: "key trusted for another namespace, outside Kubernetes", ref: "other", ns: "", s: strict, sentinel: signature.ErrUntrustedKey,
			want: []string{otherID}},
		{name: "key trusted for this namespace", ref: "other-prod", ns: "prod", s: strict},
		{name: "key trusted for the destination, not for the signed manifest's namespace", ref: "other-staging", ns: "prod", s: strict,
			sentinel: signature.ErrUntrustedKey, want: []string{otherID, `not trusted for namespace "staging", where its signed manifest says it was taken`}},
		{name: "forged: digests regenerated, signature kept", ref: "forged", ns: "default", s: strict, sentinel: signature.ErrBadSignature,
			want: []string{"berth.json differs from the manifest"}},
		{name: "forged and signed by an unknown key", ref: "forged-signed", ns: "default", s: strict, sentinel: signature.ErrUntrustedKey,
			want: []string{attackerID}},
		{name: "allow_unsigned: unsigned", ref: "unsigned", ns: "default", s: lab, warn: "allow_unsigned: restoring a checkpoint that no trusted key signed"},
		{name: "allow_unsigned: unknown key", ref: "attacker", ns: "default", s: lab, warn: attackerID},
		{name: "allow_unsigned: a trusted signature over other bytes", ref: "forged", ns: "default", s: lab, sentinel: signature.ErrBadSignature},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, logs := logCapture()
			plan, err := restoreOf(t, ctx, tc.s, podSpec(tc.ns, tc.ref))
			if tc.sentinel != nil {
				requireRefused(t, err, tc.sentinel, errdefs.ErrPermissionDenied, tc.want...)
				if strings.Contains(err.Error(), "/proc/self/fd") {
					t.Errorf("error %q names the held directory, not the checkpoint", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if plan == nil || plan.manifest == nil {
				t.Fatal("no plan")
			}
			if tc.warn != "" && (!strings.Contains(logs.String(), tc.warn) || !strings.Contains(logs.String(), "level=warning")) {
				t.Errorf("no warning %q logged:\n%s", tc.warn, logs)
			}
		})
	}
}

// TestRestoreNamespaceFromSignedManifest: the namespace check reads the namespace the signed
// manifest records; a spec.dump claiming another is ignored.
func TestRestoreNamespaceFromSignedManifest(t *testing.T) {
	root := t.TempDir()
	lying, _ := json.Marshal(specs.Spec{Annotations: map[string]string{oci.AnnotationCRISandboxNamespace: "victim"}})
	writeCheckpointWith(t, root, "cri", checkpointOpts{fp: nodeFP, signer: "node", namespace: "staging", cri: true,
		files: map[string]string{checkpoint.SpecFile: string(lying), checkpoint.ConfigFile: "{}"}})
	s := trustService(t, root, policy(t, false))
	ctx := context.Background()
	_, err := restoreOf(t, ctx, s, podSpec("victim", "cri"))
	requireRefused(t, err, ErrNamespaceRefused, errdefs.ErrPermissionDenied, `namespace "staging"`, `namespace "victim"`)
	for _, ns := range []string{"staging", "prod", ""} { // same namespace, a mapping, outside Kubernetes
		if _, err := restoreOf(t, ctx, s, podSpec(ns, "cri")); err != nil {
			t.Errorf("into %q: %v", ns, err)
		}
	}
}

// TestRestorePrivileges: a restore never grants more than the destination spec: the processes'
// credentials and the source container's security context are compared with it.
func TestRestorePrivileges(t *testing.T) {
	root := t.TempDir()
	writeCheckpoint(t, root, "plain", nodeFP)
	privileged := privilege.FromSpec(&specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{Bounding: allCaps()}}})
	writeCheckpointWith(t, root, "privileged", checkpointOpts{fp: nodeFP, signer: "node", security: &privileged})
	// a signed manifest without a security context (nothing berth writes)
	dir := writeCheckpointWith(t, root, "nosec", checkpointOpts{fp: nodeFP})
	m, _ := checkpoint.ReadManifest(dir)
	m.Security = nil
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	signWith(t, dir, "node")
	s := trustService(t, root, policy(t, false))
	ctx := context.Background()

	if _, err := restoreOf(t, ctx, s, podSpec("", "plain")); err != nil {
		t.Fatalf("a spec that grants as much: %v", err)
	}
	_, err := restoreOf(t, ctx, s, unprivilegedSpec("", "plain"))
	requireRefused(t, err, privilege.ErrExceedsSpec, errdefs.ErrPermissionDenied, "process 1 (app): uid: 0, destination 1000")
	var perr *privilege.Error
	if !errors.As(err, &perr) {
		t.Fatalf("%v is not a *privilege.Error", err)
	}
	var fields []string
	for _, v := range perr.Violations {
		fields = append(fields, v.Field)
	}
	for _, f := range []string{"uid", "gid", "cap_eff", "cap_prm", "cap_bnd", "no_new_privs"} {
		if !strings.Contains(" "+strings.Join(fields, " ")+" ", " "+f+" ") {
			t.Errorf("violations %v lack %s", fields, f)
		}
	}
	_, err = restoreOf(t, ctx, s, podSpec("", "privileged"))
	requireRefused(t, err, privilege.ErrExceedsSpec, errdefs.ErrPermissionDenied, "source container: privileged: true, destination false")
	_, err = restoreOf(t, ctx, s, podSpec("", "nosec"))
	requireRefused(t, err, ErrNoSecurityContext, errdefs.ErrFailedPrecondition)
}

func allCaps() []string {
	var out []string
	for n := 0; n <= 40; n++ {
		out = append(out, privilege.CapName(n))
	}
	return out
}

// tarOf returns a tar of the named regular files; gzipped when gz.
func tarOf(t *testing.T, gz bool, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	var w io.Writer = &buf
	var zw *gzip.Writer
	if gz {
		zw = gzip.NewWriter(&buf)
		w = zw
	}
	tw := tar.NewWriter(w)
	for name, body := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if zw != nil {
		zw.Close()
	}
	return buf.Bytes()
}

// bomb is a gzipped tar of one file of size zero bytes: about size/1000 bytes on disk.
func bomb(t *testing.T, size int64) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	tw := tar.NewWriter(zw)
	if err := tw.WriteHeader(&tar.Header{Name: "var/big", Mode: 0o644, Size: size, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 1<<20)
	for left := size; left > 0; left -= int64(len(zero)) {
		if _, err := tw.Write(zero[:min(left, int64(len(zero)))]); err != nil {
			t.Fatal(err)
		}
	}
	tw.Close()
	zw.Close()
	return buf.Bytes()
}

// TestRestoreRootfsDiff: only a rootfs diff a signature covers is applied; a CRI archive's own
// is refused when it is not empty; every diff is bounded (a decompression bomb is refused at its
// first header, before anything is written).
func TestRestoreRootfsDiff(t *testing.T) {
	root := t.TempDir()
	diff := string(tarOf(t, true, map[string]string{"etc/motd": "hello"}))
	empty := string(tarOf(t, true, nil))
	big := string(bomb(t, 64<<20)) // over the 1 MiB limit of trustService
	cri := func(name string, files map[string]string) {
		files[checkpoint.SpecFile] = "{}"
		writeCheckpointWith(t, root, name, checkpointOpts{fp: nodeFP, signer: "node", cri: true, files: files})
	}
	cri("cri-uncovered", map[string]string{checkpoint.RootfsDiffFile: diff})
	cri("cri-empty", map[string]string{checkpoint.RootfsDiffFile: empty})
	cri("cri-own", map[string]string{checkpoint.RootfsDiffFile: diff, "checkpoint/" + checkpoint.ImagesRootfsDiffFile: string(tarOf(t, false, map[string]string{"etc/motd": "hi"}))})
	cri("cri-bomb", map[string]string{checkpoint.RootfsDiffFile: big})
	// a signed CRI archive with an unsigned berth-rootfs-diff.tar planted at its top (a script
	// as /bin/sh): once chosen over the signed checkpoint/berth-rootfs-diff.tar
	planted := string(tarOf(t, false, map[string]string{"bin/sh": "#!/planted\n"}))
	writeCheckpointWith(t, root, "cri-planted", checkpointOpts{fp: nodeFP, signer: "node", cri: true,
		files:   map[string]string{"checkpoint/" + checkpoint.ImagesRootfsDiffFile: string(tarOf(t, false, map[string]string{"etc/motd": "hi"}))},
		planted: map[string]string{checkpoint.ImagesRootfsDiffFile: planted}})
	writeCheckpointWith(t, root, "cri-planted-only", checkpointOpts{fp: nodeFP, signer: "node", cri: true,
		planted: map[string]string{checkpoint.ImagesRootfsDiffFile: planted}})
	writeCheckpointWith(t, root, "cri-other-file", checkpointOpts{fp: nodeFP, signer: "node", cri: true,
		planted: map[string]string{"run.sh": "#!/bin/sh\n"}})
	writeCheckpointWith(t, root, "top-planted", checkpointOpts{fp: nodeFP, signer: "node",
		files:   map[string]string{checkpoint.RootfsDiffFile: diff},
		planted: map[string]string{checkpoint.ImagesRootfsDiffFile: planted}})
	writeCheckpointWith(t, root, "top", checkpointOpts{fp: nodeFP, signer: "node", files: map[string]string{checkpoint.RootfsDiffFile: diff}})
	writeCheckpointWith(t, root, "top-bomb", checkpointOpts{fp: nodeFP, signer: "node", files: map[string]string{checkpoint.RootfsDiffFile: big}})
	strict := trustService(t, root, policy(t, false))
	lab := trustService(t, root, policy(t, true))
	ctx := context.Background()

	tests := []struct {
		ref      string
		s        *Service
		want     string // the diff chosen
		sentinel error
		class    error
		msg      []string
	}{
		{ref: "cri-uncovered", s: strict, sentinel: ErrUncoveredRootfsDiff, class: errdefs.ErrPermissionDenied,
			msg: []string{"rootfs-diff.tar (1 entries) is not covered by a signature", "berthctl checkpoint push"}},
		{ref: "cri-uncovered", s: lab, want: checkpoint.RootfsDiffFile},
		{ref: "cri-empty", s: strict, want: ""},
		{ref: "cri-own", s: strict, want: "checkpoint/" + checkpoint.ImagesRootfsDiffFile},
		{ref: "top", s: strict, want: checkpoint.RootfsDiffFile},
		{ref: "top-bomb", s: strict, sentinel: ErrRootfsDiffTooLarge, class: errdefs.ErrInvalidArgument,
			msg: []string{`entry "var/big"`, "more than 1048576 bytes", "max_rootfs_diff_bytes"}},
		{ref: "cri-bomb", s: lab, sentinel: ErrRootfsDiffTooLarge, class: errdefs.ErrInvalidArgument},
		{ref: "cri-planted", s: strict, sentinel: checkpoint.ErrExtraFile, class: errdefs.ErrFailedPrecondition,
			msg: []string{checkpoint.ImagesRootfsDiffFile + ": file not in manifest", "nothing covers this one"}},
		{ref: "cri-planted", s: lab, sentinel: checkpoint.ErrExtraFile, class: errdefs.ErrFailedPrecondition},
		{ref: "cri-planted-only", s: strict, sentinel: checkpoint.ErrExtraFile, class: errdefs.ErrFailedPrecondition},
		{ref: "cri-other-file", s: strict, sentinel: checkpoint.ErrExtraFile, class: errdefs.ErrFailedPrecondition,
			msg: []string{"run.sh: file not in manifest"}},
		{ref: "top-planted", s: strict, sentinel: checkpoint.ErrExtraFile, class: errdefs.ErrFailedPrecondition,
			msg: []string{checkpoint.ImagesRootfsDiffFile + ": file not in manifest"}},
	}
	for _, tc := range tests {
		t.Run(tc.ref, func(t *testing.T) {
			start := time.Now()
			plan, err := restoreOf(t, ctx, tc.s, podSpec("", tc.ref))
			if tc.sentinel != nil {
				requireRefused(t, err, tc.sentinel, tc.class, tc.msg...)
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("refusal took %v", d)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if plan.rootfsDiff != tc.want {
				t.Errorf("rootfs diff %q, want %q", plan.rootfsDiff, tc.want)
			}
			if tc.want == "" {
				return
			}
			rootfs := t.TempDir()
			if err := tc.s.applyRootfsDiff(ctx, plan, rootfs); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(rootfs, "etc/motd")); err != nil {
				t.Errorf("diff not applied: %v", err)
			}
		})
	}

	// a stream longer than its headers say is cut off too
	s := trustService(t, root, policy(t, true))
	p := filepath.Join(t.TempDir(), "long.tar")
	if err := os.WriteFile(p, bomb(t, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	s.cfg.MaxRootfsDiffBytes = 8 << 20
	if err := s.applyDiff(ctx, p, t.TempDir()); err != nil {
		t.Fatalf("within the limit: %v", err)
	}
	s.cfg.MaxRootfsDiffBytes = -rootfsDiffSlack + 1<<20 // the stream may run 1 MiB
	if err := s.applyDiff(ctx, p, t.TempDir()); !errors.Is(err, ErrRootfsDiffTooLarge) {
		t.Fatalf("over the limit: %v", err)
	}

	// zstd (neither containerd nor berth writes it) and a broken gzip stream are bad archives
	for name, body := range map[string][]byte{"zstd": {0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0}, "gzip": {0x1f, 0x8b, 0}} {
		p := filepath.Join(t.TempDir(), name+".tar")
		if err := os.WriteFile(p, body, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := s.applyDiff(ctx, p, t.TempDir()); !errors.Is(err, ErrBadArchive) || errorClass(err) != errdefs.ErrInvalidArgument {
			t.Errorf("%s rootfs diff: %v; want a bad archive", name, err)
		} else if name == "zstd" && !strings.Contains(err.Error(), "zstd") {
			t.Errorf("zstd rootfs diff: %v; want the error to name zstd", err)
		}
	}
}

// TestStartRestoresWhatCreateVerified: runc restores the directory Create verified, held open,
// even when another is swapped in at its path; a file of it changed since is refused at Start.
func TestStartRestoresWhatCreateVerified(t *testing.T) {
	root := t.TempDir()
	dir := writeCheckpoint(t, root, "ck", nodeFP)
	s := trustService(t, root, policy(t, false))
	ctx := context.Background()
	plan, err := restoreOf(t, ctx, s, podSpec("", "ck"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(plan.runcImages(), fmt.Sprintf("/proc/%d/fd/", os.Getpid())) {
		t.Fatalf("runc restores from %s, not the held directory", plan.runcImages())
	}
	// swap: the verified directory moves away, a forged one takes its path
	if err := os.Rename(dir, filepath.Join(root, "moved")); err != nil {
		t.Fatal(err)
	}
	writeCheckpointWith(t, root, "ck", checkpointOpts{fp: nodeFP, signer: "attacker",
		files: map[string]string{"checkpoint/pages-1.img": "forged memory"}})
	b, err := os.ReadFile(filepath.Join(plan.runcImages(), "pages-1.img"))
	if err != nil || string(b) != strings.Repeat("x", 4096) {
		t.Fatalf("runc would read %q (%v), not the verified pages", cut(string(b), 20), err)
	}
	if err := plan.unchanged(); err != nil {
		t.Fatalf("the held checkpoint is unchanged: %v", err)
	}

	// a file of the held directory written in place: Start refuses, runc is not called
	stub := &startStub{runcStub: &runcStub{bundle: t.TempDir(), status: task.Status_CREATED}}
	s2 := NewService(stub, DefaultConfig(), testDeps(policy(t, false)))
	s2.tasks["c1"] = &restoredTask{status: restoreCreated, bundle: stub.bundle, plan: plan}
	time.Sleep(10 * time.Millisecond)
	if err := os.WriteFile(filepath.Join(root, "moved", "checkpoint", "core-1.img"), []byte("CORE"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = s2.Start(ctx, &taskAPI.StartRequest{ID: "c1"})
	native := errgrpc.ToNative(err)
	requireRefused(t, native, nil, errdefs.ErrFailedPrecondition, "checkpoint/core-1.img", "is not what Create verified")
	if stub.started != 0 {
		t.Errorf("runc restored a changed checkpoint")
	}
}

// TestContainerdRestore: a checkpoint containerd passes (ctr containers restore) is admitted like
// any other when it carries a berth manifest, and only with the hooks its signed source ran;
// without a manifest it is refused unless allow_unsigned.
func TestContainerdRestore(t *testing.T) {
	base := t.TempDir()
	images := filepath.Join(writeCheckpointWith(t, base, "ck", checkpointOpts{fp: nodeFP, signer: "node", cri: true}), checkpoint.ImagesDir)
	bare := filepath.Join(base, "bare")
	if err := os.MkdirAll(bare, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bare, "pages-1.img"), []byte("pages"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	strict := trustService(t, t.TempDir(), policy(t, false))
	lab := trustService(t, t.TempDir(), policy(t, true))
	restore := func(s *Service, dir string, spec *specs.Spec) (*restorePlan, error) {
		plan, err := s.prepareRestore(ctx, &taskAPI.CreateTaskRequest{ID: "c1", Checkpoint: dir}, spec)
		if plan != nil {
			t.Cleanup(plan.cleanup)
		}
		return plan, err
	}
	if plan, err := restore(strict, images, podSpec("", "")); err != nil || plan.manifest == nil {
		t.Fatalf("signed: %+v %v", plan, err)
	}
	_, err := restore(strict, bare, podSpec("", ""))
	requireRefused(t, err, signature.ErrUnsigned, errdefs.ErrPermissionDenied, "has no berth manifest", "allow_unsigned")
	if _, err := restore(lab, bare, podSpec("", "")); err != nil {
		t.Fatalf("allow_unsigned: %v", err)
	}
	_, err = restore(lab, bare, unprivilegedSpec("", ""))
	requireRefused(t, err, privilege.ErrExceedsSpec, errdefs.ErrPermissionDenied, "process 1 (app)")

	// the spec ctr takes from containerd's checkpoint image is not signed: a hook in it would
	// run as root here, so only the hooks the signed source recorded may run
	hooked := podSpec("", "")
	hooked.Hooks = &specs.Hooks{CreateRuntime: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "touch /pwned"}}}}
	_, err = restore(strict, images, hooked)
	requireRefused(t, err, privilege.ErrExceedsSpec, errdefs.ErrPermissionDenied, "createRuntime /bin/sh -c touch /pwned", "berthctl restore")
	sec := privilege.FromSpec(hooked)
	recorded := filepath.Join(writeCheckpointWith(t, base, "hooked", checkpointOpts{fp: nodeFP, signer: "node", cri: true, security: &sec}), checkpoint.ImagesDir)
	if _, err := restore(strict, recorded, hooked); err != nil {
		t.Fatalf("a hook the signed source recorded: %v", err)
	}
}

// TestReferenceHygiene: credentials in a reference never come back; oversized values are cut.
func TestReferenceHygiene(t *testing.T) {
	root := t.TempDir()
	s := trustService(t, root, policy(t, false))
	s.cfg.AllowedRegistries = []string{"127.0.0.1:1"}
	bundle := t.TempDir()
	create := func(ref string) error {
		b, _ := json.Marshal(podSpec("", ref))
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := s.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "c1", Bundle: bundle})
		return err
	}
	for _, ref := range []string{"oci://robot:s3cr3t@127.0.0.1:1/ck:v1", "oci://s3cr3t@127.0.0.1:1/ck:v1", "oci://robot:s3cr3t@10.0.0.1/ck:v1"} {
		err := create(ref)
		if err == nil || strings.Contains(err.Error(), "s3cr3t") || !strings.Contains(err.Error(), "carries credentials") {
			t.Errorf("%s: %v; want a refusal that does not echo the password", ref, err)
		}
		if errdefs.Resolve(errgrpc.ToNative(err)) != errdefs.ErrInvalidArgument {
			t.Errorf("%s: class of %v", ref, err)
		}
	}
	huge := strings.Repeat("a", 1<<20)
	for _, ref := range []string{huge, "oci://" + huge, "dir/" + huge} {
		err := create(ref)
		if err == nil || len(err.Error()) > 1024 {
			t.Errorf("a %d-byte reference: error of %d bytes", len(ref), len(fmt.Sprint(err)))
		}
	}
	if got := cleanMessage("pull oci://u:p@r/x: " + strings.Repeat("y", 1<<20)); strings.Contains(got, "u:p") || len(got) > maxMessage+32 {
		t.Errorf("cleanMessage kept %d bytes or the credentials", len(got))
	}
}

// TestCheckpointSignedManifest: the shim's checkpoint records the container's Kubernetes
// identity and security context, is signed with the node's key, and is readable by root only.
func TestCheckpointSignedManifest(t *testing.T) {
	bundle := t.TempDir()
	spec := podSpec("team-a", "")
	spec.Annotations[oci.AnnotationCRISandboxName] = "web-0"
	spec.Annotations[oci.AnnotationCRIContainerName] = "server"
	spec.Annotations[oci.AnnotationCRIImageName] = "registry.example/web:1"
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	inner := &runcStub{bundle: bundle, status: task.Status_PAUSED, pids: []uint32{100}}
	deps := testDeps(policy(t, false))
	deps.DumpStats = func(string) (checkpoint.CRIUStats, error) { return checkpoint.CRIUStats{}, nil }
	s := NewService(inner, DefaultConfig(), deps)
	path := t.TempDir()
	// what CRIU leaves readable by others
	if err := os.MkdirAll(filepath.Join(path, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(path, "sub", "x.img"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: path}); err != nil {
		t.Fatal(err)
	}
	v, err := policy(t, false).Verify(context.Background(), path, "team-a")
	if err != nil || v.KeyID != key(t, "node").key.ID {
		t.Fatalf("signature: %+v %v", v, err)
	}
	m, err := checkpoint.ParseManifest(v.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	c := m.Container
	if c.KubernetesNamespace != "team-a" || c.Pod != "web-0" || c.ContainerName != "server" || c.Image != "registry.example/web:1" {
		t.Errorf("container %+v", c)
	}
	if want := privilege.FromSpec(spec); m.Security == nil || fmt.Sprint(*m.Security) != fmt.Sprint(want) {
		t.Errorf("security %+v, want %+v", m.Security, want)
	}
	err = filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, _ := d.Info()
		want := fs.FileMode(0o600)
		if d.IsDir() {
			want = 0o700
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", p, fi.Mode().Perm(), want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// without a signing key: written unsigned, with a warning
	path2 := t.TempDir()
	s2 := NewService(&runcStub{bundle: bundle, status: task.Status_PAUSED}, DefaultConfig(), Deps{
		Fingerprint: deps.Fingerprint, DumpStats: deps.DumpStats})
	ctx, logs := logCapture()
	if _, err := s2.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "c", Path: path2}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(path2, checkpoint.SignatureFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("signed without a key: %v", err)
	}
	if !strings.Contains(logs.String(), "checkpoint written unsigned") {
		t.Errorf("no warning: %s", logs)
	}
}

// TestRootfsDiffOf: the diff applied is the one the verified manifest lists, never a file of
// the same name beside it.
func TestRootfsDiffOf(t *testing.T) {
	files := func(paths ...string) *checkpoint.Manifest {
		m := &checkpoint.Manifest{}
		for _, p := range paths {
			m.Files = append(m.Files, checkpoint.File{Path: p})
		}
		return m
	}
	inImages := checkpoint.ImagesDir + "/" + checkpoint.ImagesRootfsDiffFile
	tests := []struct {
		name  string
		m     *checkpoint.Manifest
		atTop bool
		want  string
	}{
		{"none", nil, true, ""},
		{"top rootfs-diff", files(checkpoint.RootfsDiffFile, inImages), true, checkpoint.RootfsDiffFile},
		{"top shim copy", files(inImages), true, inImages},
		{"bare image dir", files(checkpoint.ImagesRootfsDiffFile, "pages-1.img"), true, checkpoint.ImagesRootfsDiffFile},
		{"cri signed copy", files(checkpoint.ImagesRootfsDiffFile), false, inImages},
		{"cri no copy", files("pages-1.img"), false, ""},
		{"cri never the top", files(checkpoint.RootfsDiffFile), false, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := rootfsDiffOf(tc.m, tc.atTop); got != tc.want {
				t.Errorf("rootfsDiffOf = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestCheckContainerdSpec: the spec of a containerd-passed restore may not point CRIU at a
// configuration of its own or the restored tree at another root.
func TestCheckContainerdSpec(t *testing.T) {
	bundle := "/run/containerd/io.containerd.runtime.v2.task/default/c1"
	for _, tc := range []struct {
		name string
		ann  map[string]string
		root string
		want string // "" when allowed
	}{
		{"containerd's spec", nil, "rootfs", ""},
		{"the shim's own CRIU config", map[string]string{oci.AnnotationCRIUConfig: bundle + "/" + criuConfigName}, bundle + "/rootfs", ""},
		{"a CRIU config from the image", map[string]string{oci.AnnotationCRIUConfig: bundle + "/rootfs/etc/evil.conf"}, "rootfs", "evil.conf"},
		{"the host's root", nil, "/", "root.path"},
		{"a root beside the bundle", nil, "rootfs/../../other/rootfs", "root.path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkContainerdSpec(bundle, &specs.Spec{Annotations: tc.ann, Root: &specs.Root{Path: tc.root}})
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, privilege.ErrExceedsSpec) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("checkContainerdSpec = %v, want ErrExceedsSpec naming %q", err, tc.want)
			}
		})
	}
}
