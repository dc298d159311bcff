// Package criutest finds the real criu binary for the tests of package criu and its
// subpackages, and skips (or, with CI set, fails) a test that needs what the machine lacks.
package criutest

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// Path returns the real criu binary: BERTH_CRIU, else "criu" in PATH, else the stack `make deps`
// built (linked at <repo>/_output/stack); otherwise SkipOrFail.
func Path(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("BERTH_CRIU"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("BERTH_CRIU=%s: %v", p, err)
		}
		return p
	}
	p, err := exec.LookPath("criu")
	if err == nil {
		return p
	}
	if _, file, _, ok := runtime.Caller(0); ok { // <repo>/criu/internal/criutest/criutest.go
		stack := filepath.Join(filepath.Dir(file), "../../../_output/stack/bin/criu")
		if _, serr := os.Stat(stack); serr == nil {
			return stack
		}
	}
	SkipOrFail(t, "criu not found (set BERTH_CRIU, put criu in PATH, or run `make deps`)")
	return ""
}

// SkipOrFail skips the test for why, or fails it when CI is set (CI must run every test).
func SkipOrFail(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal("CI is set but " + why)
	}
	t.Skip(why)
}

// Tail returns the last n bytes of b, for a log in a failure message.
func Tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
