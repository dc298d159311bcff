package commands

import (
	"bufio"
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
	"strconv"
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
		disarm               bool
		tf                   *tlsFlags
	)
	cmd := &cobra.Command{
		Use:   "send-pages --container ID (--name NAME [--expire D] HOST:PORT < SECONDS | --disarm [--name NAME]) [--dir DIR]",
		Short: "Arm copy mode for one checkpoint call of a container: its memory pages go to a 'berthctl receive'",
		Long: `send-pages arms a copy-mode page stream for one checkpoint call of container ID (its containerd
id): the next one made with the timeout SECONDS, read from the first line of standard input (the
kubelet checkpoint API's ?timeout=SECONDS, or 'crictl --timeout=SECONDSs checkpoint'), whose
deadline containerd passes to the shim; not a flag, so that it is not in the command line that
/proc shows every local user. It connects to the 'berthctl receive' at HOST:PORT (mutual TLS, as 'berthctl
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
			cpTimeout, err := readCheckpointTimeout(cmd.InOrStdin())
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			start := time.Now()
			conn, err := dialReceiver(ctx, addr, tf)
			if err != nil {
				return err
			}
			defer conn.Close()
			streamID := checkpoint.NewStreamID()
			if err := transfer.AnnouncePages(conn, name, checkpoint.PageDigestDefault, streamID); err != nil {
				return err
			}
			framed, err := armPages(ctx, cmd.OutOrStdout(), dir, checkpoint.PageStreamRequest{
				Container: container, Name: name, CheckpointTimeout: cpTimeout, Expires: start.Add(expire), Digest: checkpoint.PageDigestDefault,
				StreamID: streamID})
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
	cmd.Flags().BoolVar(&disarm, "disarm", false, "disarm the stream armed for --container (with --name: only the one armed under that name), unless a checkpoint took it already, and end the send-pages that armed it (HOST:PORT not needed)")
	tf = addTLSFlags(cmd.Flags())
	tf.addServerName(cmd.Flags())
	// the armed line comes first on stdout; the result is JSON
	return cmd
}

// maxTimeoutLine bounds the line readCheckpointTimeout reads (an int64 is 19 digits).
const maxTimeoutLine = 64

// readCheckpointTimeout reads the checkpoint timeout, in whole seconds, from the first line of in
// (send-pages' standard input: a flag would show it to every local user in /proc/PID/cmdline).
// Errors: no line, or one that is not a positive number of seconds (the value is not repeated:
// it binds an armed stream).
func readCheckpointTimeout(in io.Reader) (int64, error) {
	line, err := bufio.NewReader(io.LimitReader(in, maxTimeoutLine)).ReadString('\n')
	if err != nil && !(errors.Is(err, io.EOF) && line != "") {
		return 0, fmt.Errorf("read the checkpoint timeout (seconds, one line) from standard input: %w", err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(line), 10, 64)
	if err != nil || n <= 0 {
		return 0, errors.New("the checkpoint timeout on standard input is not a positive number of seconds (want the timeout of the checkpoint call that is to take the stream)")
	}
	return n, nil
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
		if _, _, err := takeRequest(req, func(cur []byte) bool { return bytes.Equal(cur, b) }); err != nil {
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
// checkpoint name: another move's request for the same container is left alone (takeRequest).
func disarmPages(out io.Writer, dir, container, name string) error {
	if container == "" || container != filepath.Base(container) || strings.HasPrefix(container, ".") {
		return fmt.Errorf("--container %q: want a containerd container id", container)
	}
	req := filepath.Join(dir, container+checkpoint.PageStreamRequestSuffix)
	var r checkpoint.PageStreamRequest
	var perr error
	taken, _, err := takeRequest(req, func(b []byte) bool {
		perr = json.Unmarshal(b, &r)
		return name == "" || (perr == nil && r.Name == name)
	})
	if err != nil {
		return fmt.Errorf("disarm: %w", err)
	}
	if !taken {
		_, err := fmt.Fprintln(out, "nothing armed") // none, a checkpoint took it, or another move's
		return err
	}
	if perr == nil && r.Socket != "" && r.Socket == filepath.Base(r.Socket) {
		if c, err := net.DialTimeout("unix", filepath.Join(dir, r.Socket), 5*time.Second); err == nil {
			c.Close()
		}
	}
	_, err = fmt.Fprintln(out, "disarmed")
	return err
}

// takeRequestHook, when set (tests), runs in takeRequest once the request is read and before it
// is removed or put back: where another move may arm a request of its own.
var takeRequestHook func()

// takeRequest removes the armed request at path if ours says it is ours. It first renames the
// request to a name of its own (as the shim's claim does), so that what it reads and judges is
// what it removes: a request that a checkpoint claimed and another move armed meanwhile is never
// removed on the strength of this one's bytes. A request that is not ours is put back (a link,
// never over one armed since). It returns whether it removed one, and its bytes. Errors: I/O
// errors other than a missing request, a request that is not a regular file (removed: no
// send-pages armed it), and one not ours that could not be put back because another was armed in
// its place meanwhile (it is dropped: that move's checkpoint call is then an ordinary one).
func takeRequest(path string, ours func([]byte) bool) (bool, []byte, error) {
	var sfx [6]byte
	if _, err := rand.Read(sfx[:]); err != nil {
		return false, nil, err
	}
	private := path + ".disarm-" + hex.EncodeToString(sfx[:])
	if err := os.Rename(path, private); errors.Is(err, fs.ErrNotExist) {
		return false, nil, nil
	} else if err != nil {
		return false, nil, err
	}
	b, err := readRegular(private)
	if takeRequestHook != nil {
		takeRequestHook()
	}
	if err == nil && !ours(b) {
		err = os.Link(private, path)
		_ = os.Remove(private)
		if errors.Is(err, fs.ErrExist) {
			return false, b, fmt.Errorf("%s: another request was armed while this one, not ours, was out of place: it is dropped", path)
		}
		return false, b, err
	}
	if rerr := os.Remove(private); err == nil {
		err = rerr
	}
	if err != nil {
		return false, nil, fmt.Errorf("%s: %w", path, err)
	}
	return true, b, nil
}

// readRegular reads path, a regular file (never what a symbolic link there points to, nor a
// FIFO that would block) of at most 64 KiB.
func readRegular(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return nil, err
	} else if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file (%v)", fi.Mode().Type())
	}
	return io.ReadAll(io.LimitReader(f, 64<<10))
}
