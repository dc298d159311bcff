package criu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/criu/internal/criutest"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// criuPath returns the real criu binary or skips the test (criutest.Path).
func criuPath(t *testing.T) string { return criutest.Path(t) }

// fakeCriu writes a shell script named criu and returns its path.
func fakeCriu(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "criu")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestNew(t *testing.T) {
	if got := New("").Path(); got != "criu" {
		t.Errorf(`New("").Path() = %q, want "criu"`, got)
	}
	if got := New("/x/criu").Path(); got != "/x/criu" {
		t.Errorf("Path() = %q", got)
	}
}

func TestNotFound(t *testing.T) {
	ctx := context.Background()
	missing := filepath.Join(t.TempDir(), "criu")
	for _, tc := range []struct {
		path, mention string
	}{
		{missing, missing},
		{"berth-no-such-criu", `"berth-no-such-criu" in PATH`},
	} {
		c := New(tc.path)
		_, verr := c.Version(ctx)
		_, ferr := c.Features(ctx)
		cerr := c.Check(ctx)
		for name, err := range map[string]error{"Version": verr, "Features": ferr, "Check": cerr} {
			if !errors.Is(err, ErrNotFound) {
				t.Errorf("%s(%s) = %v, want ErrNotFound", name, tc.path, err)
				continue
			}
			t.Logf("%s: %v", name, err)
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("%s(%s) error %q should mention %q", name, tc.path, err, tc.mention)
			}
		}
	}

	// Present but not executable is not found either.
	p := filepath.Join(t.TempDir(), "criu")
	if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := New(p).Version(ctx); !errors.Is(err, ErrNotFound) {
		t.Errorf("non-executable: got %v, want ErrNotFound", err)
	}
}

func TestBrokenBinary(t *testing.T) {
	// A criu that exits at once without speaking the RPC.
	p := fakeCriu(t, "echo 'Version: 3.17.1'; echo broken >&2; exit 1")
	c := New(p)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := c.Version(ctx)
	if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrTooOld) || !strings.Contains(err.Error(), p) {
		t.Errorf("Version: got %v, want an RPC error naming %s", err, p)
	}
	t.Logf("Version: %v", err)
	_, err = c.Features(ctx)
	t.Logf("Features: %v", err)
	if err == nil || errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), p) {
		t.Errorf("Features: got %v, want an RPC error naming %s", err, p)
	}
	if err != nil && !strings.Contains(err.Error(), "broken") {
		t.Errorf("Features error %q should carry criu's stderr", err)
	}
}

func TestContextBoundsCalls(t *testing.T) {
	// A criu that never answers.
	c := New(fakeCriu(t, "exec sleep 3"))
	for name, call := range map[string]func(context.Context) error{
		"Version":  func(ctx context.Context) error { _, err := c.Version(ctx); return err },
		"Features": func(ctx context.Context) error { _, err := c.Features(ctx); return err },
		"Check":    func(ctx context.Context) error { return c.Check(ctx) },
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		start := time.Now()
		err := call(ctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: got %v, want DeadlineExceeded", name, err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("%s took %v after a 200ms deadline", name, d)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := New(criuOrTrue(t)).Version(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled ctx: got %v", err)
	}
}

// criuOrTrue is any existing executable, for tests that must not reach it.
func criuOrTrue(t *testing.T) string {
	p, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true(1)")
	}
	return p
}

func TestCheckUnknownFeature(t *testing.T) {
	err := New(filepath.Join(t.TempDir(), "criu")).Check(context.Background(), Feature("teleport"))
	if err == nil || !strings.Contains(err.Error(), "teleport") || errors.Is(err, ErrNotFound) {
		t.Errorf("got %v, want an unknown-feature error naming it", err)
	}
}

func TestFeaturesHas(t *testing.T) {
	f := Features{MemTrack: true, PidfdStore: true}
	for feat, want := range map[Feature]bool{
		FeatureMemTrack: true, FeatureLazyPages: false, FeaturePidfdStore: true, "nope": false,
	} {
		if got := f.Has(feat); got != want {
			t.Errorf("Has(%s) = %v, want %v", feat, got, want)
		}
	}
}

func TestRealVersion(t *testing.T) {
	path := criuPath(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := New(path).Version(ctx)
	if err != nil {
		t.Fatalf("Version: %v", err)
	}
	if v.Less(MinVersion) {
		t.Errorf("Version %v < MinVersion without error", v)
	}
	// The CLI agrees with the RPC.
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	if err != nil {
		t.Fatalf("criu --version: %v", err)
	}
	cli, err := ParseVersion(strings.TrimPrefix(strings.SplitN(string(out), "\n", 2)[0], "Version: "))
	if err != nil {
		t.Fatalf("criu --version output %q: %v", out, err)
	}
	if !strings.Contains(string(out), "GitID") && cli != v {
		t.Errorf("RPC says %v, criu --version says %v", v, cli)
	}
	t.Logf("criu %v at %s", v, path)
}

func TestRealFeatures(t *testing.T) {
	path := criuPath(t)
	if os.Geteuid() != 0 {
		t.Skip("CRIU's feature check needs root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := New(path)
	f, err := c.Features(ctx)
	if err != nil {
		t.Fatalf("Features: %v", err)
	}
	t.Logf("features: %+v", f)

	// The RPC answer matches `criu check --feature`.
	for feat, cli := range map[Feature]string{
		FeatureMemTrack:   "mem_dirty_track",
		FeatureLazyPages:  "uffd-noncoop",
		FeaturePidfdStore: "pidfd_store",
	} {
		err := exec.CommandContext(ctx, path, "check", "--feature", cli).Run()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("criu check --feature %s: %v", cli, err)
		}
		if want := err == nil; f.Has(feat) != want {
			t.Errorf("%s: RPC says %v, `criu check --feature %s` says %v", feat, f.Has(feat), cli, want)
		}
	}

	if err := c.Check(ctx); err != nil {
		t.Errorf("Check: %v", err)
	}
	for _, feat := range []Feature{FeatureMemTrack, FeatureLazyPages, FeaturePidfdStore} {
		err := c.Check(ctx, feat)
		switch {
		case f.Has(feat) && err != nil:
			t.Errorf("Check(%s): %v", feat, err)
		case !f.Has(feat) && (!errors.Is(err, ErrFeatureMissing) || !strings.Contains(err.Error(), string(feat))):
			t.Errorf("Check(%s) = %v, want ErrFeatureMissing naming it", feat, err)
		}
	}
}

func TestVersionStringAsFingerprintProbe(t *testing.T) {
	path := criuPath(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := New(path)
	fp, err := fingerprint.Collect(ctx, fingerprint.Sources{CRIUVersion: c.VersionString})
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.Version(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if fp.CRIU != v.String() {
		t.Errorf("fingerprint CRIU = %q, want %q", fp.CRIU, v)
	}
	if _, err := New(filepath.Join(t.TempDir(), "criu")).VersionString(ctx); !errors.Is(err, ErrNotFound) {
		t.Errorf("VersionString on a missing binary: got %v", err)
	}
}

// skipOrFail is criutest.SkipOrFail.
func skipOrFail(t *testing.T, why string) { criutest.SkipOrFail(t, why) }
