package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// duFree returns a Receiver.FreeBytes for a file system of free bytes that only root's
// contents use: free less the bytes of every file under root.
func duFree(root string, free int64) func(string) (uint64, error) {
	return func(string) (uint64, error) {
		var used int64
		_ = filepath.WalkDir(root, func(_ string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				if fi, err := d.Info(); err == nil {
					used += fi.Size()
				}
			}
			return nil
		})
		return uint64(max(free-used, 0)), nil
	}
}

// TestPageStreamFreeSpace: a copy-mode page stream counts against the root's free space as it
// arrives. One longer than the free space above the margin is ended with ErrNoSpace before the
// margin is reached (the relay, that is the move, fails), and its pages are removed; one that
// fits is received; a stated length that does not fit is refused before the page server starts.
func TestPageStreamFreeSpace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the relay accepts only root's CRIU")
	}
	const margin = 1 << 20
	root := filepath.Join(t.TempDir(), "root")
	free := int64(margin + spaceCheckBytes + spaceCheckBytes/2) // 1.5 checks' worth above the margin
	addr, out := startReceiver(t, &Receiver{Root: root, NoSync: true, CRIU: fakeCRIU(t), ReserveBytes: margin, FreeBytes: duFree(root, free)})

	t.Run("too long", func(t *testing.T) {
		relay, err := StartPageRelay(context.Background(), dial(t, addr), "big")
		if err != nil {
			t.Fatal(err)
		}
		go func() { // CRIU's page client; the relay drops it when the receiver ends the stream
			if c, err := net.Dial("tcp", relay.Addr()); err == nil {
				_, _ = c.Write(make([]byte, 3*spaceCheckBytes))
				c.Close()
			}
		}()
		if _, err := relay.Wait(context.Background()); err == nil {
			t.Error("relay.Wait: nil, want the stream's failure")
		}
		o := wait(t, out)
		if !errors.Is(o.err, ErrNoSpace) {
			t.Fatalf("receiver: %v, want ErrNoSpace", o.err)
		}
		t.Logf("refused: %v", o.err)
		assertRootClean(t, root)
	})

	t.Run("fits", func(t *testing.T) {
		relay, err := StartPageRelay(context.Background(), dial(t, addr), "small")
		if err != nil {
			t.Fatal(err)
		}
		if got := sendPages(t, relay, bytes.Repeat([]byte("page"), spaceCheckBytes/8)); got != "ok" {
			t.Fatalf("page server's answer %q (receiver: %v)", got, wait(t, out).err)
		}
		if _, err := relay.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		// nobody adopts it: the receiver removes it after IdleTimeout, or when it stops
	})

	t.Run("stated too long", func(t *testing.T) {
		conn := dial(t, addr)
		if _, err := Handshake(conn); err != nil {
			t.Fatal(err)
		}
		line, _ := json.Marshal(header{Magic: Magic, Name: "stated", Pages: true, PageBytes: free})
		if _, err := conn.Write(append(line, '\n')); err != nil {
			t.Fatal(err)
		}
		o := wait(t, out)
		if !errors.Is(o.err, ErrNoSpace) || !strings.Contains(o.err.Error(), "announced") {
			t.Fatalf("receiver: %v, want ErrNoSpace for the stated length", o.err)
		}
		if _, err := os.Stat(PagesStagingDir(root, "stated", "")); err == nil {
			t.Error("a staging directory for a stream refused before it started")
		}
	})
}

// TestPageStreamsReserve: a page stream that passed its check reserves the next spaceCheckBytes,
// so a second stream at once counts them and cannot take the same room.
func TestPageStreamsReserve(t *testing.T) {
	const margin = 1 << 20
	root := t.TempDir()
	r := &Receiver{Root: root, ReserveBytes: margin, FreeBytes: func(string) (uint64, error) { return margin + spaceCheckBytes + 1<<20, nil }}
	a, err := r.claimPages("a", 0, root)
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.claimPages("b", 0, root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.writer(io.Discard).Write(make([]byte, 4096)); err != nil {
		t.Fatalf("first stream: %v", err)
	}
	if _, err := b.writer(io.Discard).Write(make([]byte, 4096)); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("second stream beside the first's reservation: %v, want ErrNoSpace", err)
	}
	r.release(pagesFlightKey("a"))
	if _, err := b.writer(io.Discard).Write(make([]byte, 4096)); err != nil {
		t.Fatalf("second stream once the first ended: %v", err)
	}
	// a checkpoint's transfer counts what a stream reserved
	if _, err := r.claim("c", 2<<20, root); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("a checkpoint beside a stream's reservation: %v, want ErrNoSpace", err)
	}
}
