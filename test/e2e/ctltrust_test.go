package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/pelletier/go-toml/v2"
	"google.golang.org/protobuf/proto"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/registry"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/oci/transfer"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/keys"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// berthctl's side of the trust model (issue 9) on the real stack: every checkpoint berthctl
// writes is signed with the node key of its --config ($BERTH_SHIM_CONFIG, set by TestMain), and
// receive, pull and push keep only what a trusted key signed; moves run over mutual TLS. Each
// attack below succeeded before: a checkpoint was a list of digests anyone could regenerate.

// CosignVersion is the cosign the tests verify pushed checkpoints with: COSIGN_VERSION of
// test/stack/install.sh, which make deps builds from the Go module proxy (keep the two equal).
const CosignVersion = "v3.1.3"

// ctBerthctl runs berthctl with args and returns its combined output.
func ctBerthctl(ctx context.Context, c *node.Cluster, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, c.Berthctl(), args...).CombinedOutput()
	return string(out), err
}

// ctMust runs berthctl and fails the test on error.
func ctMust(t *testing.T, ctx context.Context, c *node.Cluster, args ...string) string {
	t.Helper()
	out, err := ctBerthctl(ctx, c, args...)
	if err != nil {
		t.Fatalf("berthctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// ctJSON runs berthctl with args (-o json among them) and decodes its stdout into v.
func ctJSON(t *testing.T, ctx context.Context, c *node.Cluster, v any, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, c.Berthctl(), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("berthctl %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.String())
	}
	if err := json.Unmarshal(out, v); err != nil {
		t.Fatalf("berthctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// ctRefused runs berthctl, which must fail with output containing every one of want.
func ctRefused(t *testing.T, ctx context.Context, c *node.Cluster, want []string, args ...string) string {
	t.Helper()
	out, err := ctBerthctl(ctx, c, args...)
	if err == nil {
		t.Fatalf("berthctl %s succeeded, want a refusal containing %q:\n%s", strings.Join(args, " "), want, out)
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("berthctl %s: output lacks %q:\n%s", strings.Join(args, " "), w, out)
		}
	}
	return out
}

// ctNodeKey returns the signing key of berthctl's configuration and a file with its public key.
func ctNodeKey(t *testing.T) (priv, pub string) {
	t.Helper()
	cfg := os.Getenv("BERTH_SHIM_CONFIG")
	b, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatalf("berthctl configuration: %v", err)
	}
	var c struct {
		SigningKey string `toml:"signing_key"`
		Trust      struct {
			SigningKey string `toml:"signing_key"`
		} `toml:"trust"`
	}
	if err := toml.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	priv = c.SigningKey + c.Trust.SigningKey
	k, err := signature.LoadKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	pem, err := k.PublicPEM()
	if err != nil {
		t.Fatal(err)
	}
	pub = filepath.Join(t.TempDir(), "node.pub")
	if err := os.WriteFile(pub, pem, 0o644); err != nil {
		t.Fatal(err)
	}
	return priv, pub
}

// ctReceiver is a `berthctl receive -o json` process.
type ctReceiver struct {
	addr   string
	events chan map[string]any
}

// ctStartReceive starts `berthctl receive` into root with args; it is stopped when the test ends.
func ctStartReceive(t *testing.T, ctx context.Context, c *node.Cluster, root string, args ...string) *ctReceiver {
	t.Helper()
	cmd := exec.CommandContext(ctx, c.Berthctl(), append([]string{"receive", "--root", root, "--listen", "127.0.0.1:0", "-o", "json"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() })
	r := &ctReceiver{events: make(chan map[string]any, 64)}
	sc := bufio.NewScanner(stdout)
	if !sc.Scan() {
		_ = cmd.Wait()
		t.Fatalf("berthctl receive %v printed nothing: %s", args, stderr.String())
	}
	var l struct{ Event, Address string }
	if err := json.Unmarshal(sc.Bytes(), &l); err != nil || l.Event != "listening" {
		t.Fatalf("berthctl receive printed %q (%v)", sc.Text(), err)
	}
	r.addr = l.Address
	go func() {
		for sc.Scan() {
			var e map[string]any
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				select {
				case r.events <- e:
				default:
				}
			}
		}
	}()
	return r
}

// ctEntries lists root's checkpoints (verification stamps aside).
func ctEntries(t *testing.T, root string) []string {
	t.Helper()
	es, err := os.ReadDir(root)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		if e.Name() != ".verified" {
			names = append(names, e.Name())
		}
	}
	sort.Strings(names)
	return names
}

// ctCopy copies the checkpoint directory src to a new directory dst.
func ctCopy(t *testing.T, src, dst string) string {
	t.Helper()
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		t.Fatalf("cp -a %s %s: %v %s", src, dst, err, out)
	}
	return dst
}

// ctRedigest rewrites dir's berth.json with the digests of its files as they are now, as an
// attacker who edited them would; berth.sig is left alone.
func ctRedigest(t *testing.T, dir string) {
	t.Helper()
	m, err := checkpoint.ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Files, m.ImageSize, err = checkpoint.DigestDir(dir); err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
}

// ctForgeMemory flips bytes in the largest CRIU pages image of dir (the process's memory).
func ctForgeMemory(t *testing.T, dir string) {
	t.Helper()
	pages, _ := filepath.Glob(filepath.Join(dir, checkpoint.ImagesDir, "pages-*.img"))
	var biggest string
	var size int64 = -1
	for _, p := range pages {
		if fi, err := os.Stat(p); err == nil && fi.Size() > size {
			biggest, size = p, fi.Size()
		}
	}
	if size <= 0 {
		t.Fatalf("no pages image in %s", dir)
	}
	f, err := os.OpenFile(biggest, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt([]byte("forged memory"), size/2); err != nil {
		t.Fatal(err)
	}
	ctRedigest(t, dir)
}

// ctForgeCredentials rewrites the credentials of every thread in dir's CRIU core images: uid
// and gid 0, every capability (what a restore then hands the process). The entries are go-criu's
// CoreEntry messages, re-encoded in CRIU's image layout (magics, then a 4-byte little-endian
// size before each entry); go-criu's crit package itself cannot be linked beside its stats
// package (both register stats_entry).
func ctForgeCredentials(t *testing.T, dir string) {
	t.Helper()
	cores, _ := filepath.Glob(filepath.Join(dir, checkpoint.ImagesDir, "core-*.img"))
	if len(cores) == 0 {
		t.Fatalf("no core image in %s", dir)
	}
	for _, p := range cores {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var header int
		var entries [][]byte
		for _, h := range []int{8, 4} { // IMG_COMMON and the core magic, or the core magic alone
			entries = nil
			off := h
			for off+4 <= len(b) {
				n := int(binary.LittleEndian.Uint32(b[off:]))
				if off+4+n > len(b) {
					break
				}
				entries = append(entries, b[off+4:off+4+n])
				off += 4 + n
			}
			if off == len(b) && len(entries) > 0 {
				header = h
				break
			}
		}
		if header == 0 {
			t.Fatalf("%s: not a CRIU image this test reads", p)
		}
		out := append([]byte{}, b[:header]...)
		for _, e := range entries {
			core := &criucore.CoreEntry{}
			if err := proto.Unmarshal(e, core); err != nil {
				t.Fatalf("%s: %v", p, err)
			}
			if c := core.GetThreadCore().GetCreds(); c != nil {
				for _, f := range []**uint32{&c.Uid, &c.Euid, &c.Suid, &c.Fsuid, &c.Gid, &c.Egid, &c.Sgid, &c.Fsgid} {
					*f = proto.Uint32(0)
				}
				all := []uint32{0xffffffff, 0xffffffff}
				c.CapInh, c.CapPrm, c.CapEff, c.CapBnd = all, all, all, all
				c.Groups = append(c.Groups, 0, 4242)
			}
			m, err := proto.Marshal(core)
			if err != nil {
				t.Fatal(err)
			}
			out = binary.LittleEndian.AppendUint32(out, uint32(len(m)))
			out = append(out, m...)
		}
		if bytes.Equal(out, b) {
			t.Fatalf("%s unchanged by the forgery", p)
		}
		if err := os.WriteFile(p, out, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ctRedigest(t, dir)
}

// ctResign replaces dir's berth.sig with a signature by the key at priv.
func ctResign(t *testing.T, dir, priv string) {
	t.Helper()
	k, err := signature.LoadKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	if err := signature.SignDir(context.Background(), dir, k); err != nil {
		t.Fatal(err)
	}
}

// ctCheckModes fails unless every file under dir is 0600 and every directory 0700.
func ctCheckModes(t *testing.T, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		want := os.FileMode(0o600)
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
}

// ctCosign returns the cosign binary make deps installs into the stack (test/stack/install.sh,
// CosignVersion), found on PATH; the test fails without it: tools are never built inside a test.
func ctCosign(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("cosign")
	if err != nil {
		t.Fatalf("cosign %s is not on PATH (%v): run make deps, which installs it into _output/stack/bin, and put that directory first on PATH (make test does)", CosignVersion, err)
	}
	return bin
}

// TestCtlSignedCheckpoint: `checkpoint create` signs what it writes and leaves it root's only;
// `receive` keeps it and refuses forged memory, forged credentials, an unsigned copy and one
// signed by an unknown key, before anything is renamed into its root; through a registry,
// `checkpoint pull` refuses the same forgeries while a push/pull round trip of the real one
// works, and cosign verifies the pushed checkpoint with the node's public key; a password in a
// reference is never echoed.
func TestCtlSignedCheckpoint(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const id = "ctl-signed"
	t.Cleanup(func() { _ = src.Remove(context.Background(), id) })
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.WaitReady(ctx, client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_, pub := ctNodeKey(t)
	attackerPriv, attackerPub, err := keys.SigningKey(t.TempDir(), "attacker")
	if err != nil {
		t.Fatal(err)
	}

	work := filepath.Join(src.Dir, "ctl-trust")
	if err := os.MkdirAll(work, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })
	good := filepath.Join(work, "good")
	out := ctMust(t, ctx, c, "checkpoint", "create", "-a", src.Socket, "-n", node.Namespace, id, good)
	if !strings.Contains(out, "signed by") || !strings.Contains(out, "SHA256:") {
		t.Errorf("checkpoint create does not say who signed:\n%s", out)
	}
	ctCheckModes(t, good)
	ctMust(t, ctx, c, "checkpoint", "inspect", "--verify", good)

	forged := map[string]string{}
	forged["memory"] = ctCopy(t, good, filepath.Join(work, "memory"))
	ctForgeMemory(t, forged["memory"])
	forged["credentials"] = ctCopy(t, good, filepath.Join(work, "credentials"))
	ctForgeCredentials(t, forged["credentials"])
	forged["unsigned"] = ctCopy(t, good, filepath.Join(work, "unsigned"))
	ctForgeMemory(t, forged["unsigned"])
	if err := os.Remove(filepath.Join(forged["unsigned"], checkpoint.SignatureFile)); err != nil {
		t.Fatal(err)
	}
	forged["unknown-key"] = ctCopy(t, good, filepath.Join(work, "unknown-key"))
	ctForgeCredentials(t, forged["unknown-key"])
	ctResign(t, forged["unknown-key"], attackerPriv)
	want := map[string][]string{
		"memory":      {"differs from the manifest", "checkpoint signature is invalid"},
		"credentials": {"differs from the manifest", "checkpoint signature is invalid"},
		"unsigned":    {"checkpoint is not signed"},
		"unknown-key": {"checkpoint is not signed by a trusted key"},
	}
	names := []string{"memory", "credentials", "unsigned", "unknown-key"}

	t.Run("receive", func(t *testing.T) {
		root := filepath.Join(dst.Dir, "ctl-received")
		t.Cleanup(func() { os.RemoveAll(root) })
		r := ctStartReceive(t, ctx, c, root)
		ctMust(t, ctx, c, "send", "--name", "good", good, r.addr)
		for _, n := range names {
			// the signature is checked as soon as berth.json and berth.sig arrive
			out := ctRefused(t, ctx, c, append([]string{"checkpoint rejected by receiver", "refused before the rest of the stream was written"}, want[n]...),
				"send", "--name", n, forged[n], r.addr)
			t.Logf("forged %s through receive: %s", n, strings.TrimSpace(out))
		}
		if got := ctEntries(t, root); strings.Join(got, " ") != "good" {
			t.Errorf("receive root holds %v, want only good", got)
		}
		if _, err := ctBerthctl(ctx, c, "checkpoint", "inspect", "--verify", filepath.Join(root, "good")); err != nil {
			t.Errorf("received checkpoint does not verify: %v", err)
		}
	})

	t.Run("registry", func(t *testing.T) {
		reg, err := node.StartRegistry(c.Stack.Tool("registry"), filepath.Join(t.TempDir(), "registry"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(reg.Stop)
		ref := reg.Ref("ckpt/ctl-signed:good")
		var push struct{ Digest string }
		if ctJSON(t, ctx, c, &push, "checkpoint", "push", "--plain-http", "-o", "json", good, ref); push.Digest == "" {
			t.Fatalf("push -o json: %+v", push)
		}
		pulledDir := t.TempDir()
		pulled := filepath.Join(pulledDir, "good")
		var pull struct{ SignedBy string }
		if ctJSON(t, ctx, c, &pull, "checkpoint", "pull", "--plain-http", "-o", "json", ref, pulled); !strings.HasPrefix(pull.SignedBy, "SHA256:") {
			t.Errorf("pull -o json: %+v", pull)
		}
		ctCheckModes(t, pulled)

		// the attacker has push access (their own client, no verification) and no trusted key
		for _, n := range names {
			fref := reg.Ref("ckpt/ctl-signed:" + n)
			if _, err := registry.Push(ctx, forged[n], fref, registry.Options{PlainHTTP: true}); err != nil {
				t.Fatalf("attacker's push of %s: %v", n, err)
			}
			dir := filepath.Join(pulledDir, n)
			out := ctRefused(t, ctx, c, want[n], "checkpoint", "pull", "--plain-http", fref, dir)
			t.Logf("forged %s through a registry: %s", n, strings.TrimSpace(out))
			if _, err := os.Lstat(dir); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("pull of forged %s left %s", n, dir)
			}
			// and berthctl does not push it either
			ctRefused(t, ctx, c, want[n], "checkpoint", "push", "--plain-http", forged[n], reg.Ref("ckpt/ctl-signed:relayed-"+n))
		}
		if got := ctEntries(t, pulledDir); strings.Join(got, " ") != "good" {
			t.Errorf("pull left %v, want only good", got)
		}

		// the ecosystem's verifier: cosign verifies the pushed checkpoint with the node's public key
		cosign := ctCosign(t)
		verify := func(key, ref string) (string, error) {
			out, err := exec.CommandContext(ctx, cosign, "verify", "--key", key, "--insecure-ignore-tlog", "--allow-http-registry", ref).CombinedOutput()
			return string(out), err
		}
		if out, err := verify(pub, ref); err != nil || !strings.Contains(out, push.Digest) {
			t.Errorf("cosign verify of the pushed checkpoint: %v\n%s", err, out)
		} else {
			t.Logf("cosign %s verified %s with the node key", CosignVersion, ref)
		}
		if out, err := verify(pub, reg.Ref("ckpt/ctl-signed@"+push.Digest)); err != nil {
			t.Errorf("cosign verify by digest: %v\n%s", err, out)
		}
		if out, err := verify(attackerPub, ref); err == nil {
			t.Errorf("cosign verified the node's checkpoint with the attacker's key:\n%s", out)
		}
		if out, err := verify(pub, reg.Ref("ckpt/ctl-signed:memory")); err == nil {
			t.Errorf("cosign verified the attacker's push:\n%s", out)
		}

		// a password in a reference is never echoed
		const secret = "s3cret-e2e-password"
		for _, args := range [][]string{
			{"checkpoint", "pull", "--plain-http", "berth:" + secret + "@" + reg.Addr + "/ckpt/ctl-signed:good", filepath.Join(pulledDir, "pw")},
			{"checkpoint", "pull", "--plain-http", "oci://berth:" + secret + "@" + reg.Addr + "/ckpt/ctl-signed:good", filepath.Join(pulledDir, "pw")},
			{"checkpoint", "push", "--plain-http", good, "berth:" + secret + "@" + reg.Addr + "/ckpt/ctl-signed:pw"},
		} {
			out, err := ctBerthctl(ctx, c, args...)
			if err == nil || strings.Contains(out, secret) || !strings.Contains(out, "<redacted>@") {
				t.Errorf("berthctl %s: %v\n%s", strings.Join(args[:2], " "), err, out)
			}
		}
	})
}

// TestCtlMigrateTLS: a legitimate move (copy mode, the default: the page stream on a mutual-TLS
// connection of its own) over mutual TLS to a `berthctl receive` with its trust policy keeps
// working with signing on; sending the checkpoint it left on is refused (its pages are verified
// by that receiver only); plain TCP against a TLS receiver and the reverse are
// refused naming why, a receiver off loopback without TLS does not start, and slow or silent
// peers do not keep a real sender out.
func TestCtlMigrateTLS(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const id, rid = "ctl-tls", "ctl-tls-moved"
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), id)
		_ = dst.Remove(context.Background(), rid)
	})
	ca, err := keys.NewCA(filepath.Join(t.TempDir(), "ca"), "berth-e2e-ca")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]transfer.TLSFiles{}
	for _, n := range []string{src.Name, dst.Name} {
		if files[n], err = ca.Node(n); err != nil {
			t.Fatal(err)
		}
	}
	tlsArgs := func(n *node.Node) []string {
		f := files[n.Name]
		return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
	}
	r := ctStartReceive(t, ctx, c, dst.CheckpointRoot, append(tlsArgs(dst), "--allowed-peer", src.Name)...)

	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Stream(ctx, st, client.Request{Session: "tls", Prompt: "mutual TLS", N: 20}); err != nil {
		t.Fatal(err)
	}
	var res struct {
		SignedBy string
		Bytes    int64
	}
	ctJSON(t, ctx, c, &res, append(append([]string{"migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--id", rid, "--receiver", r.addr, "--name", "ctl-tls-1", "--work-dir", filepath.Join(src.Dir, "outgoing"), "-o", "json"}, tlsArgs(src)...), id)...)
	if !strings.HasPrefix(res.SignedBy, "SHA256:") || res.Bytes == 0 {
		t.Errorf("migrate -o json: %+v", res)
	}
	rpid, status, err := dst.TaskPID(ctx, rid)
	if err != nil || status != "running" {
		t.Fatalf("moved task: %q %v", status, err)
	}
	rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(rpid))}
	if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
		t.Errorf("moved copy: %+v %v, want the session continued (1 prefill)", s, err)
	}
	// first the preflight query migrate asked over the same mutual TLS, then the checkpoint
	for i, want := range []string{"preflight", "received"} {
		select {
		case e := <-r.events:
			if e["event"] != want || (i == 1 && !strings.Contains(fmt.Sprint(e["from"]), "CN="+src.Name)) {
				t.Errorf("receive reported %v, want event %q", e, want)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("receive reported no %q event", want)
		}
	}

	// the move was copy mode (the default): its memory pages came in a page stream that only the
	// receiver verified, so sending that checkpoint on is refused before anything is sent, saying why
	ctRefused(t, ctx, c, []string{"received in copy mode", "checkpoint the container again"},
		append(append([]string{"send", "--name", "resent"}, tlsArgs(src)...), filepath.Join(dst.CheckpointRoot, "ctl-tls-1"), r.addr)...)
	// a checkpoint of the moved task, written whole on its node, for the sends below
	dir := filepath.Join(t.TempDir(), "ctl-tls-2")
	ctMust(t, ctx, c, "-a", dst.Socket, "-n", node.Namespace, "checkpoint", "create", rid, dir)
	// plain TCP against the TLS receiver, and TLS against a plain one
	ctRefused(t, ctx, c, []string{"connection refused by receiver", "requires mutual TLS"}, "send", "--name", "plain", dir, r.addr)
	plainRoot := t.TempDir()
	plain := ctStartReceive(t, ctx, c, plainRoot)
	ctRefused(t, ctx, c, []string{"it runs without TLS"}, append(append([]string{"send", "--name", "tls"}, tlsArgs(src)...), dir, plain.addr)...)
	// a certificate --allowed-peer does not name
	ctRefused(t, ctx, c, []string{"not among this receiver's allowed peers"}, append(append([]string{"send", "--name", "other"}, tlsArgs(dst)...), dir, r.addr)...)
	// plain TCP off loopback, either side
	ctRefused(t, ctx, c, []string{"transfer without mutual TLS", "--tls-ca"}, "receive", "--listen", "0.0.0.0:0", "--root", t.TempDir())
	ctRefused(t, ctx, c, []string{"transfer without mutual TLS"}, "send", dir, "192.0.2.1:7650")

	// slow and silent peers: four connections that never finish a TLS handshake (one silent,
	// three sending a ClientHello a byte at a time) hold every slot only for the 3 s handshake
	// bound; a real sender, retrying while it is told busy, gets through
	var peers []net.Conn
	t.Cleanup(func() {
		for _, p := range peers {
			p.Close()
		}
	})
	for i := range 4 {
		conn, err := net.Dial("tcp", r.addr)
		if err != nil {
			t.Fatal(err)
		}
		peers = append(peers, conn)
		if i > 0 {
			go func() {
				for range 60 {
					if _, err := conn.Write([]byte{0x16}); err != nil {
						return
					}
					time.Sleep(time.Second)
				}
			}()
		}
	}
	start := time.Now()
	busy := 0
	for {
		out, err := ctBerthctl(ctx, c, append(append([]string{"send", "--name", "after-slow"}, tlsArgs(src)...), dir, r.addr)...)
		if err == nil {
			break
		}
		if !strings.Contains(out, "try again later") || time.Since(start) > 30*time.Second {
			t.Fatalf("send while slow peers hold the slots: %v\n%s", err, out)
		}
		busy++
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("a real sender got through after %v (%d busy answers) while 4 peers stalled their handshakes", time.Since(start).Round(100*time.Millisecond), busy)
	if _, err := os.Stat(filepath.Join(dst.CheckpointRoot, "after-slow", checkpoint.ManifestFile)); err != nil {
		t.Error(err)
	}
	os.RemoveAll(filepath.Join(dst.CheckpointRoot, "after-slow"))
}

// TestCtlNoSpace: an announced size larger than the receiver's disk is refused before anything
// is written, and the receiver's root stays empty.
func TestCtlNoSpace(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	root := t.TempDir()
	if err := syscall.Mount("tmpfs", root, "tmpfs", 0, "size=64m,mode=0700"); err != nil {
		t.Skipf("mount a 64 MiB tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(root, syscall.MNT_DETACH) })

	// a checkpoint of 256 MiB of (sparse) memory: nothing of it on the source's disk
	dir := filepath.Join(t.TempDir(), "big")
	if err := os.MkdirAll(filepath.Join(dir, checkpoint.ImagesDir), 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, checkpoint.ImagesDir, "pages-1.img"), os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(256 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	files, size, err := checkpoint.DigestDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkpoint.WriteManifest(dir, &checkpoint.Manifest{Version: checkpoint.ManifestVersion, Files: files, ImageSize: size}); err != nil {
		t.Fatal(err)
	}
	ctMust(t, ctx, c, "checkpoint", "sign", dir)
	r := ctStartReceive(t, ctx, c, root)
	out := ctRefused(t, ctx, c, []string{"checkpoint rejected by receiver", "not enough free space", "bytes announced"}, "send", "--name", "big", dir, r.addr)
	t.Logf("256 MiB announced to a 64 MiB disk: %s", strings.TrimSpace(out))
	if es, _ := os.ReadDir(root); len(es) != 0 {
		var names []string
		for _, e := range es {
			names = append(names, e.Name())
		}
		t.Errorf("receiver root holds %v after the refusal", names)
	}
}
