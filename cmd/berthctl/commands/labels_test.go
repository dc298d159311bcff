package commands

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// parseFeatures reads "name=value" lines, skipping comments.
func parseFeatures(t *testing.T, data string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, line := range strings.Split(data, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("feature line %q has no '='", line)
		}
		out[k] = v
	}
	return out
}

func fakeGPURoot(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	_, err := fake.Setup(root, fake.NodeSpec{Driver: "580.65.06", CUDA: "12.8", GPUs: []fake.GPUSpec{
		{UUID: "GPU-11111111-1111-1111-1111-111111111111", Name: "Fake H200", MemoryBytes: 1 << 30},
		{UUID: "GPU-22222222-2222-2222-2222-222222222222", Name: "Fake H200", MemoryBytes: 1 << 30},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func TestLabelsStdout(t *testing.T) {
	cmd := Labels()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs([]string{"--gpu", "fake", "--fake-gpu-root", fakeGPURoot(t)})
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		t.Fatalf("labels: %v (stderr %s)", err, errOut.String())
	}
	l := parseFeatures(t, out.String())
	for k, want := range map[string]string{
		fingerprint.LabelGPUCount:  "2",
		fingerprint.LabelGPUModel:  "Fake-H200",
		fingerprint.LabelGPUDriver: "580.65.06",
		fingerprint.LabelCUDA:      "12.8",
	} {
		if l[k] != want {
			t.Errorf("%s = %q, want %q (all: %v)", k, l[k], want, l)
		}
	}
	for _, k := range []string{fingerprint.LabelFingerprint, fingerprint.LabelKernel, fingerprint.LabelArch, fingerprint.LabelCPUVendor} {
		if l[k] == "" {
			t.Errorf("no %s label: %v", k, l)
		}
	}
	t.Logf("labels:\n%s\nstderr: %s", out.String(), errOut.String())
}

func TestLabelsOutputAtomicAndInterval(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "berth")
	gpuRoot := fakeGPURoot(t)
	run := func(ctx context.Context, extra ...string) error {
		cmd := Labels()
		var out, errOut bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(&errOut)
		cmd.SetArgs(append([]string{"--gpu", "fake", "--fake-gpu-root", gpuRoot, "--file", file}, extra...))
		err := cmd.ExecuteContext(ctx)
		if out.Len() != 0 {
			t.Errorf("with --file, stdout got %q", out.String())
		}
		return err
	}
	if err := run(context.Background()); err != nil {
		t.Fatal(err)
	}
	first, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	if first.Mode().Perm() != 0o644 {
		t.Errorf("feature file mode %v, want 0644", first.Mode().Perm())
	}
	// Same content: the file is left alone (no rename, same inode and time).
	old := time.Unix(1, 0)
	if err := os.Chtimes(file, old, old); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(file); !st.ModTime().Equal(old) {
		t.Errorf("unchanged feature file rewritten (mtime %v)", st.ModTime())
	}
	// Changed content is replaced; --interval keeps going until cancelled, then returns nil.
	if err := os.WriteFile(file, []byte("stale=1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := run(ctx, "--interval", "50ms"); err != nil {
		t.Fatalf("labels --interval: %v", err)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if l := parseFeatures(t, string(data)); l["stale"] != "" || l[fingerprint.LabelGPUCount] != "2" {
		t.Errorf("feature file not replaced: %s", data)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("directory holds %v, want only berth (no temporary files left)", names)
	}
}

func TestLabelsErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"interval without output", []string{"--interval", "1s"}, "--interval needs --file"},
		{"negative interval", []string{"--interval", "-1s", "--file", "x"}, "must not be negative"},
		{"bad gpu", []string{"--gpu", "tpu"}, "tpu"},
		{"fake gpu without root", []string{"--gpu", "fake", "--fake-gpu-root", filepath.Join(t.TempDir(), "none")}, "fake"},
		{"output dir missing", []string{"--file", filepath.Join(t.TempDir(), "no", "such", "berth")}, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := Labels()
			var out, errOut bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&errOut)
			cmd.SetArgs(tc.args)
			err := cmd.ExecuteContext(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}
