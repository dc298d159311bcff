package commands

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMigrateWorkDir: migrate refuses a work directory another local user could have prepared
// (the default lies in the world-writable $TMPDIR): a symbolic link, a file, a directory others
// may write or one another user owns, naming the path and what is wrong, before it connects to
// anything; a directory of its own passes the check (and the run fails later, on the missing
// containerd socket).
func TestMigrateWorkDir(t *testing.T) {
	tr := newTrust(t)
	tr.g.Namespace = DefaultNamespace
	base := t.TempDir()
	mk := func(name string, mode os.FileMode) string {
		p := filepath.Join(base, name)
		if err := os.Mkdir(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		return p
	}
	victim := mk("victim", 0o700)
	link := filepath.Join(base, "link")
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	type tc struct {
		name, dir, want string
	}
	cases := []tc{
		{"symbolic link", link, "is a symbolic link"},
		{"file", file, "not a directory"},
		{"others write", mk("open", 0o777), "group or others may write it"},
		{"group writes", mk("group", 0o770), "group or others may write it"},
	}
	if os.Geteuid() == 0 {
		other := mk("other", 0o700)
		if err := os.Chown(other, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		cases = append(cases, tc{"another user's", other, "owned by uid 65534"})
	} else {
		t.Log("not root: the case of a directory another user owns needs chown")
	}
	missing := filepath.Join(base, "containerd.sock")
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cmd := Migrate(tr.g)
			cmd.SetOut(io.Discard)
			cmd.SetErr(io.Discard)
			cmd.SetArgs([]string{"--from", missing, "--to", missing, "--work-dir", c.dir, "ctr1"})
			err := cmd.ExecuteContext(context.Background())
			if !errors.Is(err, errUnsafeWorkDir) || !strings.Contains(err.Error(), c.dir) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("migrate --work-dir %s: %v, want an unsafe work directory naming it and %q", c.dir, err, c.want)
			}
		})
	}
	for _, dir := range []string{mk("own", 0o700), filepath.Join(base, "fresh")} {
		cmd := Migrate(tr.g)
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		cmd.SetArgs([]string{"--from", missing, "--to", missing, "--work-dir", dir, "ctr1"})
		if err := cmd.ExecuteContext(context.Background()); errors.Is(err, errUnsafeWorkDir) || !strings.Contains(err.Error(), "containerd socket") {
			t.Errorf("migrate --work-dir %s (safe): %v, want it to get as far as the containerd socket", dir, err)
		}
	}
}
