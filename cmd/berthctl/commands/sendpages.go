package commands

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer"
)

// sendPagesResult is `berthctl send-pages -o json`'s last line.
type sendPagesResult struct {
	Container string  `json:"container"`
	Name      string  `json:"name"`
	Address   string  `json:"address"`
	Bytes     int64   `json:"bytes"`
	Ms        float64 `json:"ms"`
}

// SendPagesArmed is the line `berthctl send-pages` writes to its standard output once the
// request is armed: the caller may ask for the checkpoint from then on.
const SendPagesArmed = "armed"

// SendPages is `berthctl send-pages`, which `kubectl berth move` runs in the source node's
// agent (pods/exec) before it calls the kubelet checkpoint API.
func SendPages() *cobra.Command {
	var (
		container, name, dir string
		expire               time.Duration
		cpTimeout            int64
		disarm               bool
		tf                   *tlsFlags
	)
	cmd := &cobra.Command{
		Use:   "send-pages --container ID (--name NAME --checkpoint-timeout SECONDS [--expire D] HOST:PORT | --disarm [--name NAME]) [--dir DIR]",
		Short: "Arm copy mode for one checkpoint call of a container: its memory pages go to a 'berthctl receive'",
		Long: `send-pages arms a copy-mode page stream for one checkpoint call of container ID (its containerd
id): the next one made with the timeout --checkpoint-timeout SECONDS (the kubelet checkpoint
API's ?timeout=SECONDS, or 'crictl --timeout=SECONDSs checkpoint'), whose deadline containerd
passes to the shim. It connects to the 'berthctl receive' at HOST:PORT (mutual TLS, as 'berthctl
send'), listens on a unix socket in --dir (the shim's page_stream_dir) and writes ID.json there,
then prints "armed". berth's shim, on that checkpoint call, takes the request, has CRIU send the memory pages through a relay of its
own that digests them (the digest goes into the checkpoint's berth.json, which the shim signs),
and forwards them to the socket; send-pages carries them to the receiver as NAME, which keeps
them until the checkpoint of the same name arrives (berthctl send) and its signed digest matches.
The checkpoint itself then holds no page images. Any other checkpoint of the container meanwhile
(another timeout or none: another operator's crictl, ctr or kubelet call) is taken as usual,
pages included, and leaves the stream armed. Pick the timeout at random, above the kubelet's
runtimeRequestTimeout (kubectl berth move picks one of a day or more); it is no secret, only
unlikely to be another party's.

It ends when the stream has ended (its last line: JSON with the bytes forwarded), or without a
stream after --expire; then it removes the request. A checkpoint after the expiry is taken as if
nothing were armed. 'send-pages --disarm --container ID [--name NAME]' (what move runs when it gives up)
removes the request unless a checkpoint took it, and ends the send-pages waiting on it (it
connects to its socket and closes at once: the receiver sees a cut stream and drops it).`,
		Args: func(cmd *cobra.Command, args []string) error {
			if disarm {
				return cobra.NoArgs(cmd, args)
			}
			return cobra.ExactArgs(1)(cmd, args)
		},
		RunE: func(cmd *cobra.Command, args []string) (retErr error) {
			var addr string
			if !disarm {
				addr = args[0]
			}
			if container == "" || container != filepath.Base(container) || strings.HasPrefix(container, ".") {
				return fmt.Errorf("--container %q: want a containerd container id", container)
			}
			if disarm {
				return disarmPages(cmd.OutOrStdout(), dir, container, name)
			}
			if err := transfer.ValidName(name); err != nil {
				return fmt.Errorf("--name: %w", err)
			}
			if cpTimeout <= 0 {
				return fmt.Errorf("--checkpoint-timeout %d: want the timeout, in seconds, of the checkpoint call that is to take the stream", cpTimeout)
			}
			ctx := cmd.Context()
			start := time.Now()
			conn, err := dialReceiver(ctx, addr, tf)
			if err != nil {
				return err
			}
			defer conn.Close()
			if err := transfer.AnnouncePages(conn, name, checkpoint.PageDigestDefault); err != nil {
				return err
			}
			framed, err := armPages(ctx, cmd.OutOrStdout(), dir, checkpoint.PageStreamRequest{
				Container: container, Name: name, CheckpointTimeout: cpTimeout, Expires: start.Add(expire), Digest: checkpoint.PageDigestDefault})
			if err != nil {
				return err
			}
			n, err := transfer.BridgePages(ctx, conn, framed)
			if err != nil {
				return err
			}
			return writeJSON(cmd.OutOrStdout(), sendPagesResult{Container: container, Name: name, Address: addr, Bytes: n, Ms: millis(time.Since(start))})
		},
	}
	cmd.Flags().StringVar(&container, "container", "", "containerd id of the container whose next checkpoint streams its pages")
	cmd.Flags().StringVar(&name, "name", "", "the checkpoint's name at the receiver (what 'berthctl send --name' names it)")
	cmd.Flags().StringVar(&dir, "dir", checkpoint.DefaultPageStreamDir, "the shim's page_stream_dir, as mounted here")
	cmd.Flags().DurationVar(&expire, "expire", 30*time.Second, "how long the request stays armed without a checkpoint")
	cmd.Flags().Int64Var(&cpTimeout, "checkpoint-timeout", 0, "the timeout, in seconds, of the checkpoint call that is to take the stream (the kubelet API's ?timeout=)")
	cmd.Flags().BoolVar(&disarm, "disarm", false, "disarm the stream armed for --container (with --name: only the one armed under that name), unless a checkpoint took it already, and end the send-pages that armed it (HOST:PORT not needed)")
	tf = addTLSFlags(cmd.Flags())
	tf.addServerName(cmd.Flags())
	// the armed line comes first on stdout; the result is JSON
	return cmd
}

