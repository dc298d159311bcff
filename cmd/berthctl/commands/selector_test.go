package commands

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

func checkpointFingerprint() fingerprint.Fingerprint {
	return fingerprint.Fingerprint{
		Version: fingerprint.Version, Kernel: "6.18.44-fc-v669", Arch: "amd64", CRIU: "4.2.1",
		Runc: "1.5.3", Containerd: "2.4.2",
		CPU: fingerprint.CPU{Vendor: "AuthenticAMD", Flags: []string{"avx2"}},
		GPUs: []fingerprint.GPU{
			{Index: 0, UUID: "GPU-a", Name: "NVIDIA H200", MemoryBytes: 141 << 30, Driver: "580.65.06", CUDA: "13.0"},
		},
	}
}

// checkpointDir writes a small checkpoint directory with a valid berth.json.
func checkpointDir(t *testing.T, fp fingerprint.Fingerprint) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.MkdirAll(filepath.Join(dir, checkpoint.ImagesDir), 0o700); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{
		checkpoint.ImagesDir + "/pages-1.img": strings.Repeat("p", 4096),
		checkpoint.SpecFile:                   "{}",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	files, size, err := checkpoint.DigestDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	m := &checkpoint.Manifest{Version: checkpoint.ManifestVersion, Fingerprint: fp, Files: files, ImageSize: size}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	return dir
}

func runSelector(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := CheckpointSelector()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

func TestCheckpointSelector(t *testing.T) {
	fp := checkpointFingerprint()
	want := fingerprint.Selector(fp)
	dir := checkpointDir(t, fp)

	tarFile := filepath.Join(t.TempDir(), "ckpt.tar")
	var buf bytes.Buffer
	if err := archive.Write(&buf, dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tarFile, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	// berth.json first, then a cut-off bulk: selector must not need anything after berth.json.
	truncated := filepath.Join(t.TempDir(), "truncated.tar")
	if err := os.WriteFile(truncated, buf.Bytes()[:buf.Len()/2], 0o600); err != nil {
		t.Fatal(err)
	}
	// berth.json after other entries (as a kubelet-layout archive may have it).
	late := filepath.Join(t.TempDir(), "late.tar")
	manifest, err := os.ReadFile(filepath.Join(dir, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	writeTar(t, late, map[string]string{"spec.dump": "{}", "checkpoint/pages-1.img": strings.Repeat("x", 1<<20)}, "./berth.json", string(manifest))

	for _, arg := range []string{dir, tarFile, truncated, late} {
		t.Run(filepath.Base(arg), func(t *testing.T) {
			// YAML: a nodeSelector block that decodes strictly into a PodSpec.
			out, err := runSelector(t, arg)
			if err != nil {
				t.Fatalf("selector %s: %v", arg, err)
			}
			if !strings.HasPrefix(out, "nodeSelector:\n") {
				t.Errorf("YAML output does not start with nodeSelector:\n%s", out)
			}
			var spec corev1.PodSpec
			if err := yaml.UnmarshalStrict([]byte(out), &spec); err != nil {
				t.Fatalf("YAML output is not a PodSpec fragment: %v\n%s", err, out)
			}
			if !maps.Equal(spec.NodeSelector, want) {
				t.Errorf("YAML nodeSelector %v, want %v", spec.NodeSelector, want)
			}
			// JSON.
			out, err = runSelector(t, "-o", "json", arg)
			if err != nil {
				t.Fatal(err)
			}
			var v struct {
				NodeSelector map[string]string `json:"nodeSelector"`
			}
			if err := json.Unmarshal([]byte(out), &v); err != nil {
				t.Fatalf("JSON output: %v\n%s", err, out)
			}
			if !maps.Equal(v.NodeSelector, want) {
				t.Errorf("JSON nodeSelector %v, want %v", v.NodeSelector, want)
			}
		})
	}

	// Numbers stay strings in YAML ("2", "1.5" would otherwise be read as numbers).
	out, _ := runSelector(t, dir)
	for _, line := range []string{`berth.dev/containerd: "2"`, `berth.dev/runc: "1.5"`, `berth.dev/gpu-count: "1"`, `berth.dev/cuda: "13.0"`} {
		if !strings.Contains(out, line) {
			t.Errorf("YAML lacks %s:\n%s", line, out)
		}
	}
}

func writeTar(t *testing.T, file string, files map[string]string, lastName, lastBody string) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name, body string) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(body)); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range fingerprint.SortedKeys(files) {
		add(name, files[name])
	}
	if lastName != "" {
		add(lastName, lastBody)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointSelectorErrors(t *testing.T) {
	tmp := t.TempDir()
	noManifest := filepath.Join(tmp, "none.tar")
	writeTar(t, noManifest, map[string]string{"spec.dump": "{}", "checkpoint/pages-1.img": "x"}, "", "")
	badManifest := filepath.Join(tmp, "bad.tar")
	writeTar(t, badManifest, nil, "berth.json", `{"version": 99}`)
	gz := filepath.Join(tmp, "ckpt.tar.gz")
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write([]byte("not really a tar"))
	zw.Close()
	if err := os.WriteFile(gz, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	emptyDir := t.TempDir()
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"missing", []string{filepath.Join(tmp, "nope")}, "berthctl checkpoint pull"},
		{"no manifest in archive", []string{noManifest}, "no berth.json and no checkpoint/berth.json"},
		{"bad manifest", []string{badManifest}, "version 99"},
		{"gzip", []string{gz}, "gzip"},
		{"dir without manifest", []string{emptyDir}, "berth.json"},
		{"bad output", []string{"-o", "xml", emptyDir}, "want yaml or json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runSelector(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}
