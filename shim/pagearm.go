package shim

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
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/berth-dev/berth/oci/transfer/frame"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// Armed page streams (checkpoint.PageStreamRequest): copy mode for checkpoints the kubelet asks
// for. The node's agent arms a stream for a container; on that container's next Checkpoint
// request the shim claims the request, runs a relay on 127.0.0.1 that CRIU's page client
// connects to (the page-server request of pageserver.go, written into the CRIU work directory by
// the shim itself), digests the stream as it forwards it, in frames, to the agent's unix socket,
// and puts the digest and length into the manifest it signs. Without an armed request (or with
// an expired one) a checkpoint is taken as before: page images in the checkpoint.

// pageStreamDir is the directory of armed page streams (page_stream_dir).
func (s *Service) pageStreamDir() string {
	if s.cfg.PageStreamDir != "" {
		return s.cfg.PageStreamDir
	}
	return checkpoint.DefaultPageStreamDir
}

// containerIDRE is what a containerd id may be (containerd's identifiers.Validate) and so what
// may name an armed request's file.
var containerIDRE = regexp.MustCompile(`^[A-Za-z0-9]+(?:[._-](?:[A-Za-z0-9]+))*$`)

// claimPageStream takes the armed request for container id out of dir, if there is one and it
// was armed for this checkpoint request: one that arrived at now with the deadline deadline (ok:
// it has one; checkpoint.PageStreamRequest.Takes). A request armed for another checkpoint call is
// left in place, untouched, and nil returned: this checkpoint is taken as if nothing were armed.
// It reads the request, then renames <id>.json to a name of its own, so that of two checkpoints
// racing for it exactly one gets it, and checks that what it took is what it read. It returns nil
// (no error) when none is armed or the one armed expired before now (removed). Errors: a request
// that is not JSON, names another container or a socket outside dir, lacks its expiry, arming
// time or checkpoint timeout, or changed while claimed (checkpoint.ErrBadPageStreamRequest,
// errdefs InvalidArgument by errors.go; the request is removed), and I/O errors other than a
// missing file.
func claimPageStream(dir, id string, now, deadline time.Time, ok bool) (*checkpoint.PageStreamRequest, error) {
	if !containerIDRE.MatchString(id) || len(id) > 76 {
		return nil, nil // not a name the agent could have armed
	}
	armed := filepath.Join(dir, id+checkpoint.PageStreamRequestSuffix)
	b, err := readArmedFile(armed)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	var req *checkpoint.PageStreamRequest
	if err == nil {
		req, err = parseArmed(b, id, dir)
	}
	if err == nil && now.Before(req.Expires) && !req.Takes(deadline, ok, now) {
		return nil, nil // another party's checkpoint: the request waits for its own
	}
	var sfx [6]byte
	_, _ = rand.Read(sfx[:])
	claimed := armed + ".claimed-" + hex.EncodeToString(sfx[:])
	if rerr := os.Rename(armed, claimed); rerr != nil {
		if errors.Is(rerr, fs.ErrNotExist) {
			return nil, nil // another checkpoint took it, or its agent disarmed it
		}
		return nil, fmt.Errorf("claim armed page stream %s: %w", armed, rerr)
	}
	defer os.Remove(claimed)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%w %s: %w", checkpoint.ErrBadPageStreamRequest, armed, err)
	case !now.Before(req.Expires):
		return nil, nil
	}
	if again, err := readArmedFile(claimed); err != nil || !bytes.Equal(again, b) {
		return nil, fmt.Errorf("%w %s: replaced while this checkpoint claimed it", checkpoint.ErrBadPageStreamRequest, armed)
	}
	return req, nil
}

// parseArmed parses and checks the armed request b, read from dir's <id>.json. Errors say what
// is wrong with it.
func parseArmed(b []byte, id, dir string) (*checkpoint.PageStreamRequest, error) {
	var req checkpoint.PageStreamRequest
	switch {
	case json.Unmarshal(b, &req) != nil:
		return nil, errors.New("not JSON")
	case req.Container != id:
		return nil, fmt.Errorf("armed for container %q, not %s", req.Container, id)
	case req.Socket == "" || req.Socket != filepath.Base(req.Socket) || strings.HasPrefix(req.Socket, "."):
		return nil, fmt.Errorf("socket %q is not a file name in %s", req.Socket, dir)
	case req.Expires.IsZero():
		return nil, errors.New("no expiry")
	case req.Armed.IsZero() || req.CheckpointTimeout <= 0:
		return nil, errors.New("no arming time or checkpoint timeout (armed by an older berthctl send-pages?)")
	case req.StreamID != "" && !checkpoint.ValidStreamID(req.StreamID):
		return nil, fmt.Errorf("stream id %q is not 32 lowercase hex digits", req.StreamID)
	}
	if _, err := checkpoint.NewPageDigest(req.Digest); err != nil {
		return nil, err
	}
	return &req, nil
}

