package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/privilege"
)

// TestDirStat: two looks at a directory are the Same only when nothing in it was added,
// removed, replaced or written in between; renaming the directory itself changes nothing.
func TestDirStat(t *testing.T) {
	cases := []struct {
		name   string
		change func(t *testing.T, dir string)
		want   string // "" for unchanged
	}{
		{"untouched", func(*testing.T, string) {}, ""},
		{"renamed and back", func(t *testing.T, dir string) {
			if err := os.Rename(dir, dir+".x"); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(dir+".x", dir); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"written in place", func(t *testing.T, dir string) {
			f, err := os.OpenFile(filepath.Join(dir, "checkpoint/core-1.img"), os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.WriteAt([]byte("C"), 0)
			f.Close()
		}, "checkpoint/core-1.img: written"},
		{"replaced", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "checkpoint/core-1.img")
			os.WriteFile(p+".new", []byte("core"), 0o600)
			if err := os.Rename(p+".new", p); err != nil {
				t.Fatal(err)
			}
		}, "checkpoint/core-1.img: replaced"},
		{"grown", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "spec.dump"), []byte(`{"ociVersion":"1.2.0"} `), 0o600)
		}, "spec.dump: size"},
		{"added", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "checkpoint/zz.img"), nil, 0o600)
		}, "checkpoint/zz.img: added"},
		{"removed", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, "spec.dump")) }, "spec.dump: removed"},
		{"chmod", func(t *testing.T, dir string) { os.Chmod(filepath.Join(dir, "spec.dump"), 0o644) }, "spec.dump: written or its mode changed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ck")
			writeTree(t, dir, map[string][]byte{"checkpoint/core-1.img": []byte("core"), "spec.dump": []byte(`{"ociVersion":"1.2.0"}`)})
			before, err := StatDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * time.Millisecond)
			tc.change(t, dir)
			after, err := StatDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			err = before.Same(after)
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrChanged) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrChanged naming %q", err, tc.want)
			}
		})
	}
}

// TestSignCRICheckpointKeepsTheSource: the top-level manifest of a CRI archive keeps what the
// shim recorded of the source (Kubernetes identity, security context).
func TestSignCRICheckpointKeepsTheSource(t *testing.T) {
	dir := t.TempDir()
	writeTree(t, dir, map[string][]byte{"checkpoint/pages-1.img": []byte("p"), ConfigFile: []byte(`{"id":"abc","rootfsImageName":"img:1"}`)})
	sec := privilege.Container{User: privilege.User{UID: 1000}, NoNewPrivileges: true}
	inner := &Manifest{Container: ContainerInfo{ID: "abc", KubernetesNamespace: "team-a", Pod: "web-0", ContainerName: "server"}, Security: &sec}
	if err := WriteManifest(filepath.Join(dir, ImagesDir), inner); err != nil {
		t.Fatal(err)
	}
	m, err := SignCRICheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	c := m.Container
	if c.KubernetesNamespace != "team-a" || c.Pod != "web-0" || c.ContainerName != "server" || c.Image != "img:1" ||
		m.Security == nil || m.Security.User.UID != 1000 || !m.Security.NoNewPrivileges {
		t.Errorf("top-level manifest %+v security %+v", c, m.Security)
	}
}
