package shim

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	berthArchive "github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

var nodeFP = fingerprint.Fingerprint{Version: 1, Kernel: "6.18.0", Arch: "amd64", CRIU: "4.2.1", Runc: "1.5.3", Containerd: "2.4.2",
	CPU: fingerprint.CPU{Vendor: "AuthenticAMD", Flags: []string{"avx2", "sse4_2"}}}

func TestPrepareRestore(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	good := writeCheckpoint(t, root, "good", nodeFP)
	other := nodeFP
	other.Kernel = "5.10.0"
	writeCheckpoint(t, root, "otherkernel", other)
	tampered := writeCheckpoint(t, root, "tampered", nodeFP)
	if err := os.WriteFile(filepath.Join(tampered, "checkpoint/core-1.img"), []byte("CORE"), 0o600); err != nil {
		t.Fatal(err)
	}
	writeCheckpoint(t, outside, "elsewhere", nodeFP)
	if err := os.Symlink(filepath.Join(outside, "elsewhere"), filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	s := NewService(nil, Config{CheckpointRoot: root, MaxArchiveBytes: 1 << 30, MaxRootfsDiffBytes: 1 << 20}, testDeps(policy(t, false)))
	tests := []struct {
		name, ref, checkpoint string
		wantImages            string
		wantErr               []string
		class                 error
	}{
		{name: "fresh start", wantImages: ""},
		{name: "relative ref", ref: "good", wantImages: filepath.Join(good, checkpoint.ImagesDir)},
		{name: "absolute ref inside root", ref: good, wantImages: filepath.Join(good, checkpoint.ImagesDir)},
		{name: "dot-dot", ref: "good/../good", wantErr: []string{`"good/../good"`}, class: errdefs.ErrInvalidArgument},
		{name: "outside root", ref: filepath.Join(outside, "elsewhere"), wantErr: []string{"elsewhere"}, class: errdefs.ErrInvalidArgument},
		{name: "symlink escape", ref: "link", wantErr: []string{`"link"`}, class: errdefs.ErrInvalidArgument},
		{name: "missing", ref: "nope", wantErr: []string{"nope"}, class: errdefs.ErrNotFound},
		{name: "tampered", ref: "tampered", wantErr: []string{"core-1.img", "digest mismatch"}, class: errdefs.ErrFailedPrecondition},
		{name: "fingerprint", ref: "otherkernel", wantErr: []string{"kernel", "5.10.0", "6.18.0"}, class: errdefs.ErrFailedPrecondition},
		// a container berthctl restored keeps its annotation; containerd's checkpoint of it wins
		{name: "annotation and containerd checkpoint", ref: "nope", checkpoint: good, wantImages: filepath.Join(good, checkpoint.ImagesDir)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			spec := podSpec("", tc.ref)
			plan, err := s.prepareRestore(context.Background(), &taskAPI.CreateTaskRequest{ID: "t", Checkpoint: tc.checkpoint}, spec)
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatalf("no error, want one naming %v", tc.wantErr)
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not name %q", err, w)
					}
				}
				if errorClass(err) != tc.class {
					t.Errorf("error %q is not of class %v", err, tc.class)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := ""
			if plan != nil {
				got = plan.imagesDir()
				defer plan.cleanup()
			}
			if got != tc.wantImages {
				t.Errorf("images dir %q, want %q", got, tc.wantImages)
			}
		})
	}
}

func TestPrepareRestoreArchive(t *testing.T) {
	root := t.TempDir()
	dir := writeCheckpoint(t, t.TempDir(), "src", nodeFP)
	f, err := os.Create(filepath.Join(root, "ck.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if err := berthArchive.Write(f, dir); err != nil {
		t.Fatal(err)
	}
	f.Close()
	s := NewService(nil, Config{CheckpointRoot: root, MaxArchiveBytes: 1 << 30, MaxRootfsDiffBytes: 1 << 20}, testDeps(policy(t, false)))
	plan, err := s.prepareRestore(context.Background(), &taskAPI.CreateTaskRequest{ID: "t"}, podSpec("", "ck.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(plan.imagesDir(), "pages-1.img")); err != nil {
		t.Fatalf("archive not extracted: %v", err)
	}
	plan.cleanup()
	if _, err := os.Stat(plan.extracted); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("extracted directory %s left after cleanup: %v", plan.extracted, err)
	}
}

func TestOwnsNetns(t *testing.T) {
	for _, tc := range []struct {
		ns   []specs.LinuxNamespace
		want bool
	}{
		{nil, false},
		{[]specs.LinuxNamespace{{Type: specs.PIDNamespace}}, false},
		{[]specs.LinuxNamespace{{Type: specs.NetworkNamespace}}, true},
		{[]specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/var/run/netns/x"}}, false},
	} {
		if got := ownsNetns(&specs.Spec{Linux: &specs.Linux{Namespaces: tc.ns}}); got != tc.want {
			t.Errorf("ownsNetns(%v) = %v, want %v", tc.ns, got, tc.want)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(body string) string {
		p := filepath.Join(dir, "shim.toml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if cfg, err := LoadConfig(filepath.Join(dir, "missing.toml")); err != nil || cfg.CheckpointRoot != DefaultConfig().CheckpointRoot {
		t.Errorf("missing file: %+v %v", cfg, err)
	}
	for _, tc := range []struct{ body, wantErr string }{
		{`checkpoint_root = "/srv/ck"`, ""},
		{`checkpoint_root = "relative"`, `checkpoint_root "relative"`},
		{`max_archive_bytes = -1`, "max_archive_bytes -1"},
		{`unknown_key = 1`, "unknown_key"},
		{`checkpoint_root = `, "parse shim config"},
		{"signing_key = \"/etc/berth/node.key\"\ntrusted_keys = [{path = \"/etc/berth/a.pub\", namespaces = [\"prod\"]}]\nallow_unsigned = true\n", ""},
		{"allow_unsigned = false\n[[trusted_keys]]\npath = \"/etc/berth/a.pub\"\n[[trusted_keys]]\npath = \"/etc/berth/b.pub\"\nnamespaces = [\"x\"]\n", ""},
		{`signing_key = "node.key"`, `signing_key "node.key": must be an absolute path`},
		{`trusted_keys = [{path = "a.pub"}]`, `trusted_keys[0].path "a.pub": must be an absolute path`},
		{`trusted_keys = [{path = "/a.pub", namespaces = [""]}]`, `trusted_keys[0].namespaces: an empty name`},
		{`trusted_keys = [{path = "/a.pub", namespace = ["x"]}]`, "unknown keys"},
		{`max_rootfs_diff_bytes = 0`, "max_rootfs_diff_bytes 0"},
	} {
		_, err := LoadConfig(write(tc.body))
		if (err == nil) != (tc.wantErr == "") || (err != nil && !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("%q: error %v, want one containing %q", tc.body, err, tc.wantErr)
		}
	}
}