// maxArmedFile bounds an armed request's file (a few hundred bytes when the agent writes it).
const maxArmedFile = 64 << 10

// readArmedFile reads the armed request at path, a regular file of its own (one link, at most
// maxArmedFile bytes): never what a symbolic link there points to (the shim is root in the
// host's mount namespace, the directory's writer may be a container), nor a FIFO that would block
// the checkpoint. Errors name what the file is instead.
func readArmedFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, errors.New("a symbolic link, not a file")
		}
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	st, _ := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("not a regular file (%v)", fi.Mode().Type())
	case st == nil || st.Nlink != 1:
		return nil, errors.New("a file with other links")
	case fi.Size() > maxArmedFile:
		return nil, fmt.Errorf("%d bytes, more than %d", fi.Size(), maxArmedFile)
	}
	return io.ReadAll(io.LimitReader(f, maxArmedFile))
}

// dialArmedSocket connects to the unix socket at path, which must be a socket itself: never
// one that a symbolic link there points to. It opens the path without following links and
// connects through that descriptor (/proc/self/fd), so that nothing renamed in between
// redirects it.
func dialArmedSocket(path string) (net.Conn, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return nil, fmt.Errorf("%s: not a unix socket (a symbolic link or another file)", path)
	}
	return net.DialTimeout("unix", fmt.Sprintf("/proc/self/fd/%d", fd), armedDialTimeout)
}

// ErrPageStreamLost: the armed page stream did not reach the destination whole (the agent's
// socket did not answer, the link was cut, the destination's page server failed); the dump is
// undone, the task runs on (errdefs Unavailable by errors.go: a later move may succeed).
var ErrPageStreamLost = errors.New("armed page stream lost")

// armedRelay is the shim's end of an armed page stream: CRIU's page client connects to ln; the
// relay forwards its stream in frames to agent, digesting it with alg (the armed request's
// Digest, the algorithm the agent announced to the receiver), and the page server's answers
// back.
type armedRelay struct {
	ln    net.Listener
	agent net.Conn
	alg   string
	id    string // the stream's ID (the request's StreamID), signed as the PageStream's
	done  chan struct{}
	res   checkpoint.PageStream
	err   error
}

// armedDialTimeout bounds the connection to the agent's socket.
const armedDialTimeout = 5 * time.Second

// armedStallTimeout bounds each write of the page stream to the agent's socket: an agent that
// accepts the stream and stops reading would otherwise keep CRIU's dump, and so the frozen
// container, waiting until the checkpoint request's own deadline, if it has one. A variable so
// that tests can shorten it.
var armedStallTimeout = 30 * time.Second

// deadlineWriter is a connection whose every Write must finish within d.
type deadlineWriter struct {
	c net.Conn
	d time.Duration
}

func (w deadlineWriter) Write(p []byte) (int, error) {
	if err := w.c.SetWriteDeadline(time.Now().Add(w.d)); err != nil {
		return 0, err
	}
	return w.c.Write(p)
}

// armPageStream claims the armed request for task id (claimPageStream in the shim's
// page_stream_dir), if it was armed for this request (ctx's deadline, which ttrpc carries from
// the checkpoint call: checkpoint.PageStreamRequest.Takes), connects to its agent's socket, starts the relay and writes its address as
// the page-server request into the CRIU work directory workDir, which usePageServer then reads.
// It returns nil when no request is armed, or when workDir already asks for copy or lazy mode
// (berthctl's own request wins; the armed one is left for its agent to expire). Errors: the
// claim's, an agent that does not answer on its socket (the request is used up either way).
func (s *Service) armPageStream(ctx context.Context, id, workDir string) (*armedRelay, error) {
	for _, f := range []string{checkpoint.PageServerRequestFile, checkpoint.LazyPagesRequestFile} {
		if _, err := os.Lstat(filepath.Join(workDir, f)); err == nil {
			return nil, nil
		}
	}
	dir := s.pageStreamDir()
	deadline, ok := ctx.Deadline()
	req, err := claimPageStream(dir, id, s.deps.Now(), deadline, ok)
	if err != nil || req == nil {
		if _, serr := os.Lstat(filepath.Join(dir, id+checkpoint.PageStreamRequestSuffix)); err == nil && serr == nil {
			log.G(ctx).WithField("deadline", deadline).
				Info("a page stream is armed for this container, for another checkpoint call (another deadline): this one is taken as usual")
		}
		return nil, err
	}
	sock := filepath.Join(dir, req.Socket)
	agent, err := dialArmedSocket(sock)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w: the page stream armed for %s: the agent's socket: %w", id, ErrPageStreamLost, req.Name, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		agent.Close()
		return nil, fmt.Errorf("checkpoint %s: page stream relay: %w", id, err)
	}
	req2 := filepath.Join(workDir, checkpoint.PageServerRequestFile)
	if err := os.WriteFile(req2, []byte(ln.Addr().String()+"\n"), 0o600); err != nil {
		ln.Close()
		agent.Close()
		return nil, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	a := &armedRelay{ln: ln, agent: agent, alg: req.Digest, id: req.StreamID, done: make(chan struct{})}
	go func() {
		defer close(a.done)
		a.res, a.err = a.relay(ctx)
	}()
	log.G(ctx).WithFields(log.Fields{"checkpoint": req.Name, "relay": ln.Addr().String(), "agent": sock}).
		Info("copy mode armed by the node's agent: CRIU sends memory pages through the shim's relay")
	return a, nil
}

