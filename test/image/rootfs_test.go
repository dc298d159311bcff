package image

import (
	"debug/elf"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestNewRootfs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "rootfs")
	r, err := NewRootfs(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range baseDirs {
		fi, err := os.Stat(filepath.Join(dir, d.path))
		if err != nil || !fi.IsDir() || fi.Mode()&(os.ModePerm|os.ModeSticky) != d.mode {
			t.Errorf("%s: %v %v, want directory %v", d.path, fi.Mode(), err, d.mode)
		}
	}
	for _, f := range []string{"etc/passwd", "etc/group", "etc/hosts", "etc/nsswitch.conf"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "etc/passwd"))
	if !strings.HasPrefix(string(b), "root:x:0:0:") {
		t.Errorf("passwd %q", b)
	}
	// Idempotent.
	if _, err := NewRootfs(r.Dir); err != nil {
		t.Fatal(err)
	}
}

func TestRootfsPaths(t *testing.T) {
	dir := t.TempDir()
	r := &Rootfs{Dir: dir}
	for _, d := range []string{"usr/lib", "real"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{
		"lib":      "/usr/lib", // absolute: resolved within dir, never the host's /usr/lib
		"rel":      "real",
		"up":       "../../../..",
		"loop":     "loop",
		"usr/lib2": "../usr/lib",
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		in, want string
		ok       bool
	}{
		{"/lib/x.so", "usr/lib/x.so", true},
		{"lib/x.so", "usr/lib/x.so", true},
		{"/rel/a/b", "real/a/b", true},
		{"/up/etc/passwd", "etc/passwd", true},
		{"/../../etc/passwd", "etc/passwd", true},
		{"/usr/lib2/y", "usr/lib/y", true},
		{"/missing/lib/z", "missing/lib/z", true},
		{"/lib", "usr/lib", true},
		{"/loop/x", "", false},
	}
	for _, tt := range tests {
		got, err := r.Path(tt.in)
		if (err == nil) != tt.ok || (tt.ok && got != filepath.Join(dir, tt.want)) {
			t.Errorf("Path(%q) = %q, %v; want %q ok=%v", tt.in, got, err, filepath.Join(dir, tt.want), tt.ok)
		}
	}

	// Writing through /lib lands in dir/usr/lib; the last component is replaced, not followed.
	if err := r.WriteFile("/lib/x.so", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "usr/lib/x.so")); err != nil || string(b) != "x" {
		t.Errorf("usr/lib/x.so: %q %v", b, err)
	}
	if err := r.AddSymlink("/rel", "somewhere"); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.Readlink(filepath.Join(dir, "rel")); got != "somewhere" {
		t.Errorf("rel -> %q", got)
	}
	if fi, err := os.Stat(filepath.Join(dir, "real")); err != nil || !fi.IsDir() {
		t.Errorf("replacing the symlink touched its target: %v", err)
	}
	if err := r.WriteFile("/usr", nil, 0o644); err == nil {
		t.Error("WriteFile over a directory did not fail")
	}
	if err := r.WriteFile("/", nil, 0o644); err == nil {
		t.Error("WriteFile of / did not fail")
	}
}

func TestAddFile(t *testing.T) {
	src := filepath.Join(t.TempDir(), "src")
	if err := os.WriteFile(src, []byte("data"), 0o750); err != nil {
		t.Fatal(err)
	}
	r, err := NewRootfs(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		dst  string
		mode os.FileMode
		want os.FileMode
	}{
		{"/opt/x/keep", 0, 0o750},
		{"/opt/x/set", os.ModeSetuid | 0o711, 0o711 | os.ModeSetuid},
		{"/opt/x/set", 0o644, 0o644}, // replaces
	}
	for _, tt := range tests {
		if err := r.AddFile(src, tt.dst, tt.mode); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(filepath.Join(r.Dir, tt.dst))
		if err != nil || fi.Mode() != tt.want {
			t.Errorf("AddFile(%s, %v): mode %v %v, want %v", tt.dst, tt.mode, fi.Mode(), err, tt.want)
		}
	}
	if err := r.AddFile(filepath.Join(t.TempDir(), "missing"), "/x", 0); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("AddFile of a missing file: %v", err)
	}
}

