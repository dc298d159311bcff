package scenario

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPrepareDir: a demo's -dir DIR never loses what DIR held: a directory with the user's
// files is refused untouched; a new, an empty, and a previous run's directory are taken.
func TestPrepareDir(t *testing.T) {
	user := t.TempDir()
	keep := filepath.Join(user, "thesis.tex")
	if err := os.WriteFile(keep, []byte("years of work"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := PrepareDir(user, "berth-demo")
	if err == nil || !strings.Contains(err.Error(), "not empty and was not made by berth-demo") {
		t.Fatalf("a directory with the user's files: %v", err)
	}
	if b, err := os.ReadFile(keep); err != nil || string(b) != "years of work" {
		t.Fatalf("the user's file after a refused run: %q %v", b, err)
	}
	for _, dir := range []string{filepath.Join(t.TempDir(), "new"), t.TempDir()} {
		if err := PrepareDir(dir, "berth-demo"); err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		// a previous run's directory, with its leftovers, is emptied and taken again
		if err := os.WriteFile(filepath.Join(dir, "leftover"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := PrepareDir(dir, "berth-demo"); err != nil {
			t.Fatalf("a previous run's %s: %v", dir, err)
		}
		if _, err := os.Stat(filepath.Join(dir, "leftover")); !os.IsNotExist(err) {
			t.Errorf("a previous run's leftover stays: %v", err)
		}
	}
}
