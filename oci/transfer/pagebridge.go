package transfer

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// A page bridge is the source's end of a copy-mode page stream whose frames another process
// makes: berth's shim, for a checkpoint the kubelet asks for, relays CRIU's pages, digests them
// and frames them (the frames of writeFrames) into a node agent's unix socket
// (checkpoint.PageStreamRequest); the agent announces the stream to the receiver and forwards
// the frames as they are, and the page server's answers back. The agent holds no digest and no
// key: the receiver compares what it got with the digest the shim signed.

// AnnouncePages greets the receiver on conn (Handshake) and announces checkpoint name's page
// stream, digested with algorithm alg (checkpoint.PageDigestAlgorithms: the one the shim that
// frames the stream was asked for, checkpoint.PageStreamRequest.Digest) under stream ID id
// (checkpoint.NewStreamID, the one the shim signs as the checkpoint's PageStream.ID:
// checkpoint.PageStreamRequest.StreamID; "" for none), as StartPageRelay does. Errors: ErrInvalidName; checkpoint.ErrPageDigestAlgorithm for an alg this berth does not know;
// the handshake's, the write's.
func AnnouncePages(conn net.Conn, name, alg, id string) error {
	if err := ValidName(name); err != nil {
		return fmt.Errorf("page bridge: %w", err)
	}
	if _, err := checkpoint.NewPageDigest(alg); err != nil {
		return fmt.Errorf("page bridge for %s: %w", name, err)
	}
	if _, err := Handshake(conn); err != nil {
		return fmt.Errorf("page bridge for %s: %w", name, err)
	}
	if id != "" && !checkpoint.ValidStreamID(id) {
		return fmt.Errorf("page bridge for %s: stream id %q is not 32 lowercase hex digits", name, id)
	}
	line, err := json.Marshal(header{Magic: Magic, Name: name, Pages: true, PageDigest: alg, StreamID: id})
	if err != nil {
		return err
	}
	_ = conn.SetWriteDeadline(time.Now().Add(HandshakeTimeout))
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("page bridge for %s: %w", name, err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	return nil
}

// BridgePages forwards the framed page stream from framed (the shim's relay) to conn (announced
// with AnnouncePages) as it is, and conn's answers (the destination page server's) back to
// framed, until both directions ended or ctx is done. It returns the bytes forwarded toward the
// receiver, frames included. A stream the shim ended without its end frame reaches the
// receiver as a cut; the bridge does not judge it (the shim and the receiver do). Errors: a
// failed read or write in either direction, ctx's.
func BridgePages(ctx context.Context, conn, framed net.Conn) (int64, error) {
	stop := context.AfterFunc(ctx, func() { _ = conn.Close(); _ = framed.Close() })
	defer stop()
	back := make(chan error, 1)
	go func() {
		_, err := io.Copy(framed, conn)
		if cw, ok := framed.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		back <- err
	}()
	// over TLS, one write of up to 256 KiB per read from the shim's socket rather than one per
	// 16 KiB record, flushed before the next read: the page server may have to answer any byte
	// before more comes (coalescedFrames)
	w, unbatch := coalescedFrames(conn)
	n, err := io.CopyBuffer(w, struct{ io.Reader }{framed}, make([]byte, maxFrame))
	unbatch()
	if cw, ok := underlying(conn).(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	berr := <-back
	if err == nil {
		err = berr
	}
	if cerr := ctx.Err(); cerr != nil {
		err = cerr
	}
	if err != nil {
		return n, fmt.Errorf("%w: bridged %d bytes: %w", ErrPageStream, n, err)
	}
	return n, nil
}
