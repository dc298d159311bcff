package shim

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/registry"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/test/node"
)

func TestRegistryConfig(t *testing.T) {
	dir := t.TempDir()
	load := func(body string) (Config, error) {
		p := filepath.Join(dir, "shim.toml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return LoadConfig(p)
	}
	cfg, err := load("allowed_registries = [\"127.0.0.1:5000\", \"Registry.Example\"]\nregistry_plain_http = [\"127.0.0.1:5000\"]\nregistry_config = \"/etc/berth/docker.json\"\n")
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.RegistryAllowed("127.0.0.1:5000") || !cfg.RegistryAllowed("registry.example") || cfg.RegistryAllowed("127.0.0.1:5001") || cfg.RegistryAllowed("") {
		t.Errorf("allow-list %q", cfg.AllowedRegistries)
	}
	if !cfg.RegistryPlain("127.0.0.1:5000") || cfg.RegistryPlain("registry.example") {
		t.Errorf("plain http %q", cfg.RegistryPlainHTTP)
	}
	if d := DefaultConfig(); len(d.AllowedRegistries) != 0 || d.RegistryAllowed("127.0.0.1:5000") {
		t.Error("the default config allows a registry")
	}
	for body, want := range map[string]string{
		"allowed_registries = [\"http://r:5000\"]\n":                        "allowed_registries: \"http://r:5000\"",
		"allowed_registries = [\"r:5000/path\"]\n":                          "want host[:port]",
		"allowed_registries = [\"\"]\n":                                     "want host[:port]",
		"allowed_registries = [\"a\"]\nregistry_plain_http = [\"b\"]\n":     "registry_plain_http: \"b\" is not in allowed_registries",
		"allowed_registries = [\"a\"]\nregistry_config = \"docker.json\"\n": "registry_config \"docker.json\": must be an absolute path",
		"allowed_registry = [\"a\"]\n":                                      "unknown keys",
	} {
		if _, err := load(body); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("config %q: %v; want an error containing %q", body, err, want)
		}
	}
}

// ociRestore runs prepareRestore for a container whose restore-from is ref.
func ociRestore(s *Service, ref string) (*restorePlan, error) {
	plan, err := s.prepareRestore(context.Background(), &taskAPI.CreateTaskRequest{ID: "c1"}, podSpec("", ref))
	if plan != nil {
		plan.cleanup()
	}
	return plan, err
}

func TestRestoreFromRegistryRefused(t *testing.T) {
	root := t.TempDir()
	s := NewService(nil, Config{CheckpointRoot: root, MaxArchiveBytes: 1 << 30, AllowedRegistries: []string{"127.0.0.1:1"}}, testDeps(policy(t, false)))
	tests := []struct {
		ref   string
		want  []string
		class error
	}{
		{"oci://10.1.2.3:5000/berth/ck:v1", []string{"registry 10.1.2.3:5000 is not in allowed_registries", "127.0.0.1:1"}, errdefs.ErrPermissionDenied},
		{"oci://127.0.0.1:1/berth/ck", []string{"tag or digest is required"}, errdefs.ErrInvalidArgument},
		{"docker://127.0.0.1:1/berth/ck:v1", []string{"not supported"}, errdefs.ErrInvalidArgument},
		// allowed, but nothing listens there: a network error naming the registry
		{"oci://127.0.0.1:1/berth/ck:v1", []string{"127.0.0.1:1"}, nil},
	}
	for _, tc := range tests {
		_, err := ociRestore(s, tc.ref)
		if err == nil {
			t.Errorf("%s: restored", tc.ref)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v; want it to contain %q", tc.ref, err, w)
			}
		}
		if tc.class != nil && errorClass(err) != tc.class {
			t.Errorf("%s: %v is not of class %v", tc.ref, err, tc.class)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(root, PulledDir, "*")); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
}

