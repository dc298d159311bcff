package transfer

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestPlainReceiverOnlyRoot: a receiver listening without TLS (Listen on loopback) greets and
// receives from root's sockets, over IPv4 and IPv6, and refuses a connection of another local
// user before the greeting, telling it why, so that no unprivileged process of the host can send
// it checkpoints, page streams or preflight queries.
func TestPlainReceiverOnlyRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("CI is set but the test does not run as root (it connects as root and as nobody)")
		}
		t.Skip("needs root: it connects as root and as nobody")
	}
	src := t.TempDir()
	makeCheckpoint(t, src, 64<<10)

	for _, host := range []string{"127.0.0.1", "::1"} {
		t.Run(host, func(t *testing.T) {
			ln, err := Listen(net.JoinHostPort(host, "0"), nil)
			if err != nil {
				if host == "::1" {
					t.Skipf("no IPv6 loopback here: %v", err)
				}
				t.Fatal(err)
			}
			root := t.TempDir()
			r := &Receiver{Root: root}
			out := make(chan done, 4)
			r.OnDone = func(peer net.Addr, path string, err error) { out <- done{peer, path, err} }
			ctx, cancel := context.WithCancel(context.Background())
			stopped := make(chan error, 1)
			go func() { stopped <- r.Serve(ctx, ln) }()
			t.Cleanup(func() { cancel(); <-stopped })
			addr := ln.Addr().(*net.TCPAddr)

			// root (this test) sends a checkpoint
			conn, err := net.Dial("tcp", addr.String())
			if err != nil {
				t.Fatal(err)
			}
			_, err = Send(context.Background(), conn, src, "from-root", nil)
			conn.Close()
			if err != nil {
				t.Fatalf("root's send: %v", err)
			}
			if d := next(t, out); d.err != nil {
				t.Fatalf("receiver, root's send: %v", d.err)
			}
			if _, err := os.Stat(filepath.Join(root, "from-root")); err != nil {
				t.Fatal(err)
			}

			// nobody connects (bash's /dev/tcp, as uid 65534) and prints what it is told
			bashHost := addr.IP.String()
			cmd := exec.Command("bash", "-c", `exec 3<>"/dev/tcp/$0/$1" && timeout 5 cat <&3`, bashHost, strconv.Itoa(addr.Port))
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			said, err := cmd.CombinedOutput()
			if err != nil {
				t.Logf("nobody's connection: %v", err)
			}
			if strings.HasPrefix(string(said), Greeting) || !strings.Contains(string(said), "accepts only root's connections") {
				t.Errorf("nobody was told %q; want a refusal before any greeting", said)
			}
			if d := next(t, out); !errors.Is(d.err, ErrPeerNotAllowed) {
				t.Errorf("receiver, nobody's connection: %v, want ErrPeerNotAllowed", d.err)
			}
		})
	}
}
