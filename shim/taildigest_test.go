package shim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestTailDigester(t *testing.T) {
	dir := t.TempDir()
	td := startTailDigester(context.Background(), dir)
	// a file written in chunks while the digester follows it
	f, err := os.Create(filepath.Join(dir, "pages-1.img"))
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	for i := 0; i < 20; i++ {
		chunk := make([]byte, 64<<10)
		for j := range chunk {
			chunk[j] = byte(i*7 + j)
		}
		f.Write(chunk)
		h.Write(chunk)
		time.Sleep(3 * time.Millisecond)
	}
	f.Close()
	// a file that is truncated after being followed: must be left out
	tr := filepath.Join(dir, "core-1.img")
	os.WriteFile(tr, []byte("0123456789"), 0o600)
	time.Sleep(3 * tailPoll)
	os.WriteFile(tr, []byte("01"), 0o600)
	got := td.finish()
	want := "sha256:" + hex.EncodeToString(h.Sum(nil))
	if got["pages-1.img"].Digest != want || got["pages-1.img"].Size != 20*(64<<10) {
		t.Errorf("pages-1.img: %+v, want %s", got["pages-1.img"], want)
	}
	if _, ok := got["core-1.img"]; ok {
		t.Errorf("a truncated file was trusted: %+v", got["core-1.img"])
	}
}
