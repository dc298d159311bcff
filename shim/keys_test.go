package shim

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/shim/helper"
	"github.com/berth-dev/berth/shim/helper/serve"
)

// testKey is a key pair in files, as a node has one.
type testKey struct {
	priv, pub string
	key       *signature.Key
}

var (
	keysOnce sync.Once
	keysDir  string
	keys     = map[string]*testKey{}
	keysMu   sync.Mutex
)

// key returns the test key named name ("node", "other", "attacker"), generated once per test
// binary into a temporary directory.
func key(t *testing.T, name string) *testKey {
	t.Helper()
	keysOnce.Do(func() {
		var err error
		if keysDir, err = os.MkdirTemp("", "berth-shim-keys-"); err != nil {
			panic(err)
		}
	})
	keysMu.Lock()
	defer keysMu.Unlock()
	if k := keys[name]; k != nil {
		return k
	}
	pk, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(pk)
	if err != nil {
		t.Fatal(err)
	}
	pubDer, err := x509.MarshalPKIXPublicKey(&pk.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	k := &testKey{priv: filepath.Join(keysDir, name+".key"), pub: filepath.Join(keysDir, name+".pub")}
	if err := os.WriteFile(k.priv, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(k.pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDer}), 0o644); err != nil {
		t.Fatal(err)
	}
	if k.key, err = signature.LoadKey(k.priv); err != nil {
		t.Fatal(err)
	}
	keys[name] = k
	return k
}

// policy returns the trust policy of a node that signs with "node" and trusts it (and the
// trusted keys given).
func policy(t *testing.T, allowUnsigned bool, trusted ...signature.TrustedKey) *signature.Policy {
	t.Helper()
	p, err := signature.LoadPolicy(signature.TrustConfig{SigningKey: key(t, "node").priv, TrustedKeys: trusted, AllowUnsigned: allowUnsigned})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// signWith signs dir's berth.json with the named key.
func signWith(t *testing.T, dir, name string) {
	t.Helper()
	if err := signature.SignDir(context.Background(), dir, key(t, name).key); err != nil {
		t.Fatal(err)
	}
}

// testCaps are the capabilities of podSpec's container and of testProcs' processes.
var testCaps = []string{"CAP_CHOWN", "CAP_KILL", "CAP_NET_BIND_SERVICE"}

// podSpec is a destination spec: root with testCaps, in Kubernetes namespace ns ("" outside
// Kubernetes), restoring ref ("" for none).
func podSpec(ns, ref string) *specs.Spec {
	s := &specs.Spec{
		Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{
			Bounding: testCaps, Effective: testCaps, Permitted: testCaps,
		}},
		Linux:       &specs.Linux{MaskedPaths: []string{"/proc/kcore"}},
		Annotations: map[string]string{},
	}
	if ns != "" {
		s.Annotations[oci.AnnotationCRISandboxNamespace] = ns
	}
	if ref != "" {
		s.Annotations[oci.AnnotationRestoreFrom] = ref
	}
	return s
}

// unprivilegedSpec is podSpec hardened: uid 1000, no capabilities, no_new_privs.
func unprivilegedSpec(ns, ref string) *specs.Spec {
	s := podSpec(ns, ref)
	s.Process.User = specs.User{UID: 1000, GID: 1000}
	s.Process.Capabilities = &specs.LinuxCapabilities{}
	s.Process.NoNewPrivileges = true
	return s
}

// testProcs are a checkpoint's processes as podSpec's container runs them.
func testProcs(string) ([]privilege.Process, error) {
	set, _ := privilege.ParseCapSet(testCaps)
	return []privilege.Process{{PID: 1, TID: 1, Comm: "app", CapEff: set, CapPrm: set, CapBnd: set}}, nil
}

// testDeps are the dependencies of a node with nodeFP and policy p.
func testDeps(p *signature.Policy) Deps {
	return Deps{
		Fingerprint:   func(context.Context) (fingerprint.Fingerprint, error) { return nodeFP, nil },
		ReadProcesses: testProcs,
		Trust:         p,
		Registry:      servedRegistry(),
	}
}

// servedRegistry is Deps.Registry as RealDeps wires it (helper.Client), with berth-shim-helper's
// work (serve.Handlers) served in this process instead of a child: every request and answer goes
// through the helper's JSON and error kinds, so the error classes the tests check are the ones
// a real shim gets back from the helper.
func servedRegistry() Registry {
	return helper.Client{Path: helper.Name, Run: func(cmd *exec.Cmd) ([]byte, error) {
		var out bytes.Buffer
		if rc := helper.Serve(context.Background(), cmd.Stdin, &out, serve.Handlers()); rc != 0 {
			return out.Bytes(), fmt.Errorf("exit status %d", rc)
		}
		return out.Bytes(), nil
	}}
}

// checkpointOpts vary writeCheckpointWith.
type checkpointOpts struct {
	fp        fingerprint.Fingerprint
	namespace string // Kubernetes namespace recorded
	signer    string // key name; "" leaves it unsigned
	cri       bool   // CRI layout: berth.json only beside the images
	files     map[string]string
	planted   map[string]string    // files written after the signature (no manifest lists them)
	security  *privilege.Container // nil: FromSpec(podSpec)
}

// writeCheckpoint makes a valid berth checkpoint directory root/name taken on fp from a
// container with podSpec's security context, signed with the "node" key.
func writeCheckpoint(t *testing.T, root, name string, fp fingerprint.Fingerprint) string {
	t.Helper()
	return writeCheckpointWith(t, root, name, checkpointOpts{fp: fp, signer: "node"})
}

func writeCheckpointWith(t *testing.T, root, name string, o checkpointOpts) string {
	t.Helper()
	dir := filepath.Join(root, name)
	if err := os.MkdirAll(filepath.Join(dir, checkpoint.ImagesDir), 0o700); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"checkpoint/pages-1.img": strings.Repeat("x", 4096), "checkpoint/core-1.img": "core", checkpoint.SpecFile: "{}"}
	for p, b := range o.files {
		files[p] = b
	}
	for p, body := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	sec := o.security
	if sec == nil {
		c := privilege.FromSpec(podSpec("", ""))
		sec = &c
	}
	m := &checkpoint.Manifest{Fingerprint: o.fp, Container: checkpoint.ContainerInfo{ID: "c", KubernetesNamespace: o.namespace}, Security: sec}
	signed := dir
	if o.cri {
		signed = filepath.Join(dir, checkpoint.ImagesDir)
	}
	if err := checkpoint.WriteManifest(signed, m); err != nil {
		t.Fatal(err)
	}
	if o.signer != "" {
		signWith(t, signed, o.signer)
	}
	for p, body := range o.planted {
		if err := os.WriteFile(filepath.Join(dir, p), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// heldPlan holds p.dir (an existing directory) as Create does and records it as verified.
func heldPlan(t *testing.T, p *restorePlan) *restorePlan {
	t.Helper()
	if err := p.hold(""); err != nil {
		t.Fatal(err)
	}
	if err := p.statNow(); err != nil {
		t.Fatal(err)
	}
	return p
}
