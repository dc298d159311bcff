package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckCRITop: beside checkpoint/, a CRI checkpoint may hold only containerd's files (and,
// in a receiver's directory, its stamp of checkpoint/); anything else is refused by name.
func TestCheckCRITop(t *testing.T) {
	tests := []struct {
		name      string
		files     []string // relative paths of regular files
		dirs      []string
		link      string
		withStamp bool
		bad       string // the entry the error names; "" for none
		sentinel  error
	}{
		{name: "containerd's files", files: []string{"config.dump", "spec.dump", "rootfs-diff.tar", "status", "status.dump", "container.log", "dump.log", "stats-dump", "checkpoint/pages-1.img"}},
		{name: "berth-rootfs-diff.tar at the top", files: []string{"config.dump", ImagesRootfsDiffFile}, bad: ImagesRootfsDiffFile, sentinel: ErrExtraFile},
		{name: "another name", files: []string{"run.sh"}, bad: "run.sh", sentinel: ErrExtraFile},
		{name: "a manifest at the top", files: []string{ManifestFile}, bad: ManifestFile, sentinel: ErrExtraFile},
		{name: "a subdirectory", dirs: []string{"volumes"}, bad: "volumes", sentinel: ErrExtraFile},
		{name: "a directory named as a file", dirs: []string{"spec.dump"}, bad: "spec.dump", sentinel: ErrExtraFile},
		{name: "a link", link: "rootfs-diff.tar", bad: "rootfs-diff.tar", sentinel: ErrUnsupportedFile},
		{name: "a receiver's stamp", files: []string{StampDir + "/checkpoint.json"}, withStamp: true},
		{name: "a stamp in an archive", files: []string{StampDir + "/checkpoint.json"}, bad: StampDir, sentinel: ErrExtraFile},
		{name: "another stamp", files: []string{StampDir + "/other.json"}, withStamp: true, bad: "other.json", sentinel: ErrExtraFile},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, d := range append(tc.dirs, ImagesDir) {
				if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
					t.Fatal(err)
				}
			}
			for _, f := range tc.files {
				p := filepath.Join(dir, f)
				if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if tc.link != "" {
				if err := os.Symlink("/etc/passwd", filepath.Join(dir, tc.link)); err != nil {
					t.Fatal(err)
				}
			}
			err := CheckCRITop(dir, tc.withStamp)
			if tc.sentinel == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tc.sentinel) || !containsWord(err.Error(), tc.bad) {
				t.Errorf("CheckCRITop: %v, want %v naming %s", err, tc.sentinel, tc.bad)
			}
		})
	}
}

// TestSignCRICheckpointRefusesPlanted: `berthctl checkpoint push` never vouches for a file
// planted beside a CRI checkpoint's images.
func TestSignCRICheckpointRefusesPlanted(t *testing.T) {
	dir := t.TempDir()
	images := filepath.Join(dir, ImagesDir)
	if err := os.MkdirAll(images, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(images, "core-1.img"), []byte("core"), 0o600); err != nil {
		t.Fatal(err)
	}
	files, size, err := DigestDir(images)
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteManifest(images, &Manifest{Files: files, ImageSize: size}); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{ConfigFile: `{"id":"c"}`, ImagesRootfsDiffFile: "planted"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := SignCRICheckpoint(dir); !errors.Is(err, ErrExtraFile) {
		t.Fatalf("SignCRICheckpoint: %v, want ErrExtraFile", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, ManifestFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a top-level %s was written: %v", ManifestFile, err)
	}
}

func containsWord(s, w string) bool { return w != "" && strings.Contains(s, w) }
