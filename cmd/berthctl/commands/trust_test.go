package commands

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/oci/transfer"
	"github.com/berth-dev/berth/test/keys"
)

// testTrust is a node's trust configuration for a test: a signing key, its public key, and a
// config file (the shim's TOML) naming them, with Globals reading it.
type testTrust struct {
	dir, priv, pub, config string
	g                      *Globals
}

// newTrust writes a node key pair and a config file with signing_key and extra TOML lines.
func newTrust(t *testing.T, extra ...string) *testTrust {
	t.Helper()
	tr := &testTrust{dir: t.TempDir()}
	var err error
	if tr.priv, tr.pub, err = keys.SigningKey(tr.dir, "node"); err != nil {
		t.Fatal(err)
	}
	tr.config = filepath.Join(tr.dir, "shim.toml")
	body := fmt.Sprintf("signing_key = %q\n%s\n", tr.priv, strings.Join(extra, "\n"))
	if err := os.WriteFile(tr.config, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	tr.g = &Globals{Config: tr.config}
	return tr
}

// newReceiverTrust is newTrust for a receiving node: its config also lists the node's own public
// key in trusted_keys, since receive does not read signing_key.
func newReceiverTrust(t *testing.T, extra ...string) *testTrust {
	t.Helper()
	tr := newTrust(t, extra...)
	f, err := os.OpenFile(tr.config, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := fmt.Fprintf(f, "trusted_keys = [{path = %q}]\n", tr.pub); err != nil {
		t.Fatal(err)
	}
	return tr
}

// sign signs dir's berth.json with the node key.
func (tr *testTrust) sign(t *testing.T, dir string) {
	t.Helper()
	k, err := signature.LoadKey(tr.priv)
	if err != nil {
		t.Fatal(err)
	}
	if err := signature.SignDir(context.Background(), dir, k); err != nil {
		t.Fatal(err)
	}
}

// forge edits the CRIU pages image of dir and writes a berth.json with the new digests, as an
// attacker who can write the checkpoint but has no trusted key would; berth.sig is left as it
// was.
func forge(t *testing.T, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, checkpoint.ImagesDir, "pages-1.img"), []byte(strings.Repeat("X", 4096)), 0o600); err != nil {
		t.Fatal(err)
	}
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

// receiver is a `berthctl receive -o json` running in the test.
type receiver struct {
	addr, root string
	events     chan receiveEvent // closed when receive ends
	stderr     *syncBuffer
	done       chan error
	cancel     context.CancelFunc
}

type syncBuffer struct {
	mu  chan struct{}
	buf bytes.Buffer
}

func newSyncBuffer() *syncBuffer { return &syncBuffer{mu: make(chan struct{}, 1)} }

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu <- struct{}{}
	defer func() { <-b.mu }()
	return b.buf.String()
}

// startReceive runs Receive(g) with args (besides --root, --listen 127.0.0.1:0 and -o json,
// unless args has its own --listen) and waits for it to listen.
func startReceive(t *testing.T, g *Globals, args ...string) *receiver {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	r := &receiver{root: t.TempDir(), stderr: newSyncBuffer(), done: make(chan error, 1), cancel: cancel}
	pr, pw := io.Pipe()
	cmd := Receive(g)
	cmd.SetOut(pw)
	cmd.SetErr(r.stderr)
	cmd.SetArgs(append([]string{"--listen", "127.0.0.1:0", "--root", r.root, "-o", "json"}, args...))
	go func() { r.done <- cmd.ExecuteContext(ctx); pw.Close() }()
	// read every event at once: an event nobody reads would block the receiver
	r.events = make(chan receiveEvent, 64)
	go func() {
		defer close(r.events)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			var e receiveEvent
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				e = receiveEvent{Event: "unparsable", Error: fmt.Sprintf("%q: %v", sc.Text(), err)}
			}
			r.events <- e
		}
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-r.done; err != nil {
			t.Errorf("receive: %v", err)
		}
	})
	l := r.next(t)
	if l.Event != "listening" || l.Address == "" {
		t.Fatalf("first event %+v", l)
	}
	r.addr = l.Address
	return r
}

func (r *receiver) next(t *testing.T) receiveEvent {
	t.Helper()
	select {
	case e, ok := <-r.events:
		if !ok {
			t.Fatalf("receive ended (stderr %s)", r.stderr.String())
		}
		return e
	case <-time.After(30 * time.Second):
		t.Fatalf("no event from receive in 30s (stderr %s)", r.stderr.String())
		return receiveEvent{}
	}
}

