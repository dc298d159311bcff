package checkpoint

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestVerifyStamped(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "ck")
	if err := os.MkdirAll(filepath.Join(dir, ImagesDir), 0o700); err != nil {
		t.Fatal(err)
	}
	pages := filepath.Join(dir, ImagesDir, "pages-1.img")
	if err := os.WriteFile(pages, []byte(strings.Repeat("p", 8192)), 0o600); err != nil {
		t.Fatal(err)
	}
	m := &Manifest{}
	if err := WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	if used, err := VerifyStamped(dir, m); err != nil || used {
		t.Fatalf("without a stamp: used %v, %v", used, err)
	}
	if err := WriteStamp(dir, m); err != nil {
		t.Fatal(err)
	}
	if used, err := VerifyStamped(dir, m); err != nil || !used {
		t.Fatalf("with a fresh stamp: used %v, %v", used, err)
	}
	// a stamp of another boot (written before a crash or reboot) is not used: every file is read
	b, err := os.ReadFile(stampPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	if bootID() != "" && !strings.Contains(string(b), bootID()) {
		t.Fatalf("stamp %s does not record the boot ID %s", b, bootID())
	}
	other := strings.Replace(string(b), `"boot":"`+bootID()+`"`, `"boot":"an-earlier-boot"`, 1)
	if err := os.WriteFile(stampPath(dir), []byte(other), 0o600); err != nil {
		t.Fatal(err)
	}
	if used, err := VerifyStamped(dir, m); err != nil || used {
		t.Fatalf("with a stamp of another boot: used %v, %v; want a full verification", used, err)
	}
	if err := WriteStamp(dir, m); err != nil {
		t.Fatal(err)
	}
	// tamper with the same size: the change time moves, the stamp no longer applies, the digest catches it
	time.Sleep(10 * time.Millisecond)
	if err := os.WriteFile(pages, []byte(strings.Repeat("q", 8192)), 0o600); err != nil {
		t.Fatal(err)
	}
	used, err := VerifyStamped(dir, m)
	if used || err == nil || !strings.Contains(err.Error(), "digest mismatch") {
		t.Fatalf("after tampering: used %v, error %v; want a digest mismatch found by reading", used, err)
	}
}