func (a *armedRelay) relay(ctx context.Context) (checkpoint.PageStream, error) {
	defer a.agent.Close()
	stop := context.AfterFunc(ctx, a.close)
	defer stop()
	var c net.Conn
	for {
		var err error
		if c, err = a.ln.Accept(); err != nil {
			return checkpoint.PageStream{}, fmt.Errorf("%w: CRIU never connected: %w", ErrPageStreamLost, err)
		}
		if tcpPeerIsRoot(c) {
			break
		}
		c.Close() // not the shim's CRIU: nobody else's bytes are digested and signed
	}
	_ = a.ln.Close()
	defer c.Close()
	stopC := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stopC()
	back := make(chan error, 1)
	go func() { // the destination page server's answers, to CRIU
		_, err := io.Copy(c, a.agent)
		_ = c.(*net.TCPConn).CloseWrite()
		back <- err
	}()
	h, err := checkpoint.NewPageDigest(a.alg) // known: claimPageStream checked it
	if err != nil {
		return checkpoint.PageStream{}, err
	}
	n, err := frame.Write(deadlineWriter{a.agent, armedStallTimeout}, c, h)
	if err != nil {
		return checkpoint.PageStream{}, fmt.Errorf("%w: cut after %d bytes: %w", ErrPageStreamLost, n, err)
	}
	_ = a.agent.(*net.UnixConn).CloseWrite()
	// the destination's page server has every page once its answers end: the receiver closes
	// after it exited, then the agent
	if err := <-back; err != nil {
		return checkpoint.PageStream{}, fmt.Errorf("%w: the destination's answers: %w", ErrPageStreamLost, err)
	}
	return checkpoint.PageStream{Digest: checkpoint.PageDigest(a.alg, h), Size: n, ID: a.id}, nil
}

// armedWaitTimeout bounds the wait, once CRIU's dump ended, for the destination's page server
// to have taken the whole stream.
const armedWaitTimeout = 2 * time.Minute

// wait returns the stream's digest and length once CRIU ended it and the destination's page
// server finished (the agent closed its socket); the relay's error otherwise.
func (a *armedRelay) wait(ctx context.Context) (checkpoint.PageStream, error) {
	t := time.NewTimer(armedWaitTimeout)
	defer t.Stop()
	select {
	case <-a.done:
		return a.res, a.err
	case <-ctx.Done():
		a.close()
		return checkpoint.PageStream{}, ctx.Err()
	case <-t.C:
		a.close()
		return checkpoint.PageStream{}, fmt.Errorf("%w: the destination did not end it within %v of the dump", ErrPageStreamLost, armedWaitTimeout)
	}
}

// close abandons the stream: the agent sees it end without its end frame, and so does the
// destination (a cut, never a short stream taken as whole).
func (a *armedRelay) close() {
	_ = a.ln.Close()
	_ = a.agent.Close()
}

// tcpPeerIsRoot reports whether the peer of c, a TCP connection on 127.0.0.1, is a socket of
// uid 0 (the shim's CRIU), from /proc/net/tcp.
func tcpPeerIsRoot(c net.Conn) bool {
	ra, ok1 := c.RemoteAddr().(*net.TCPAddr)
	la, ok2 := c.LocalAddr().(*net.TCPAddr)
	if !ok1 || !ok2 || ra.IP.To4() == nil || la.IP.To4() == nil {
		return false
	}
	hexAddr := func(ip net.IP, port int) string {
		v4 := ip.To4()
		return fmt.Sprintf("%02X%02X%02X%02X:%04X", v4[3], v4[2], v4[1], v4[0], port)
	}
	want := hexAddr(ra.IP, ra.Port) + " " + hexAddr(la.IP, la.Port)
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 7 && fields[1]+" "+fields[2] == want {
			return fields[7] == "0"
		}
	}
	return false
}
