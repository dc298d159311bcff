package transfer

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
	"strings"
	"sync"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/internal/fsutil"
)

const (
	// StagingPrefix starts the name of a staging directory under Receiver.Root:
	// StagingPrefix + name + "-" + 16 hex digits. Such directories exist only while a transfer
	// runs (or after the receiving process died mid-transfer; see CleanStaging).
	StagingPrefix = ".incoming-"

	// DefaultIdleTimeout is Receiver.IdleTimeout when zero.
	DefaultIdleTimeout = time.Minute
	// DefaultMaxConns is Receiver.MaxConns when zero.
	DefaultMaxConns = 4

	// maxHeaderBytes bounds the header line, in bytes: a base64 manifest of up to
	// checkpoint.MaxManifestBytes, and room for the rest.
	maxHeaderBytes = checkpoint.MaxManifestBytes/3*4 + 8<<10
	// maxErrorText bounds the error text sent back in a verdict, in bytes.
	maxErrorText = 4 << 10
	// lingerTime is how long a receiver that refused before the end of the stream keeps reading
	// (and discarding) it, so the refusal reaches the sender instead of a connection reset.
	lingerTime = 2 * time.Second
	// recvBufferSize is the read buffer on the connection, in bytes.
	recvBufferSize = 1 << 20
)

// Receiver receives checkpoints sent with Send and stores each, once verified, as Root/<name>.
// Set its fields before the first Serve or Handle and leave them; the zero value of every field
// but Root is usable. One Receiver may handle many connections at once.
type Receiver struct {
	// Root is the directory that receives checkpoints; it is created with mode 0700 (and its
	// parents as needed) if missing. Only root should be able to write to it.
	Root string
	// Limits bound what one transfer may write (zero fields: the archive defaults). The sender
	// cannot exceed what its header announced either: the announced manifest's ImageSize plus
	// the size of berth.json caps the bytes extracted.
	Limits archive.Limits
	// IdleTimeout is how long a connection may go without the sender sending anything (or
	// without it reading the verdict) before the transfer fails; 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxConns is how many connections Serve handles at once (more wait in the listener's
	// backlog); 0 means DefaultMaxConns.
	MaxConns int
	// NoSync skips fsyncing the received files before they are renamed into place. Leave it
	// false in production: a crash could otherwise leave a checkpoint in place whose files were
	// never written to disk. Tests and benchmarks on throwaway directories may set it.
	NoSync bool
	// OnDone, if not nil, is called by Serve after each connection, with the peer's address,
	// the path of the stored checkpoint (empty on failure) and Handle's error.
	OnDone func(remote net.Addr, path string, err error)

	mu       sync.Mutex
	inFlight map[string]bool // names being received
}

// Serve accepts connections on ln and handles each (Handle) in its own goroutine, at most
// MaxConns at a time, until ctx is done; then it closes ln, waits for the running transfers
// (which ctx also aborts) and returns nil. Each connection is closed after Handle returns, and
// its outcome reported to OnDone. ln can be any listener (a tls.NewListener for encryption and
// client authentication).
//
// Errors: the listener's Accept error (wrapped), when it fails for another reason than ctx
// ending it; temporary (timeout) errors are retried.
func (r *Receiver) Serve(ctx context.Context, ln net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()

	maxConns := r.MaxConns
	if maxConns <= 0 {
		maxConns = DefaultMaxConns
	}
	slots := make(chan struct{}, maxConns)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		conn, err := ln.Accept()
		if err != nil {
			<-slots
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("transfer: accept: %w", err)
		}
		wg.Go(func() {
			defer func() { <-slots }()
			path, err := r.Handle(ctx, conn)
			_ = conn.Close()
			if r.OnDone != nil {
				r.OnDone(conn.RemoteAddr(), path, err)
			}
		})
	}
}

