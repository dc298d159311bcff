package commands

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func TestGCPlan(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(min int) time.Time { return now.Add(-time.Duration(min) * time.Minute) }
	// oldest first, as listStored returns them
	list := func() []stored {
		return []stored{
			{Path: "a1", Container: "ns/a/c", Bytes: 100, Modified: at(60)},
			{Path: "b1", Container: "ns/b/c", Bytes: 100, Modified: at(50)},
			{Path: "a2", Container: "ns/a/c", Bytes: 100, Modified: at(40)},
			{Path: "a3", Container: "ns/a/c", Bytes: 100, Modified: at(30)},
			{Path: "b2", Container: "ns/b/c", Bytes: 100, Modified: at(2)},
		}
	}
	for _, tc := range []struct {
		name string
		p    gcPolicy
		want []string
	}{
		{"keep 1", gcPolicy{Keep: 1}, []string{"a1", "b1", "a2"}},
		{"keep 2", gcPolicy{Keep: 2}, []string{"a1"}},
		{"keep 1, young protected", gcPolicy{Keep: 1, MinAge: 45 * time.Minute}, []string{"a1", "b1"}},
		{"max bytes", gcPolicy{MaxBytes: 250}, []string{"a1", "b1", "a2"}},
		{"max bytes spares the newest of each", gcPolicy{MaxBytes: 1}, []string{"a1", "b1", "a2"}},
		{"max bytes after keep", gcPolicy{Keep: 2, MaxBytes: 350}, []string{"a1", "b1"}},
		{"max bytes, young protected", gcPolicy{MaxBytes: 1, MinAge: 55 * time.Minute}, []string{"a1"}},
		{"nothing to do", gcPolicy{Keep: 5, MaxBytes: 1000}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := list()
			var got []string
			for _, i := range tc.p.plan(l, now) {
				got = append(got, l[i].Path)
				if l[i].Removed == "" {
					t.Errorf("%s removed without a reason", l[i].Path)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("removes %v, want %v", got, tc.want)
			}
		})
	}
}

// TestCheckpointGC: ls lists a kubelet directory's archives and a checkpoint root's directories,
// gc removes what the policy says and nothing that is not a checkpoint, rm removes by name.
func TestCheckpointGC(t *testing.T) {
	kubelet, root := t.TempDir(), t.TempDir()
	old := time.Now().Add(-time.Hour)
	var archives []string
	for i := range 3 {
		p := kubeletArchive(t, nil, nil)
		dst := filepath.Join(kubelet, filepath.Base(p)[:len(filepath.Base(p))-4]+string(rune('a'+i))+".tar")
		if err := os.Rename(p, dst); err != nil {
			t.Fatal(err)
		}
		mt := old.Add(time.Duration(i) * time.Minute)
		os.Chtimes(dst, mt, mt)
		archives = append(archives, dst)
	}
	dir := checkpointDir(t, checkpointFingerprint())
	if err := os.Rename(dir, filepath.Join(root, "ckpt")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(kubelet, "notes.txt"), []byte("x"), 0o600)
	os.Mkdir(filepath.Join(root, "empty"), 0o700)
	g := &Globals{Config: filepath.Join(t.TempDir(), "none.toml")}
	run := func(args ...string) string {
		t.Helper()
		cmd := CheckpointLs(g)
		switch args[0] {
		case "gc":
			cmd = CheckpointGC(g)
		case "rm":
			cmd = CheckpointRm(g)
		}
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetArgs(append(args[1:], "--kubelet-dir", kubelet, "--root", root))
		if err := cmd.ExecuteContext(context.Background()); err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		return out.String()
	}
	var l []stored
	if err := json.Unmarshal([]byte(run("ls", "-o", "json")), &l); err != nil {
		t.Fatal(err)
	}
	if len(l) != 4 || l[0].Path != archives[0] || l[0].Container != "team-a//" || l[3].Where != "berth" {
		t.Fatalf("ls: %+v", l)
	}
	var gone []stored
	if err := json.Unmarshal([]byte(run("gc", "--keep", "1", "-o", "json")), &gone); err != nil {
		t.Fatal(err)
	}
	if len(gone) != 2 || gone[0].Path != archives[0] || gone[1].Path != archives[1] {
		t.Errorf("gc --keep 1 removed %+v", gone)
	}
	for i, a := range archives {
		if _, err := os.Stat(a); (err == nil) != (i == 2) {
			t.Errorf("%s after gc: %v", a, err)
		}
	}
	// the shim's kept CRIU log of a failed restore of ckpt goes with it; another checkpoint's
	// (ckpt2) and a file that only starts like one stay
	for _, f := range []string{"ckpt.restore-c1.log", "ckpt2.restore-c1.log", "ckpt.restore-notes.txt"} {
		os.WriteFile(filepath.Join(root, f), []byte("log"), 0o600)
	}
	run("rm", filepath.Base(archives[2]), filepath.Join(root, "ckpt"))
	if _, err := os.Stat(filepath.Join(root, "ckpt.restore-c1.log")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ckpt's restore log after rm: %v", err)
	}
	for _, f := range []string{"ckpt2.restore-c1.log", "ckpt.restore-notes.txt"} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Errorf("%s (not ckpt's restore log) removed: %v", f, err)
		}
	}
	if err := json.Unmarshal([]byte(run("ls", "-o", "json")), &l); err != nil || len(l) != 0 {
		t.Errorf("ls after rm: %+v %v", l, err)
	}
	for _, p := range []string{filepath.Join(kubelet, "notes.txt"), filepath.Join(root, "empty")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s (not a checkpoint) removed: %v", p, err)
		}
	}
	cmd := CheckpointRm(g)
	cmd.SetArgs([]string{"--kubelet-dir", kubelet, "--root", root, "notes.txt"})
	cmd.SetOut(&bytes.Buffer{})
	if err := cmd.ExecuteContext(context.Background()); err == nil {
		t.Error("rm of a file that is not a checkpoint succeeded")
	}
}
