package shim

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/berth-dev/berth/oci/checkpoint"
)

func TestPageServerAddr(t *testing.T) {
	for _, tc := range []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"127.0.0.1:4000", "127.0.0.1", 4000, true},
		{"[::1]:4000", "::1", 4000, true},
		{"10.0.0.5:4000", "", 0, false}, // the page client speaks in the clear: loopback only
		{"localhost:4000", "", 0, false},
		{"127.0.0.1:0", "", 0, false},
		{"127.0.0.1", "", 0, false},
	} {
		h, p, err := pageServerAddr(tc.in)
		if tc.ok != (err == nil) || h != tc.host || p != tc.port {
			t.Errorf("pageServerAddr(%q) = %q, %d, %v", tc.in, h, p, err)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("pageServerAddr(%q): %v is not InvalidArgument", tc.in, err)
		}
	}
}

// TestLazyTLSDir: a lazy dump's TLS directory is used only when it is root's alone and holds the
// three files CRIU reads; anything else is refused, naming the directory and the cause.
func TestLazyTLSDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the directory must be root's: run as root (make test does)")
	}
	files := checkpoint.LazyTLS{CA: []byte("ca"), Cert: []byte("cert"), Key: []byte("key")}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, work string)
		want  string // "" = accepted
	}{
		{"written by WriteLazyTLS", func(t *testing.T, work string) {
			if err := checkpoint.WriteLazyTLS(work, files); err != nil {
				t.Fatal(err)
			}
		}, ""},
		{"missing", func(t *testing.T, work string) {}, "no such file"},
		{"a link to a directory", func(t *testing.T, work string) {
			real := filepath.Join(t.TempDir(), "real")
			if err := checkpoint.WriteLazyTLS(real, files); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(checkpoint.LazyTLSDir(real), checkpoint.LazyTLSDir(work)); err != nil {
				t.Fatal(err)
			}
		}, "not a directory"},
		{"others may enter", func(t *testing.T, work string) {
			if err := checkpoint.WriteLazyTLS(work, files); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(checkpoint.LazyTLSDir(work), 0o755); err != nil {
				t.Fatal(err)
			}
		}, "mode 0755"},
		{"not root's", func(t *testing.T, work string) {
			if err := checkpoint.WriteLazyTLS(work, files); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(checkpoint.LazyTLSDir(work), 65534, 65534); err != nil {
				t.Fatal(err)
			}
		}, "not root's"},
		{"the key missing", func(t *testing.T, work string) {
			if err := checkpoint.WriteLazyTLS(work, files); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(filepath.Join(checkpoint.LazyTLSDir(work), checkpoint.LazyTLSKey)); err != nil {
				t.Fatal(err)
			}
		}, checkpoint.LazyTLSKey},
		{"the CA a FIFO", func(t *testing.T, work string) {
			if err := checkpoint.WriteLazyTLS(work, files); err != nil {
				t.Fatal(err)
			}
			ca := filepath.Join(checkpoint.LazyTLSDir(work), checkpoint.LazyTLSCA)
			if err := os.Remove(ca); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Mkfifo(ca, 0o600); err != nil {
				t.Fatal(err)
			}
		}, "ca.pem is not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			work := filepath.Join(t.TempDir(), "ck")
			if err := os.Mkdir(work, 0o700); err != nil {
				t.Fatal(err)
			}
			tc.setup(t, work)
			dir, err := lazyTLSDir(work)
			if tc.want == "" {
				if err != nil || dir != checkpoint.LazyTLSDir(work) {
					t.Fatalf("lazyTLSDir = %q, %v; want %q", dir, err, checkpoint.LazyTLSDir(work))
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), checkpoint.LazyTLSDir(work)) {
				t.Fatalf("lazyTLSDir: %v; want an error naming %s and %q", err, checkpoint.LazyTLSDir(work), tc.want)
			}
			if !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Errorf("%v is not FailedPrecondition", err)
			}
		})
	}
	t.Run("a path CRIU's configuration cannot carry", func(t *testing.T) {
		work := filepath.Join(t.TempDir(), "my ck")
		if err := os.Mkdir(work, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := checkpoint.WriteLazyTLS(work, files); err != nil {
			t.Fatal(err)
		}
		if _, err := lazyTLSDir(work); err == nil || !strings.Contains(err.Error(), "cannot carry") {
			t.Fatalf("lazyTLSDir(%q): %v; want a refusal of the path", work, err)
		}
	})
}