// Handle receives one checkpoint from conn and answers the sender with the verdict. It returns
// the absolute path of the stored checkpoint, Root/<name>.
//
// Steps: greet the sender (Greeting); read and check the header (magic, name, manifest, sizes);
// refuse a name that exists under Root or is being received; extract the stream
// (archive.Extract, with Limits) into a staging directory Root/.incoming-<name>-<random>; check
// that exactly the announced bytes came and that the berth.json received is the header's; verify
// every file (checkpoint.Verify); fsync (unless NoSync); rename the staging directory to
// Root/<name> without replacing anything; fsync Root. On any failure the staging directory is
// removed, so nothing half-received remains, and the sender is told why.
//
// conn belongs to the caller, who closes it; Handle closes it only to abort when ctx is done.
// A sender that stalls for IdleTimeout fails the transfer.
//
// Errors: ErrProtocol, ErrInvalidName, ErrExists, checkpoint.ErrUnsupportedVersion,
// checkpoint.ErrInvalidManifest, archive's Err* refusals, oci's verification sentinels
// (checkpoint.ErrDigestMismatch...), conn's I/O errors (a cut connection: io.ErrUnexpectedEOF or a
// reset), ctx.Err(), file-system errors under Root; wrapped with the name when known. When the
// checkpoint was stored but the verdict could not be sent, Handle returns the path and that
// error.
func (r *Receiver) Handle(ctx context.Context, conn net.Conn) (string, error) {
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	idle := r.IdleTimeout
	if idle <= 0 {
		idle = DefaultIdleTimeout
	}
	// greet first: a sender learns it reached a berth receiver before it pauses anything
	_ = conn.SetWriteDeadline(time.Now().Add(idle))
	if _, err := conn.Write([]byte(Greeting)); err != nil {
		return "", fmt.Errorf("greet sender: %w", err)
	}
	ir := &idleReader{conn: conn, idle: idle}
	br := bufio.NewReaderSize(ir, recvBufferSize)
	path, drained, err := r.receive(br)
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	}

	v := verdict{OK: err == nil, Path: path}
	if err != nil {
		v.Error = err.Error()
		if len(v.Error) > maxErrorText {
			v.Error = v.Error[:maxErrorText] + "..."
		}
	}
	line, _ := json.Marshal(v) // cannot fail: strings and a bool
	_ = conn.SetWriteDeadline(time.Now().Add(idle))
	_, werr := conn.Write(append(line, '\n'))

	if err != nil {
		if !drained && ir.err == nil && werr == nil && ctx.Err() == nil {
			// We refused; the sender may still be streaming: read on for a moment, so that
			// closing the connection does not reset it before the sender has read the verdict.
			_ = conn.SetReadDeadline(time.Now().Add(lingerTime))
			_, _ = io.Copy(io.Discard, conn)
		}
		return "", err
	}
	if werr != nil {
		return path, fmt.Errorf("stored %s, but could not tell the sender: %w", path, werr)
	}
	return path, nil
}

// receive runs the protocol up to the verdict. drained reports whether the whole stream was
// read.
func (r *Receiver) receive(br *bufio.Reader) (path string, drained bool, retErr error) {
	hdr, err := readHeader(br)
	if err != nil {
		return "", false, err
	}
	name := hdr.Name
	if err := ValidName(name); err != nil {
		return "", false, err
	}
	m, err := checkpoint.ParseManifest(hdr.Manifest)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: header manifest: %w", name, err)
	}
	lim := r.Limits.WithDefaults()
	if m.ImageSize > lim.MaxTotalBytes-int64(len(hdr.Manifest)) { // written so it cannot overflow
		return "", false, fmt.Errorf("receive %s: %w: %d bytes of files and %d of manifest announced, limit %d",
			name, archive.ErrTotalTooLarge, m.ImageSize, len(hdr.Manifest), lim.MaxTotalBytes)
	}
	content := m.ImageSize + int64(len(hdr.Manifest)) // what the stream must extract, in bytes
	lim.MaxTotalBytes = content
	if hdr.TotalBytes < content {
		return "", false, fmt.Errorf("receive %s: %w: stream of %d bytes announced for %d bytes of files",
			name, ErrProtocol, hdr.TotalBytes, content)
	}

	if r.Root == "" {
		return "", false, fmt.Errorf("receive %s: receiver has no root directory: %w", name, fs.ErrInvalid)
	}
	root, err := filepath.Abs(r.Root)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	if !r.claim(name) {
		return "", false, fmt.Errorf("receive %s: %w: another transfer of it is running", name, ErrExists)
	}
	defer r.release(name)
	final := filepath.Join(root, name)
	if _, err := os.Lstat(final); err == nil {
		return "", false, fmt.Errorf("receive %s: %w: %s", name, ErrExists, final)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}

	var suffix [8]byte
	_, _ = rand.Read(suffix[:]) // never fails
	staging := filepath.Join(root, StagingPrefix+name+"-"+hex.EncodeToString(suffix[:]))
	defer func() {
		if retErr != nil {
			if err := os.RemoveAll(staging); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("remove %s: %w", staging, err))
			}
		}
	}()

	cr := &countingReader{r: io.LimitReader(br, hdr.TotalBytes)}
	digests, err := archive.ExtractDigests(cr, staging, lim)
	if err != nil {
		return "", false, fmt.Errorf("receive %s: %w", name, err)
	}
	if cr.n != hdr.TotalBytes {
		return "", false, fmt.Errorf("receive %s: %w: stream ended after %d of %d bytes", name, ErrProtocol, cr.n, hdr.TotalBytes)
	}
	drained = true

	got, err := checkpoint.ReadManifestBytes(staging)
	if err != nil {
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if !bytes.Equal(got, hdr.Manifest) {
		return "", drained, fmt.Errorf("receive %s: %w: the berth.json in the stream differs from the header's", name, ErrProtocol)
	}
	// digests were computed while extracting: no second read of the files
	if err := checkpoint.VerifyDigests(staging, m, digests); err != nil {
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if !r.NoSync {
		if err := syncTree(staging); err != nil {
			return "", drained, fmt.Errorf("receive %s: %w", name, err)
		}
	}
	if err := renameNoReplace(staging, final); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return "", drained, fmt.Errorf("receive %s: %w: %s", name, ErrExists, final)
		}
		return "", drained, fmt.Errorf("receive %s: %w", name, err)
	}
	if !r.NoSync {
		// Best effort: the checkpoint is complete and in place, only the rename's durability
		// would be in doubt, and reporting failure for a stored checkpoint would mislead.
		_ = fsutil.SyncDir(root)
	}
	// record the verification so the shim's restore need not read the files again; without
	// the stamp it verifies in full, so a failure here costs time, not safety
	_ = checkpoint.WriteStamp(final, m)
	return final, drained, nil
}