// armPages makes dir (mode 0700, and closes an existing one of ours to other users), listens on a
// unix socket in it, writes r (Container, Name, CheckpointTimeout and Expires set; armPages sets
// Socket and Armed) as <r.Container>.json unless a request armed for that container is there and
// not expired, prints SendPagesArmed on out, and returns the shim's connection once it came (a
// peer of uid 0: the shim). The request and the socket are removed before it returns, whatever
// happens. Errors: a request armed already (another move of the same container), I/O errors, the
// expiry or ctx's end before the shim came.
func armPages(ctx context.Context, out io.Writer, dir string, r checkpoint.PageStreamRequest) (net.Conn, error) {
	container, expires := r.Container, r.Expires
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("arm page stream: %w", err)
	}
	// a directory made by someone else's defaults (the kubelet's DirectoryOrCreate makes 0755)
	// would list the armed containers to every local user: close it when it is ours
	if fi, err := os.Lstat(dir); err == nil && fi.IsDir() && fi.Mode().Perm()&0o077 != 0 {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) == os.Geteuid() {
			if err := os.Chmod(dir, 0o700); err != nil {
				return nil, fmt.Errorf("arm page stream: %w", err)
			}
		}
	}
	// a name of its own (random): a name from the id's first characters was shared by ids with a
	// common prefix, and the second arming took the first's socket
	var rnd [8]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, err
	}
	sockName := "pages-" + hex.EncodeToString(rnd[:]) + ".sock"
	sock := filepath.Join(dir, sockName)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("arm page stream: %w", err)
	}
	defer ln.Close() // removes the socket file (unlink on close)
	if err := os.Chmod(sock, 0o600); err != nil {
		return nil, fmt.Errorf("arm page stream: %w", err)
	}
	r.Socket, r.Armed, r.Expires = sockName, time.Now().UTC(), expires.UTC()
	b, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	req := filepath.Join(dir, container+checkpoint.PageStreamRequestSuffix)
	if err := removeExpired(req, r.Armed); err != nil {
		return nil, err
	}
	tmp := filepath.Join(dir, "."+sockName+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return nil, fmt.Errorf("arm page stream: %w", err)
	}
	// a link, never a rename over: a second move of the same container must not take the first
	// one's checkpoint call (nor have its own disarmed by the first's end)
	err = os.Link(tmp, req)
	_ = os.Remove(tmp)
	if errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("arm page stream: a page stream is armed for container %s already (another move of it?)", container)
	} else if err != nil {
		return nil, fmt.Errorf("arm page stream: %w", err)
	}
	defer func() { // disarm: a request the shim took is gone already, and another may be there
		if cur, err := os.ReadFile(req); err != nil || !bytes.Equal(cur, b) {
			return
		}
		if err := os.Remove(req); err != nil && !errors.Is(err, fs.ErrNotExist) {
			fmt.Fprintf(os.Stderr, "disarm %s: %v\n", req, err)
		}
	}()
	if _, err := fmt.Fprintln(out, SendPagesArmed); err != nil {
		return nil, err
	}
	_ = ln.SetDeadline(expires)
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("arm page stream for %s: %w", container, ctx.Err())
			}
			return nil, fmt.Errorf("arm page stream for %s: no checkpoint took it by %s: %w", container, expires.Format(time.RFC3339), err)
		}
		if peerUID(c) == 0 {
			return c, nil
		}
		c.Close()
	}
}

