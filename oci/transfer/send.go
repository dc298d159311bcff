package transfer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
)

const (
	// ProgressInterval and ProgressBytes pace Send's progress calls: one when at least
	// ProgressInterval has passed or ProgressBytes (bytes) have been sent since the previous
	// one, whichever comes first.
	ProgressInterval = 100 * time.Millisecond
	ProgressBytes    = 8 << 20 // bytes

	// maxVerdictBytes bounds the verdict line a sender reads, in bytes.
	maxVerdictBytes = 64 << 10
	// verdictGrace is how long Send, after its stream broke off, waits for a verdict that says
	// why (a receiver that refuses early answers, then stops reading).
	verdictGrace = 5 * time.Second
	// sendBufferSize is the write buffer between the tar stream and conn, in bytes. It batches
	// tar headers; file content (written 1 MiB at a time) passes straight through.
	sendBufferSize = 64 << 10
)

// Result describes a completed Send.
type Result struct {
	// Path is where the receiver stored the checkpoint, on the receiver's file system.
	Path string
	// Bytes is the length of the tar stream sent, in bytes (the header line not counted).
	Bytes int64
	// Elapsed is the wall time from the first byte sent to the receiver's verdict, including
	// the receiver's verification.
	Elapsed time.Duration
}

// Send sends the checkpoint directory dir to the receiver at the other end of conn, under name,
// and waits for the receiver's verdict. Unless conn is already Greeted (Handshake), Send first
// waits for the receiver's greeting, at most HandshakeTimeout. dir must hold a berth.json (checkpoint.WriteManifest); Send
// checks that it parses but does not verify the files (the receiver does, and says so).
//
// progress, if not nil, is called from Send's goroutine as progress(sent, total): total is the
// tar stream's length in bytes, sent how much of it has been written to conn. It is called once
// with sent 0, then paced by ProgressInterval and ProgressBytes, and once with sent == total
// when the stream is out (the receiver then still verifies before answering).
//
// conn belongs to the caller, who closes it; Send does not, except to abort when ctx is done
// (cancel or deadline), which also bounds the wait for the verdict. Send sets deadlines on conn
// for its own use; conn is spent afterwards.
//
// Errors: ErrInvalidName for a bad name (nothing is sent); checkpoint.ReadManifest's and archive.New's
// errors for a bad dir (nothing is sent); ErrRejected, wrapped with the receiver's error text,
// when the receiver refuses the checkpoint (also when it refuses before the stream is out);
// ErrPageStream for a checkpoint received in copy mode, whose page images its signature does
// not cover (nothing is sent);
// ErrProtocol for a missing or wrong greeting (nothing is sent) and for a malformed verdict; ctx.Err() (wrapped) when ctx ended the transfer; conn's
// I/O error otherwise (for example when the receiver vanished). All wrapped with the name.
func Send(ctx context.Context, conn net.Conn, dir, name string, progress func(sent, total int64)) (Result, error) {
	if err := ValidName(name); err != nil {
		return Result{}, fmt.Errorf("send: %w", err)
	}
	raw, err := checkpoint.ReadManifestBytes(dir)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	m, err := checkpoint.ParseManifest(raw)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %s: %w", name, dir, err)
	}
	if err := pagesFromStream(dir, m); err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	ar, err := archive.New(dir)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	return sendStream(ctx, conn, header{Magic: Magic, Name: name, TotalBytes: ar.Size(), Manifest: raw}, ar, progress)
}

// pagesFromStream returns an error when dir, whose manifest is m, is a checkpoint received in
// copy mode: it holds page images that m does not list, which came in a page stream
// (m.PageStream) and are covered by the receiving node's stamp, not by the signature, so no
// other receiver could verify them.
func pagesFromStream(dir string, m *checkpoint.Manifest) error {
	if m.PageStream == nil {
		return nil
	}
	ents, err := os.ReadDir(filepath.Join(dir, checkpoint.ImagesDir))
	if err != nil {
		return nil // the archive names what is wrong with dir
	}
	listed := map[string]bool{}
	for _, f := range m.Files {
		listed[f.Path] = true
	}
	for _, e := range ents {
		if p := checkpoint.ImagesDir + "/" + e.Name(); checkpoint.IsPageImage(p) && !listed[p] {
			return fmt.Errorf("%w: %s was received in copy mode: its memory pages (%s) came in a page stream that only the receiving node verified, so another receiver could not verify them; checkpoint the container again (berthctl checkpoint, or migrate it) to send it",
				ErrPageStream, dir, e.Name())
		}
	}
	return nil
}