// claim marks name as being received; false if it already is.
func (r *Receiver) claim(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inFlight[name] {
		return false
	}
	if r.inFlight == nil {
		r.inFlight = map[string]bool{}
	}
	r.inFlight[name] = true
	return true
}

func (r *Receiver) release(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.inFlight, name)
}

// CleanStaging removes every staging directory (StagingPrefix*) under Root: leftovers of a
// receiving process that died mid-transfer. Call it at startup, before Serve, and never while
// a transfer into Root may be running (from this process or another).
//
// Errors: the *fs.PathError of reading Root (none when Root does not exist) or of a removal.
func (r *Receiver) CleanStaging() error {
	entries, err := os.ReadDir(r.Root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("clean staging: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), StagingPrefix) {
			if err := os.RemoveAll(filepath.Join(r.Root, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clean staging: %w", err)
	}
	return nil
}

// readHeader reads and decodes the header line.
func readHeader(br *bufio.Reader) (header, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > maxHeaderBytes {
			return header{}, fmt.Errorf("%w: header line longer than %d bytes", ErrProtocol, maxHeaderBytes)
		}
		if err == nil {
			break
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if errors.Is(err, io.EOF) {
			return header{}, fmt.Errorf("%w: connection closed before the header ended", ErrProtocol)
		}
		return header{}, fmt.Errorf("reading header: %w", err)
	}
	var h header
	if err := json.Unmarshal(line, &h); err != nil {
		return header{}, fmt.Errorf("%w: header: %w", ErrProtocol, err)
	}
	if h.Magic != Magic {
		return header{}, fmt.Errorf("%w: magic %q, want %q", ErrProtocol, h.Magic, Magic)
	}
	return h, nil
}

// syncTree fsyncs every file and directory under dir, dir included.
func syncTree(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		if err := f.Sync(); err != nil {
			_ = f.Close()
			return err
		}
		return f.Close()
	})
}

// idleReader reads from conn, failing a read that waits longer than idle. It remembers the
// first read error (end of stream included).
type idleReader struct {
	conn net.Conn
	idle time.Duration
	err  error
}

func (r *idleReader) Read(p []byte) (int, error) {
	if err := r.conn.SetReadDeadline(time.Now().Add(r.idle)); err != nil {
		r.err = err
		return 0, err
	}
	n, err := r.conn.Read(p)
	if err != nil && r.err == nil {
		r.err = err
	}
	return n, err
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