// entries lists the root's entries but the verification stamps.
func (r *receiver) entries(t *testing.T) []string {
	t.Helper()
	es, err := os.ReadDir(r.root)
	if err != nil {
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

// send runs Send with args and returns its error.
func send(args ...string) error {
	cmd := Send()
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	cmd.SetArgs(args)
	return cmd.ExecuteContext(context.Background())
}

func TestNodeConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	top := write("top.toml", `checkpoint_root = "/var/lib/x"
criu_path = "/usr/sbin/criu"
gpu = "fake"
signing_key = "/etc/berth/node.key"
allow_unsigned = true
[[trusted_keys]]
path = "/etc/berth/a.pub"
namespaces = ["team-a"]
[some_future_table]
key = 1
`)
	table := write("table.toml", `checkpoint_root = "/var/lib/y"
[trust]
signing_key = "/etc/berth/node.key"
[[trust.trusted_keys]]
path = "/etc/berth/b.pub"
`)
	both := write("both.toml", "signing_key = \"/k\"\n[trust]\nsigning_key = \"/k\"\n")
	relative := write("rel.toml", "signing_key = \"node.key\"\n")
	relRoot := write("relroot.toml", "checkpoint_root = \"ckpts\"\n")
	bad := write("bad.toml", "signing_key = \n")

	c, err := loadNodeConfig(top, "--config", true)
	if err != nil || c.CheckpointRoot != "/var/lib/x" || c.SigningKey != "/etc/berth/node.key" || !c.AllowUnsigned ||
		len(c.TrustedKeys) != 1 || c.TrustedKeys[0].Path != "/etc/berth/a.pub" || c.TrustedKeys[0].Namespaces[0] != "team-a" {
		t.Errorf("top-level keys: %+v, %v", c, err)
	}
	c, err = loadNodeConfig(table, "--config", true)
	if err != nil || c.CheckpointRoot != "/var/lib/y" || c.SigningKey != "/etc/berth/node.key" || len(c.TrustedKeys) != 1 {
		t.Errorf("[trust] table: %+v, %v", c, err)
	}
	if c, err := loadNodeConfig(filepath.Join(dir, "none.toml"), "--config", false); err != nil || c.SigningKey != "" {
		t.Errorf("missing default file: %+v, %v; want no keys", c, err)
	}
	for _, tc := range []struct {
		path string
		want string
	}{
		{filepath.Join(dir, "none.toml"), "no such file"},
		{both, "both at the top level and in [trust]"},
		{relative, "must be an absolute path"},
		{relRoot, "checkpoint_root \"ckpts\": must be an absolute path"},
		{bad, "bad.toml"},
	} {
		if _, err := loadNodeConfig(tc.path, "--config "+tc.path, true); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "--config") {
			t.Errorf("%s: %v, want an error naming --config and containing %q", tc.path, err, tc.want)
		}
	}

	// the root's --config and $BERTH_SHIM_CONFIG
	var g Globals
	fs := newFlagSet()
	g.AddFlags(fs, func(k string) string {
		if k == EnvConfig {
			return table
		}
		return ""
	})
	if g.Config != table {
		t.Errorf("--config default %q, want $%s %q", g.Config, EnvConfig, table)
	}
	if _, err := os.Stat(DefaultConfig); errors.Is(err, os.ErrNotExist) {
		g2 := Globals{}
		g2.AddFlags(newFlagSet(), func(string) string { return "" })
		if c, err := g2.config(); g2.Config != DefaultConfig || err != nil || c.SigningKey != "" {
			t.Errorf("default --config %q: %+v, %v", g2.Config, c, err)
		}
	}
}