// TestRestoreFromRegistry pulls a checkpoint for berth.dev/restore-from=oci://... from a real
// registry on loopback: into .oci/sha256-<digest>, verified, reused by the next restore (even
// with the registry gone, when the reference names the digest), pulled again when damaged; a
// checkpoint from another node fails the fingerprint check after the pull.
func TestRestoreFromRegistry(t *testing.T) {
	stack, err := node.FindStack()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	reg, err := node.StartRegistry(stack.Tool("registry"), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src := t.TempDir()
	good := writeCheckpoint(t, src, "good", nodeFP)
	other := nodeFP
	other.Kernel = "5.10.0"
	foreign := writeCheckpoint(t, src, "foreign", other)
	desc, err := registry.Push(ctx, good, reg.Ref("berth/ck:v1"), registry.Options{PlainHTTP: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := registry.Push(ctx, foreign, reg.Ref("berth/ck:foreign"), registry.Options{PlainHTTP: true}); err != nil {
		t.Fatal(err)
	}
	unsigned := writeCheckpointWith(t, src, "unsigned", checkpointOpts{fp: nodeFP})
	if _, err := registry.Push(ctx, unsigned, reg.Ref("berth/ck:unsigned"), registry.Options{PlainHTTP: true}); err != nil {
		t.Fatal(err)
	}

	root := t.TempDir()
	cfg := Config{CheckpointRoot: root, MaxArchiveBytes: 1 << 30, MaxRootfsDiffBytes: 1 << 20, AllowedRegistries: []string{reg.Addr}}
	// this node allows unsigned checkpoints, so the pulls below work whether or not the registry
	// carries berth.sig (a node that does not is checked below with an unsigned checkpoint)
	deps := testDeps(policy(t, true))

	// HTTPS to a plain HTTP registry: refused by the transport, nothing left
	if _, err := ociRestore(NewService(nil, cfg, deps), "oci://"+reg.Ref("berth/ck:v1")); err == nil {
		t.Fatal("pulled over HTTPS from a plain HTTP registry")
	}
	cfg.RegistryPlainHTTP = []string{reg.Addr}
	s := NewService(nil, cfg, deps)

	want := filepath.Join(root, PulledDir, "sha256-"+desc.Digest.Encoded())
	strict := NewService(nil, cfg, testDeps(policy(t, false)))
	if _, err := ociRestore(strict, "oci://"+reg.Ref("berth/ck:unsigned")); !errors.Is(err, signature.ErrUnsigned) || errorClass(err) != errdefs.ErrPermissionDenied {
		t.Fatalf("unsigned pulled checkpoint: %v; want it refused as unsigned", err)
	}
	os.RemoveAll(filepath.Join(root, PulledDir))
	plan, err := ociRestore(s, "oci://"+reg.Ref("berth/ck:v1"))
	if err != nil {
		t.Fatal(err)
	}
	if plan.dir != want || plan.imagesDir() != filepath.Join(want, checkpoint.ImagesDir) || plan.extracted != "" {
		t.Fatalf("plan dir %s images %s extracted %q; want %s", plan.dir, plan.imagesDir(), plan.extracted, want)
	}
	if _, err := os.Stat(filepath.Join(root, PulledDir, checkpoint.StampDir, "sha256-"+desc.Digest.Encoded()+".json")); err != nil {
		t.Errorf("no verification stamp: %v", err)
	}

	// by digest, with the registry gone: the pulled checkpoint is reused
	reg.Stop()
	byDigest := "oci://" + reg.Addr + "/berth/ck@" + desc.Digest.String()
	if plan, err := ociRestore(s, byDigest); err != nil || plan.dir != want {
		t.Fatalf("reuse by digest: %+v %v", plan, err)
	}
	// damaged: pulled again (and the registry is gone, so that fails, leaving nothing)
	if err := os.WriteFile(filepath.Join(want, "checkpoint/core-1.img"), []byte("CORE"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ociRestore(s, byDigest); err == nil {
		t.Fatal("a damaged pulled checkpoint was used")
	}
	if left, _ := filepath.Glob(filepath.Join(root, PulledDir, "sha256-*")); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}
	if left, _ := filepath.Glob(filepath.Join(root, PulledDir, ".*-*")); len(left) > 0 {
		t.Errorf("left behind: %v", left)
	}

	reg2, err := node.StartRegistry(stack.Tool("registry"), reg.Dir) // same storage, new port
	if err != nil {
		t.Fatal(err)
	}
	defer reg2.Stop()
	cfg.AllowedRegistries, cfg.RegistryPlainHTTP = []string{reg2.Addr}, []string{reg2.Addr}
	s = NewService(nil, cfg, deps)
	if plan, err := ociRestore(s, "oci://"+reg2.Ref("berth/ck@"+desc.Digest.String())); err != nil || plan.dir != want {
		t.Fatalf("pull again: %+v %v", plan, err)
	}
	_, err = ociRestore(s, "oci://"+reg2.Ref("berth/ck:foreign"))
	if err == nil || !strings.Contains(err.Error(), "kernel") || errorClass(err) != errdefs.ErrFailedPrecondition {
		t.Fatalf("foreign checkpoint: %v; want a fingerprint mismatch naming kernel", err)
	}
	if _, err := ociRestore(s, "oci://"+reg2.Ref("berth/ck:missing")); err == nil || errorClass(err) != errdefs.ErrNotFound {
		t.Errorf("unknown tag: %v; want not found", err)
	}
}