func TestAddBusybox(t *testing.T) {
	needFile(t, DefaultBusybox)
	r, err := NewRootfs(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.AddBusybox(""); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(filepath.Join(r.Dir, "bin/busybox")); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o755 {
		t.Fatalf("bin/busybox: %v", err)
	}
	for _, applet := range []string{"bin/sh", "bin/ls"} {
		if got, err := os.Readlink(filepath.Join(r.Dir, applet)); err != nil || got != "/bin/busybox" {
			t.Errorf("%s -> %q, %v", applet, got, err)
		}
	}
	if t.Failed() {
		return
	}
	needRoot(t)
	out, err := chrootCommand(r.Dir, "/bin/sh", "-c", "echo ok; env | grep -c PATH").CombinedOutput()
	if err != nil || string(out) != "ok\n1\n" {
		t.Errorf("sh in rootfs: %q, %v", out, err)
	}
}

// elfNeeded returns the DT_NEEDED and PT_INTERP of the host file p.
func elfNeeded(t *testing.T, p string) (needed []string, interp string) {
	t.Helper()
	o, err := readELF(p)
	if err != nil {
		t.Fatal(err)
	}
	return o.needed, o.interp
}

func TestAddDynamicBinary(t *testing.T) {
	needFile(t, RedisServer)
	r, err := NewRootfs(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	added, err := r.AddDynamicBinary(RedisServer, "/usr/bin/redis-server")
	if err != nil {
		t.Fatal(err)
	}
	_, interp := elfNeeded(t, RedisServer)
	triplet := multiarch[elfMachine(t, RedisServer)]
	for _, want := range []string{"/usr/bin/redis-server", interp, "/lib/" + triplet + "/libc.so.6"} {
		if !slices.Contains(added, want) {
			t.Errorf("added %q lacks %s", added, want)
		}
	}
	// Every name needed by every copied object is present in the rootfs, in a directory the
	// loader searches (or as the loader itself).
	for _, a := range added {
		needed, _ := elfNeeded(t, filepath.Join(r.Dir, a))
		for _, n := range needed {
			found := n == path.Base(interp)
			for _, d := range LibrarySearchDirs(elfMachine(t, RedisServer)) {
				if _, err := os.Stat(filepath.Join(r.Dir, d, n)); err == nil {
					found = true
				}
			}
			if !found {
				t.Errorf("%s needs %s, not in the rootfs", a, n)
			}
		}
	}
	needRoot(t)
	out, err := chrootCommand(r.Dir, "/usr/bin/redis-server", "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Redis server") {
		t.Errorf("redis-server --version in rootfs: %q, %v", out, err)
	}
}

func elfMachine(t *testing.T, p string) elf.Machine {
	t.Helper()
	o, err := readELF(p)
	if err != nil {
		t.Fatal(err)
	}
	return o.machine
}

func TestAddDynamicBinaryStatic(t *testing.T) {
	needFile(t, DefaultBusybox)
	if _, interp := elfNeeded(t, DefaultBusybox); interp != "" {
		t.Skipf("%s is dynamically linked", DefaultBusybox)
	}
	r := &Rootfs{Dir: t.TempDir()}
	added, err := r.AddDynamicBinary(DefaultBusybox, "sbin/bb")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(added, []string{"/sbin/bb"}) {
		t.Errorf("added %q", added)
	}
	if _, err := r.AddDynamicBinary("/etc/passwd", "/x"); err == nil || !strings.Contains(err.Error(), "/etc/passwd") {
		t.Errorf("AddDynamicBinary of a text file: %v", err)
	}
}
