package fingerprint

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"
)

func constProbe(v string) VersionProbe {
	return func(context.Context) (string, error) { return v, nil }
}

func TestCollectAmd64(t *testing.T) {
	fp, err := Collect(context.Background(), Sources{
		ProcRoot:          "testdata/proc-amd64",
		CRIUVersion:       constProbe("4.2.0"),
		RuncVersion:       constProbe("1.5.3"),
		ContainerdVersion: constProbe("2.4.2"),
		Arch:              "amd64",
	})
	if err != nil {
		t.Fatal(err)
	}
	want := Fingerprint{
		Version:    Version,
		Kernel:     "6.18.44-fc-v669",
		Arch:       "amd64",
		CRIU:       "4.2.0",
		Runc:       "1.5.3",
		Containerd: "2.4.2",
		CPU: CPU{
			Vendor:    "AuthenticAMD",
			Family:    "26",
			Model:     "2",
			ModelName: "AMD EPYC",
			Flags: []string{
				"abm", "adx", "aes", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512_vnni",
				"avx512bw", "avx512dq", "avx512f", "avx512vl", "avx_vnni", "bmi1", "bmi2",
				"clzero", "cmov", "cx16", "cx8", "erms", "f16c", "fma", "fsgsbase", "fsrm",
				"lahf_lm", "mmx", "mmxext", "movbe", "pclmulqdq", "pni", "popcnt", "rdpid",
				"rdrand", "sha_ni", "sse", "sse2", "sse4_1", "sse4_2", "sse4a", "ssse3",
				"vaes", "vpclmulqdq", "xgetbv1", "xsave", "xsavec", "xsaveopt", "xsaves",
			},
		},
	}
	if !reflect.DeepEqual(fp, want) {
		t.Errorf("Collect:\n got %+v\nwant %+v", fp, want)
	}
}

func TestCollectArm64(t *testing.T) {
	fp, err := Collect(context.Background(), Sources{ProcRoot: "testdata/proc-arm64", Arch: "arm64"})
	if err != nil {
		t.Fatal(err)
	}
	want := CPU{
		Vendor: "0x41",
		Family: "8",
		Model:  "0xd0c",
		Flags: []string{"aes", "asimd", "asimddp", "asimdhp", "asimdrdm", "atomics", "cpuid",
			"crc32", "dcpop", "evtstrm", "fp", "fphp", "lrcpc", "pmull", "sha1", "sha2"},
	}
	if !reflect.DeepEqual(fp.CPU, want) {
		t.Errorf("CPU:\n got %+v\nwant %+v", fp.CPU, want)
	}
	if fp.Kernel != "6.1.0-9-arm64" || fp.Arch != "arm64" || fp.CRIU != "" || fp.Runc != "" || fp.Containerd != "" {
		t.Errorf("unexpected fields: %+v", fp)
	}
}

func TestCollectDefaults(t *testing.T) {
	// The zero Sources reads this node's /proc and runtime.GOARCH.
	if _, err := os.Stat("/proc/cpuinfo"); err != nil {
		t.Skip("no /proc/cpuinfo on this machine")
	}
	fp, err := Collect(context.Background(), Sources{})
	if err != nil {
		t.Fatal(err)
	}
	if fp.Arch != runtime.GOARCH || fp.Kernel == "" || fp.Version != Version {
		t.Errorf("unexpected fingerprint %+v", fp)
	}
	t.Logf("this node: %+v hash=%s", fp, fp.Hash())
}

func TestCollectErrors(t *testing.T) {
	probeErr := errors.New("probe failed")
	fp, err := Collect(context.Background(), Sources{
		ProcRoot:    "testdata/does-not-exist",
		CRIUVersion: func(context.Context) (string, error) { return "", probeErr },
		RuncVersion: constProbe("1.5.3"),
		Arch:        "amd64",
	})
	if err == nil {
		t.Fatal("want error")
	}
	if !errors.Is(err, fs.ErrNotExist) || !errors.Is(err, probeErr) {
		t.Errorf("error %v should match fs.ErrNotExist and the probe's error", err)
	}
	for _, s := range []string{"kernel", "cpu", "criu", filepath.Join("testdata/does-not-exist", "cpuinfo")} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q should mention %q", err, s)
		}
	}
	if fp.Runc != "1.5.3" || fp.Arch != "amd64" || fp.Version != Version {
		t.Errorf("partial fingerprint lost collected fields: %+v", fp)
	}

	_, err = Collect(context.Background(), Sources{ProcRoot: "testdata/proc-empty"})
	if !errors.Is(err, ErrNoCPU) {
		t.Errorf("empty cpuinfo: got %v, want ErrNoCPU", err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = Collect(ctx, Sources{ProcRoot: "testdata/proc-amd64", RuncVersion: constProbe("1.5.3")})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled ctx: got %v, want context.Canceled", err)
	}
}

