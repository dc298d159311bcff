package shim

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A writer of page_stream_dir cannot make the shim read a file outside it through a symbolic
// link named <id>.json (its bytes would come back in the error), nor block on a FIFO there.
func TestClaimPageStreamNotAFile(t *testing.T) {
	secretDir := t.TempDir()
	secret := filepath.Join(secretDir, "secret")
	if err := os.WriteFile(secret, []byte("TOPSECRET-host-file"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, kind := range []string{"symlink", "fifo"} {
		t.Run(kind, func(t *testing.T) {
			dir := t.TempDir()
			armed := filepath.Join(dir, "c1.json")
			var err error
			if kind == "symlink" {
				err = os.Symlink(secret, armed)
			} else {
				err = unix.Mkfifo(armed, 0o600)
			}
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				_, err := claimPageStream(dir, "c1", pageArmNow, pageArmCall(pageArmNow), true)
				done <- err
			}()
			select {
			case err = <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("claim blocked on the armed file")
			}
			if err == nil || strings.Contains(err.Error(), "TOPSECRET") {
				t.Fatalf("claim: %v; want an error that does not show the file it links to", err)
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 0 {
				t.Fatalf("left in the directory: %v", ents)
			}
		})
	}
}

// The request's socket is a socket in the directory, not a symbolic link to one elsewhere (the
// shim runs as root in the host's mount namespace: containerd's socket, for one).
func TestArmPageStreamSocketSymlink(t *testing.T) {
	elsewhere := t.TempDir()
	ln, err := net.Listen("unix", filepath.Join(elsewhere, "other.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dir := t.TempDir()
	if err := os.Symlink(filepath.Join(elsewhere, "other.sock"), filepath.Join(dir, "p.sock")); err != nil {
		t.Fatal(err)
	}
	ctx := armTestRequest(t, dir, "p.sock", "")
	s := NewService(nil, Config{PageStreamDir: dir}, Deps{})
	a, err := s.armPageStream(ctx, "c1", t.TempDir())
	if a != nil {
		a.close()
	}
	if err == nil {
		t.Fatal("armed a page stream to a socket outside page_stream_dir through a symbolic link")
	}
}