// sendStream sends hdr, then the hdr.TotalBytes bytes src writes, and waits for the verdict:
// the part of the protocol that Send and SendCRIArchive share.
func sendStream(ctx context.Context, conn net.Conn, hdr header, src io.WriterTo, progress func(sent, total int64)) (res Result, retErr error) {
	name, total := hdr.Name, hdr.TotalBytes
	line, err := json.Marshal(hdr)
	if err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	line = append(line, '\n')

	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	defer func() {
		if retErr != nil && ctx.Err() != nil {
			retErr = fmt.Errorf("send %s: %w (%v)", name, ctx.Err(), retErr)
		}
	}()
	if _, err := Handshake(conn); err != nil {
		return Result{}, fmt.Errorf("send %s: %w", name, err)
	}

	// Read the verdict concurrently with streaming: a receiver that refuses early answers
	// while we are still writing, and on a synchronous conn (net.Pipe) it could not answer at
	// all if nobody read.
	verdicts := make(chan verdictResult, 1)
	go func() {
		v, err := readVerdict(conn)
		if err == nil && !v.OK {
			_ = conn.SetWriteDeadline(time.Now()) // stop the stream: the receiver is not reading
		}
		verdicts <- verdictResult{v, err}
	}()
	var got *verdictResult
	defer func() {
		if got == nil { // the reader is still running: unblock it and let it finish
			_ = conn.SetReadDeadline(time.Now())
			<-verdicts
		}
	}()

	start := time.Now()
	werr := stream(conn, line, src, total, progress)
	if werr != nil {
		// The receiver may have refused and said why; give its verdict a moment to arrive.
		timer := time.NewTimer(verdictGrace)
		defer timer.Stop()
		select {
		case vr := <-verdicts:
			got = &vr
			if vr.err == nil && !vr.v.OK {
				return Result{}, fmt.Errorf("send %s: %w: %s", name, ErrRejected, vr.v.Error)
			}
		case <-timer.C:
		}
		return Result{}, fmt.Errorf("send %s: %w", name, werr)
	}

	wait := SendIdleTimeout + time.Duration(total/VerifyBytesPerSecond)*time.Second
	timer := time.NewTimer(wait)
	defer timer.Stop()
	var vr verdictResult
	select {
	case vr = <-verdicts:
	case <-timer.C:
		return Result{}, fmt.Errorf("send %s: the receiver gave no verdict %v after the stream ended: %w", name, wait, os.ErrDeadlineExceeded)
	}
	got = &vr
	if vr.err != nil {
		return Result{}, fmt.Errorf("send %s: waiting for the receiver's verdict: %w", name, vr.err)
	}
	if !vr.v.OK {
		return Result{}, fmt.Errorf("send %s: %w: %s", name, ErrRejected, vr.v.Error)
	}
	return Result{Path: vr.v.Path, Bytes: total, Elapsed: time.Since(start)}, nil
}

// stream writes the header line and the tar stream to conn, reporting progress.
// SendIdleTimeout bounds how long Send waits for the receiver to take more bytes, and (plus
// the verification time at VerifyBytesPerSecond) for its verdict: a receiver that stalls cannot
// hold a migration, and its paused source, forever.
var SendIdleTimeout = time.Minute

// VerifyBytesPerSecond is the slowest verification rate (digest and fsync) Send waits for, bytes/s.
const VerifyBytesPerSecond = 50 << 20

func stream(conn net.Conn, line []byte, src io.WriterTo, total int64, progress func(sent, total int64)) error {
	flush := coalesceWrites(conn)
	defer func() { _ = flush() }() // on errors; after the stream's own flush it writes nothing
	if _, err := conn.Write(line); err != nil {
		return err
	}
	pw := &progressWriter{w: conn, total: total, fn: progress, last: time.Now()}
	if progress != nil {
		progress(0, total)
	}
	bw := bufio.NewWriterSize(pw, sendBufferSize)
	n, err := src.WriteTo(bw)
	if err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := flush(); err != nil {
		return err
	}
	if n != total {
		return fmt.Errorf("%w: wrote %d bytes, announced %d", ErrProtocol, n, total)
	}
	if progress != nil && pw.lastSent != total {
		progress(total, total)
	}
	return nil
}

// progressWriter counts bytes written to w and calls fn, paced by ProgressInterval and
// ProgressBytes.
type progressWriter struct {
	w        io.Writer
	total    int64
	fn       func(sent, total int64)
	sent     int64
	lastSent int64
	last     time.Time
}

func (p *progressWriter) Write(b []byte) (int, error) {
	if c, ok := p.w.(net.Conn); ok {
		_ = c.SetWriteDeadline(time.Now().Add(SendIdleTimeout))
	}
	n, err := p.w.Write(b)
	p.sent += int64(n)
	if p.fn != nil && (p.sent-p.lastSent >= ProgressBytes || time.Since(p.last) >= ProgressInterval) {
		p.fn(p.sent, p.total)
		p.lastSent, p.last = p.sent, time.Now()
	}
	return n, err
}

type verdictResult struct {
	v   verdict
	err error
}

// readVerdict reads the receiver's verdict line from conn, reading nothing past it.
func readVerdict(conn net.Conn) (verdict, error) {
	line, err := readLine(conn, maxVerdictBytes)
	if err != nil {
		return verdict{}, err
	}
	var v verdict
	if err := json.Unmarshal(line, &v); err != nil {
		return verdict{}, fmt.Errorf("%w: verdict: %w", ErrProtocol, err)
	}
	if !v.OK && v.Error == "" {
		v.Error = "no reason given"
	}
	return v, nil
}

// readLine reads from r up to and including the first '\n', one byte at a time so that nothing
// after the line is consumed, and returns the line without it. Errors: ErrProtocol when the line
// is longer than max bytes; io.ErrUnexpectedEOF when r ends first; r's read error.
func readLine(r io.Reader, max int) ([]byte, error) {
	var buf bytes.Buffer
	b := make([]byte, 1)
	for {
		n, err := r.Read(b)
		if n == 1 {
			if b[0] == '\n' {
				return buf.Bytes(), nil
			}
			if buf.Len() >= max {
				return nil, fmt.Errorf("%w: line longer than %d bytes", ErrProtocol, max)
			}
			buf.WriteByte(b[0])
			continue
		}
		if errors.Is(err, io.EOF) {
			return nil, io.ErrUnexpectedEOF
		}
		if err != nil {
			return nil, err
		}
	}
}