func TestCPUFlagRelevant(t *testing.T) {
	for _, f := range []string{"sse", "sse4_2", "ssse3", "avx", "avx512f", "avx512_fp16", "avx_vnni",
		"fma", "bmi1", "bmi2", "aes", "pclmulqdq", "sha_ni", "adx", "rdrand", "rdseed", "f16c",
		"movbe", "popcnt", "xsave", "xsaveopt", "xsavec", "xsaves", "amx_tile", "amx_bf16",
		"fsgsbase", "erms", "pni"} {
		if !CPUFlagRelevant(f) {
			t.Errorf("%s should be relevant", f)
		}
	}
	for _, f := range []string{"fpu_exception", "hypervisor", "tsc_known_freq", "x2apic", "vmx", "svm",
		"constant_tsc", "nopl", "arat", "ibpb", "md_clear", ""} {
		if CPUFlagRelevant(f) {
			t.Errorf("%s should not be relevant", f)
		}
	}
}

func TestVersionToken(t *testing.T) {
	for _, tc := range []struct {
		line, want string
		ok         bool
	}{
		{"runc version 1.5.3", "1.5.3", true},
		{"containerd github.com/containerd/containerd/v2 v2.4.2 0123abcd", "2.4.2", true},
		{"containerd github.com/containerd/containerd/v2 2.4.2+unknown ", "2.4.2", true},
		{"runc version 1.6.0-rc.1", "1.6.0-rc.1", true},
		{"Version: 4.2", "4.2", true},
		{"nothing here v2", "", false},
		{"", "", false},
	} {
		got, ok := versionToken(tc.line)
		if got != tc.want || ok != tc.ok {
			t.Errorf("versionToken(%q) = %q, %v; want %q, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}

func writeScript(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tool")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestExecVersion(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	ctx := context.Background()

	runc := writeScript(t, `printf 'runc version 1.5.3\ncommit: v1.5.3-0-gabc\nspec: 1.3.0\n'`)
	if v, err := ExecVersion(runc, "--version")(ctx); err != nil || v != "1.5.3" {
		t.Errorf("runc: got %q, %v", v, err)
	}
	ctrd := writeScript(t, `echo "containerd github.com/containerd/containerd/v2 v2.4.2 0123abcd"`)
	if v, err := ExecVersion(ctrd, "--version")(ctx); err != nil || v != "2.4.2" {
		t.Errorf("containerd: got %q, %v", v, err)
	}
	bad := writeScript(t, `echo "no version"; echo "1.2.3"`)
	if _, err := ExecVersion(bad)(ctx); !errors.Is(err, ErrNoVersion) || !strings.Contains(err.Error(), "no version") {
		t.Errorf("no version: got %v", err)
	}
	fail := writeScript(t, `echo boom >&2; exit 3`)
	if _, err := ExecVersion(fail)(ctx); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("failing command: got %v", err)
	}
	var ee *exec.ExitError
	if _, err := ExecVersion(fail)(ctx); !errors.As(err, &ee) {
		t.Errorf("failing command: %v should wrap *exec.ExitError", err)
	}
	if _, err := ExecVersion(filepath.Join(t.TempDir(), "missing"))(ctx); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing binary: got %v, want fs.ErrNotExist", err)
	}
	slow := writeScript(t, `exec sleep 10`)
	tctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := ExecVersion(slow)(tctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("slow command: got %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("slow command took %v", d)
	}
}

// TestExecVersionReal runs the real runc and containerd of berth's stack when they are present
// (BERTH_RUNC / BERTH_CONTAINERD, else PATH).
func TestExecVersionReal(t *testing.T) {
	for _, tc := range []struct{ env, name string }{{"BERTH_RUNC", "runc"}, {"BERTH_CONTAINERD", "containerd"}} {
		path := os.Getenv(tc.env)
		if path == "" {
			p, err := exec.LookPath(tc.name)
			if err != nil {
				t.Logf("%s not found; skipping it", tc.name)
				continue
			}
			path = p
		}
		v, err := ExecVersion(path, "--version")(context.Background())
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if _, ok := parseVersion(v); !ok || strings.HasPrefix(v, "v") {
			t.Errorf("%s: version %q not normalized", tc.name, v)
		}
		t.Logf("%s %s", tc.name, v)
	}
}
