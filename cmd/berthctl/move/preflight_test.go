package move

import (
	"archive/tar"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci/checkpoint"
)

func TestPreflightRefusals(t *testing.T) {
	proc := t.TempDir()
	if err := os.WriteFile(filepath.Join(proc, "meminfo"), []byte("MemTotal: 100 kB\nMemAvailable:  1024 kB\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(proc, "42"), 0o700); err != nil {
		t.Fatal(err)
	}
	limit := int64(1 << 20)
	missing := filepath.Join(t.TempDir(), "gone")
	need := Need{
		MemoryBytes: 4 << 20,
		PIDs:        []int{42, 43},
		Spec: &specs.Spec{
			Mounts: []specs.Mount{{Destination: "/data", Source: missing, Type: "bind"}, {Destination: "/ok", Source: proc, Options: []string{"rbind"}}},
			Linux: &specs.Linux{
				Resources:  &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}},
				Namespaces: []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/var/run/netns/x"}},
			},
		},
	}
	err := Preflight(t.Context(), Destination{Local: true, ProcRoot: proc}, need)
	var pe *PreflightError
	if !errors.As(err, &pe) || !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Preflight = %v, want a PreflightError of class FailedPrecondition", err)
	}
	for _, want := range []string{
		"linux.namespaces[network].path is /var/run/netns/x",
		"linux.resources.memory.limit is 1048576 bytes, needs >= 4194304 bytes",
		"mounts[0].source (destination /data) is " + missing + " (missing)",
		"PID 42 is in use in the host's PID namespace",
		"MemAvailable is 1048576 bytes, needs >= 4194304 bytes",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%v\ndoes not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "PID 43") || strings.Contains(err.Error(), "/ok") {
		t.Errorf("refused what is fine: %v", err)
	}
	// a remote destination is checked for what a client can see from here only
	err = Preflight(t.Context(), Destination{ProcRoot: proc}, need)
	if err == nil || strings.Contains(err.Error(), "MemAvailable") || strings.Contains(err.Error(), "mounts[0]") {
		t.Errorf("remote: %v", err)
	}
	if err := Preflight(t.Context(), Destination{Local: true, ProcRoot: proc}, Need{MemoryBytes: 1024}); err != nil {
		t.Errorf("fits: %v", err)
	}
}

func TestNeedOfCheckpoint(t *testing.T) {
	dir := t.TempDir()
	m := &checkpoint.Manifest{Version: checkpoint.ManifestVersion, Container: checkpoint.ContainerInfo{Image: "img:1", ImageDigest: "sha256:ab"},
		CRIU: checkpoint.CRIUStats{PagesWritten: 3}, Files: []checkpoint.File{{Path: "checkpoint/core-1.img", Size: 99, Digest: "sha256:" + strings.Repeat("0", 64)}}}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, checkpoint.SpecFile), []byte(`{"ociVersion":"1.2.0","mounts":[{"destination":"/d","source":"/s","type":"bind"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	arch := filepath.Join(t.TempDir(), "ck.tar")
	f, err := os.Create(arch)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	for _, name := range []string{checkpoint.ManifestFile, checkpoint.SpecFile} {
		b, _ := os.ReadFile(filepath.Join(dir, name))
		_ = tw.WriteHeader(&tar.Header{Name: "./" + name, Mode: 0o600, Size: int64(len(b)), Typeflag: tar.TypeReg})
		_, _ = tw.Write(b)
	}
	tw.Close()
	f.Close()
	for _, p := range []string{dir, arch} {
		n, err := NeedOfCheckpoint(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if n.Image != "img:1" || n.ImageDigest != "sha256:ab" || n.MemoryBytes != 3*checkpoint.PageSize || n.DiskBytes != 99 ||
			n.Spec == nil || len(n.Spec.Mounts) != 1 || n.Fingerprint == nil {
			t.Errorf("%s: %+v", p, n)
		}
	}
}