// removeExpired removes the request at path if it expired before now (its send-pages was killed
// before it could remove it). Errors: I/O errors other than a missing file.
func removeExpired(path string, now time.Time) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("arm page stream: %w", err)
	}
	var old checkpoint.PageStreamRequest
	if json.Unmarshal(b, &old) == nil && !old.Expires.IsZero() && !now.Before(old.Expires) {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("arm page stream: %w", err)
		}
	}
	return nil
}

// peerUID returns the uid of the process at the other end of c (SO_PEERCRED), -1 when unknown.
func peerUID(c *net.UnixConn) int {
	raw, err := c.SyscallConn()
	if err != nil {
		return -1
	}
	uid := -1
	_ = raw.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			uid = int(cred.Uid)
		}
	})
	return uid
}

// disarmPages removes the request armed for container in dir, unless a checkpoint took it
// already, and then connects to the socket it names and closes, so that the send-pages waiting
// there ends (its stream reaches the receiver cut, and the receiver drops it). It prints
// "disarmed" or "nothing armed". With name not empty it disarms only a request armed under that
// checkpoint name: another move's request for the same container is left alone.
func disarmPages(out io.Writer, dir, container, name string) error {
	if container == "" || container != filepath.Base(container) || strings.HasPrefix(container, ".") {
		return fmt.Errorf("--container %q: want a containerd container id", container)
	}
	req := filepath.Join(dir, container+checkpoint.PageStreamRequestSuffix)
	b, err := os.ReadFile(req)
	if errors.Is(err, fs.ErrNotExist) {
		_, err := fmt.Fprintln(out, "nothing armed")
		return err
	}
	if err != nil {
		return fmt.Errorf("disarm: %w", err)
	}
	var r checkpoint.PageStreamRequest
	perr := json.Unmarshal(b, &r)
	if name != "" && (perr != nil || r.Name != name) {
		_, err := fmt.Fprintln(out, "nothing armed") // another move's
		return err
	}
	if err := os.Remove(req); errors.Is(err, fs.ErrNotExist) {
		_, err := fmt.Fprintln(out, "nothing armed") // a checkpoint took it meanwhile
		return err
	} else if err != nil {
		return fmt.Errorf("disarm: %w", err)
	}
	if perr == nil && r.Socket != "" && r.Socket == filepath.Base(r.Socket) {
		if c, err := net.DialTimeout("unix", filepath.Join(dir, r.Socket), 5*time.Second); err == nil {
			c.Close()
		}
	}
	_, err = fmt.Fprintln(out, "disarmed")
	return err
}
