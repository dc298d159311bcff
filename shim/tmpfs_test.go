package shim

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// tmpfsDir returns a new directory on a tmpfs (below /dev/shm), or skips.
func tmpfsDir(t *testing.T) string {
	t.Helper()
	if !isTmpfs("/dev/shm") {
		t.Skip("/dev/shm is not a tmpfs here")
	}
	d, err := os.MkdirTemp("/dev/shm", "berth-test-")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func TestOwnedTmpfs(t *testing.T) {
	shm := tmpfsDir(t)
	disk := t.TempDir()
	if isTmpfs(disk) {
		disk = "" // no disk directory to tell apart here
	}
	spec := &specs.Spec{Mounts: []specs.Mount{
		{Destination: "/dev/shm", Type: "bind", Source: shm, Options: []string{"rbind", "rw"}},
		{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm"},                   // hostIPC: the host's
		{Destination: "/run", Type: "tmpfs", Source: "tmpfs"},                         // the container's own: CRIU dumps it
		{Destination: "/data", Type: "bind", Source: shm, Options: []string{"rbind"}}, // not a pod tmpfs
	}}
	if disk != "" {
		spec.Mounts = append(spec.Mounts, specs.Mount{Destination: "/dev/shm", Type: "bind", Source: disk})
	}
	got := ownedTmpfs(spec)
	if len(got) != 1 || got[0].Source != shm {
		t.Fatalf("ownedTmpfs = %+v, want only the pod's /dev/shm", got)
	}
}

// TestTmpfsRoundTrip: what a container kept on its pod's /dev/shm is written beside the images
// and comes back into the destination pod's /dev/shm, nested directories, modes and symbolic
// links (never followed) included.
func TestTmpfsRoundTrip(t *testing.T) {
	from, to := tmpfsDir(t), tmpfsDir(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(from, "note"), []byte("kept"), 0o640))
	must(os.MkdirAll(filepath.Join(from, "d", "e"), 0o750))
	must(os.WriteFile(filepath.Join(from, "d", "e", "f"), []byte("nested"), 0o600))
	must(os.Symlink("/etc/passwd", filepath.Join(from, "link")))
	must(os.WriteFile(filepath.Join(to, "sidecar-file"), []byte("mine"), 0o600))

	images := t.TempDir()
	src := &specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/shm", Type: "bind", Source: from}}}
	must(writeTmpfs(context.Background(), src, images))
	if _, err := os.Stat(filepath.Join(images, tmpfsIndexFile)); err != nil {
		t.Fatal(err)
	}

	plan := &restorePlan{dir: images}
	must(plan.hold(""))
	defer plan.cleanup()
	must(plan.statNow())
	s := NewService(nil, DefaultConfig(), Deps{})
	dst := &specs.Spec{Mounts: []specs.Mount{{Destination: "/dev/shm", Type: "bind", Source: to, Options: []string{"rbind"}}}}
	must(s.restoreTmpfs(context.Background(), plan, dst))
	for name, want := range map[string]string{"note": "kept", "d/e/f": "nested", "sidecar-file": "mine"} {
		b, err := os.ReadFile(filepath.Join(to, name))
		if err != nil || string(b) != want {
			t.Errorf("%s = %q %v, want %q", name, b, err, want)
		}
	}
	if fi, err := os.Stat(filepath.Join(to, "note")); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("note mode %v %v, want 0640", fi.Mode(), err)
	}
	if l, err := os.Readlink(filepath.Join(to, "link")); err != nil || l != "/etc/passwd" {
		t.Errorf("link = %q %v", l, err)
	}

	// a destination without a pod tmpfs there: skipped, nothing written elsewhere
	must(s.restoreTmpfs(context.Background(), plan, &specs.Spec{}))
}

func TestJoinedUTSNames(t *testing.T) {
	if joinedUTS(&specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.UTSNamespace}}}}) != "" {
		t.Error("a UTS namespace of its own is not joined")
	}
	const p = "/proc/1/ns/uts"
	if got := joinedUTS(&specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.UTSNamespace, Path: p}}}}); got != p {
		t.Errorf("joinedUTS = %q", got)
	}
	n, err := readUTS("/proc/self/ns/uts")
	if err != nil {
		t.Skip(err) // setns needs CAP_SYS_ADMIN
	}
	h, _ := os.Hostname()
	if n.hostname != h {
		t.Errorf("hostname %q, want %q", n.hostname, h)
	}
	if was, err := n.restore(); err != nil || was != h {
		t.Errorf("restore of unchanged names: %q %v", was, err)
	}
}