// TestReceiveTrust: receive keeps a checkpoint signed by a trusted key and refuses, before it is
// renamed into place, a forged one (an image edited, digests regenerated), an unsigned one and
// one signed by an unknown key, naming the reason; --allow-unsigned admits the unsigned one, with
// a warning.
func TestReceiveTrust(t *testing.T) {
	tr := newReceiverTrust(t)
	attacker, err := os.MkdirTemp(t.TempDir(), "attacker")
	if err != nil {
		t.Fatal(err)
	}
	attackerKey, _, err := keys.SigningKey(attacker, "attacker")
	if err != nil {
		t.Fatal(err)
	}
	r := startReceive(t, tr.g)

	good := checkpointDir(t, checkpointFingerprint())
	tr.sign(t, good)
	if err := send("--name", "good", good, r.addr); err != nil {
		t.Fatalf("send a signed checkpoint: %v", err)
	}
	if e := r.next(t); e.Event != "received" {
		t.Fatalf("signed checkpoint: %+v", e)
	}

	forged := checkpointDir(t, checkpointFingerprint())
	tr.sign(t, forged)
	forge(t, forged)
	unsigned := checkpointDir(t, checkpointFingerprint())
	foreign := checkpointDir(t, checkpointFingerprint())
	k, err := signature.LoadKey(attackerKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := signature.SignDir(context.Background(), foreign, k); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, dir, want string
		sentinel        error
	}{
		{"forged", forged, "differs from the manifest", signature.ErrBadSignature},
		{"unsigned", unsigned, "checkpoint is not signed", signature.ErrUnsigned},
		{"foreign", foreign, "not signed by a trusted key", signature.ErrUntrustedKey},
	} {
		err := send("--name", tc.name, tc.dir, r.addr)
		if err == nil || !errors.Is(err, transfer.ErrRejected) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("send %s: %v, want a rejection containing %q", tc.name, err, tc.want)
		}
		if e := r.next(t); e.Event != "rejected" || !strings.Contains(e.Error, tc.want) {
			t.Errorf("%s: event %+v", tc.name, e)
		}
	}
	if got := r.entries(t); strings.Join(got, " ") != "good" {
		t.Errorf("root holds %v, want only good", got)
	}

	// the opt-out admits the unsigned one, and says so every time
	lab := startReceive(t, tr.g, "--allow-unsigned")
	if err := send("--name", "unsigned", unsigned, lab.addr); err != nil {
		t.Fatalf("send unsigned under --allow-unsigned: %v", err)
	}
	if e := lab.next(t); e.Event != "received" {
		t.Errorf("unsigned under --allow-unsigned: %+v", e)
	}
	if !strings.Contains(lab.stderr.String(), "warning: accepted only because allow_unsigned is set") {
		t.Errorf("no warning on stderr: %q", lab.stderr.String())
	}
	// but never a forgery
	if err := send("--name", "forged", forged, lab.addr); err == nil || !strings.Contains(err.Error(), "differs from the manifest") {
		t.Errorf("forged under --allow-unsigned: %v", err)
	}
}

// TestReceiveTLS: a TLS receiver takes a TLS sender with a certificate of its CA; it refuses a
// plain-TCP sender, a TLS sender of another CA and one --allowed-peer does not name; a TLS sender
// refuses a plain receiver; neither side runs plain TCP off loopback.
func TestReceiveTLS(t *testing.T) {
	tr := newReceiverTrust(t)
	ca, err := keys.NewCA(filepath.Join(t.TempDir(), "ca"), "berth-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	other, err := keys.NewCA(filepath.Join(t.TempDir(), "other"), "other-ca")
	if err != nil {
		t.Fatal(err)
	}
	tlsArgs := func(f transfer.TLSFiles) []string {
		return []string{"--tls-ca", f.CA, "--tls-cert", f.Cert, "--tls-key", f.Key}
	}
	nodeA, err := ca.Node("node-a")
	if err != nil {
		t.Fatal(err)
	}
	nodeB, err := ca.Node("node-b")
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := other.Node("node-b")
	if err != nil {
		t.Fatal(err)
	}
	dir := checkpointDir(t, checkpointFingerprint())
	tr.sign(t, dir)

	r := startReceive(t, tr.g, tlsArgs(nodeA)...)
	if err := send(append(tlsArgs(nodeB), "--name", "ok", dir, r.addr)...); err != nil {
		t.Fatalf("TLS send: %v", err)
	}
	if e := r.next(t); e.Event != "received" || !strings.Contains(e.From, "CN=node-b") {
		t.Errorf("TLS send: event %+v (want the peer's certificate named)", e)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"plain sender", nil, "requires mutual TLS"},
		{"other CA", tlsArgs(stranger), "TLS"},
	} {
		err := send(append(tc.args, "--name", "x", dir, r.addr)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
		if e := r.next(t); e.Event != "rejected" {
			t.Errorf("%s: event %+v", tc.name, e)
		}
	}

	pinned := startReceive(t, tr.g, append(tlsArgs(nodeA), "--allowed-peer", "node-c")...)
	if err := send(append(tlsArgs(nodeB), "--name", "x", dir, pinned.addr)...); err == nil || !errors.Is(err, transfer.ErrRefused) || !strings.Contains(err.Error(), "not among this receiver's allowed peers") {
		t.Errorf("peer not allowed: %v", err)
	}

	plain := startReceive(t, tr.g)
	if err := send(append(tlsArgs(nodeB), "--name", "x", dir, plain.addr)...); err == nil || !strings.Contains(err.Error(), "runs without TLS") {
		t.Errorf("TLS sender, plain receiver: %v", err)
	}

	// off loopback: plain TCP is refused on both sides, before any connection
	if err := send("--name", "x", dir, "192.0.2.1:7650"); err == nil || !errors.Is(err, transfer.ErrInsecure) {
		t.Errorf("plain send off loopback: %v", err)
	}
	cmd := Receive(tr.g)
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	cmd.SetArgs([]string{"--listen", "0.0.0.0:0", "--root", t.TempDir()})
	if err := cmd.ExecuteContext(context.Background()); err == nil || !errors.Is(err, transfer.ErrInsecure) || !strings.Contains(err.Error(), "--listen 0.0.0.0:0") {
		t.Errorf("plain receive on 0.0.0.0: %v", err)
	}
	cmd = Receive(tr.g)
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	cmd.SetArgs([]string{"--allowed-peer", "node-b", "--root", t.TempDir()})
	if err := cmd.ExecuteContext(context.Background()); err == nil || !strings.Contains(err.Error(), "--allowed-peer") {
		t.Errorf("--allowed-peer without TLS: %v", err)
	}
}

// TestSignAndInspect: checkpoint sign signs an intact checkpoint only; inspect --verify names the
// key and refuses what the policy refuses.
func TestSignAndInspect(t *testing.T) {
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
	dir := checkpointDir(t, checkpointFingerprint())
	if _, err := run(CheckpointInspect, tr.g, "--verify", dir); err == nil || !errors.Is(err, signature.ErrUnsigned) {
		t.Errorf("inspect --verify of an unsigned checkpoint: %v", err)
	}
	out, err := run(CheckpointSign, tr.g, dir)
	if err != nil || !strings.Contains(out, "signed "+dir+" with SHA256:") {
		t.Fatalf("sign: %q, %v", out, err)
	}
	if out, err := run(CheckpointInspect, tr.g, "--verify", dir); err != nil || !strings.Contains(out, "signed by") || !strings.Contains(out, "SHA256:") {
		t.Errorf("inspect --verify: %q, %v", out, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, checkpoint.SignatureFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("berth.sig: %v, %v", fi, err)
	}
	// another node that does not trust this key
	if _, err := run(CheckpointInspect, newTrust(t).g, "--verify", dir); err == nil || !errors.Is(err, signature.ErrUntrustedKey) {
		t.Errorf("inspect --verify elsewhere: %v", err)
	}
	// --trusted-key adds it
	if _, err := run(CheckpointInspect, newTrust(t).g, "--verify", "--trusted-key", tr.pub, dir); err != nil {
		t.Errorf("inspect --verify --trusted-key: %v", err)
	}
	forge(t, dir)
	if _, err := run(CheckpointSign, tr.g, filepath.Join(dir, "none")); err == nil {
		t.Error("sign of a missing directory succeeded")
	}
	if _, err := run(CheckpointInspect, tr.g, "--verify", dir); err == nil || !errors.Is(err, signature.ErrBadSignature) {
		t.Errorf("inspect --verify of a forged checkpoint: %v", err)
	}
	// sign refuses a checkpoint whose files do not match its berth.json
	if err := os.WriteFile(filepath.Join(dir, checkpoint.SpecFile), []byte(`{"x":1}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := run(CheckpointSign, tr.g, dir); err == nil || !errors.Is(err, checkpoint.ErrSizeMismatch) {
		t.Errorf("sign of a changed checkpoint: %v", err)
	}
	// no key: sign says how to give one
	if _, err := run(CheckpointSign, &Globals{Config: filepath.Join(t.TempDir(), "none.toml")}, dir); err == nil || !errors.Is(err, errNoSigningKey) {
		t.Errorf("sign without a key: %v", err)
	}
}

func newFlagSet() *pflag.FlagSet { return pflag.NewFlagSet("berthctl", pflag.ContinueOnError) }

// TestCheckpointRootFromConfig: --root, else checkpoint_root of --config, else the default.
func TestCheckpointRootFromConfig(t *testing.T) {
	tr := newTrust(t, `checkpoint_root = "/srv/berth/ckpts"`)
	for _, tc := range []struct {
		g    *Globals
		args []string
		want string
	}{
		{tr.g, nil, "/srv/berth/ckpts"},
		{tr.g, []string{"--root", "/elsewhere"}, "/elsewhere"},
		{&Globals{Config: filepath.Join(t.TempDir(), "none.toml")}, nil, checkpoint.DefaultRoot},
	} {
		cmd := Receive(tc.g)
		if err := cmd.ParseFlags(tc.args); err != nil {
			t.Fatal(err)
		}
		root, _ := cmd.Flags().GetString("root")
		got, err := tc.g.checkpointRoot(cmd.Flags(), root)
		if err != nil || got != tc.want {
			t.Errorf("%v: root %q, %v; want %q", tc.args, got, err, tc.want)
		}
	}
}

// TestVerifyCheckpointNamespace: a key trusted only for some Kubernetes namespaces admits a
// checkpoint at receive or pull time exactly when the signed manifest records one of them (the
// shim's checkpoint/berth.json when the top-level one records none).
func TestVerifyCheckpointNamespace(t *testing.T) {
	signer := newTrust(t)
	for _, tc := range []struct {
		name, recorded string
		inner          bool // record the namespace in checkpoint/berth.json only
		wantErr        error
	}{
		{name: "recorded namespace trusted", recorded: "team-a"},
		{name: "recorded by the shim only", recorded: "team-a", inner: true},
		{name: "other namespace", recorded: "team-b", wantErr: signature.ErrUntrustedKey},
		{name: "none recorded", wantErr: signature.ErrUntrustedKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			images := filepath.Join(dir, checkpoint.ImagesDir)
			if err := os.MkdirAll(images, 0o700); err != nil {
				t.Fatal(err)
			}
			inner := &checkpoint.Manifest{Version: checkpoint.ManifestVersion}
			top := &checkpoint.Manifest{Version: checkpoint.ManifestVersion}
			if tc.inner {
				inner.Container.KubernetesNamespace = tc.recorded
			} else {
				top.Container.KubernetesNamespace = tc.recorded
			}
			if err := checkpoint.WriteManifest(images, inner); err != nil {
				t.Fatal(err)
			}
			var err error
			if top.Files, top.ImageSize, err = checkpoint.DigestDir(dir); err != nil {
				t.Fatal(err)
			}
			if err := checkpoint.WriteManifest(dir, top); err != nil {
				t.Fatal(err)
			}
			signer.sign(t, dir)
			p, err := signature.LoadPolicy(signature.TrustConfig{TrustedKeys: []signature.TrustedKey{{Path: signer.pub, Namespaces: []string{"team-a"}}}})
			if err != nil {
				t.Fatal(err)
			}
			_, err = verifyCheckpoint(context.Background(), p, dir, io.Discard)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("verifyCheckpoint = %v, want %v", err, tc.wantErr)
			}
		})
	}
}

// TestReceiveNeedsNoSigningKey: receive verifies and never signs, so it never reads signing_key:
// it starts and keeps a checkpoint a trusted key signed where the configured signing_key is not
// there (the node agent, which does not mount the node's private key), and it does not trust a
// key only because signing_key names it.
func TestReceiveNeedsNoSigningKey(t *testing.T) {
	tr := newTrust(t)
	// the node's key as the agent sees it: signing_key names a file that is not mounted
	cfg := fmt.Sprintf("signing_key = %q\ntrusted_keys = [{path = %q}]\n", filepath.Join(tr.dir, "not-mounted", "node.key"), tr.pub)
	if err := os.WriteFile(tr.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	r := startReceive(t, tr.g)
	good := checkpointDir(t, checkpointFingerprint())
	tr.sign(t, good)
	if err := send("--name", "good", good, r.addr); err != nil {
		t.Fatalf("send a signed checkpoint: %v", err)
	}
	if e := r.next(t); e.Event != "received" {
		t.Fatalf("signed checkpoint: %+v", e)
	}

	// signing_key alone (the key is there) makes no key trusted by receive
	only := newTrust(t)
	r2 := startReceive(t, only.g)
	signed := checkpointDir(t, checkpointFingerprint())
	only.sign(t, signed)
	if err := send("--name", "own", signed, r2.addr); err == nil || !errors.Is(err, transfer.ErrRejected) || !strings.Contains(err.Error(), "not signed by a trusted key") {
		t.Errorf("send a checkpoint signed only by signing_key's key: %v, want a rejection (untrusted key)", err)
	}
	if e := r2.next(t); e.Event != "rejected" {
		t.Errorf("own-key checkpoint: %+v", e)
	}
}
