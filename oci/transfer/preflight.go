package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// ErrNoPreflight is returned by QueryPreflight (wrapped, with the receiver's error text) when the
// receiver gave no answer to a preflight query: it predates the query (a version 2 receiver
// finds no manifest in the header), it has no Receiver.Preflight, or its check could not run.
// Nothing was sent; the sender may go on without the receiver's checks. A receiver's own
// Receiver.Preflight error comes back as this too.
var ErrNoPreflight = errors.New("receiver answered no preflight")

// preflightTimeout bounds a preflight query after the greeting: the header out, the answer back.
const preflightTimeout = 30 * time.Second

// QueryPreflight asks the receiver on conn whether its node can restore a container, before the
// sender pauses anything: it waits for the greeting (Handshake), sends a header with name (the
// checkpoint name the move will use, a ValidName) and query (any JSON value), and returns the
// receiver's answer (Receiver.Preflight's JSON). It reads nothing past the verdict line; conn
// belongs to the caller, who closes it (one query per connection).
//
// Errors: ErrInvalidName; Handshake's (ErrBusy, ErrRefused, ErrProtocol); ErrNoPreflight with the
// receiver's error text; ErrProtocol for a malformed verdict; conn's I/O errors; ctx.Err(). All
// wrapped with the name.
func QueryPreflight(ctx context.Context, conn net.Conn, name string, query any) (json.RawMessage, error) {
	if err := ValidName(name); err != nil {
		return nil, fmt.Errorf("preflight: %w", err)
	}
	q, err := json.Marshal(query)
	if err != nil {
		return nil, fmt.Errorf("preflight of %s: %w", name, err)
	}
	line, err := json.Marshal(header{Magic: Magic, Name: name, Preflight: q})
	if err != nil {
		return nil, fmt.Errorf("preflight of %s: %w", name, err)
	}
	if len(line) > maxHeaderBytes {
		return nil, fmt.Errorf("preflight of %s: %w: query of %d bytes, limit %d", name, ErrProtocol, len(line), maxHeaderBytes)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	defer stop()
	if _, err := Handshake(conn); err != nil {
		return nil, fmt.Errorf("preflight of %s: %w", name, err)
	}
	_ = conn.SetDeadline(time.Now().Add(preflightTimeout))
	defer conn.SetDeadline(time.Time{})
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("preflight of %s: send the query to %s: %w", name, conn.RemoteAddr(), errors.Join(ctx.Err(), err))
	}
	v, err := readVerdict(conn)
	if err != nil {
		return nil, fmt.Errorf("preflight of %s: answer from %s: %w", name, conn.RemoteAddr(), errors.Join(ctx.Err(), err))
	}
	if !v.OK || len(v.Preflight) == 0 {
		why := v.Error
		if why == "" {
			why = "no answer in its verdict"
		}
		return nil, fmt.Errorf("preflight of %s: %w: %s said: %s", name, ErrNoPreflight, conn.RemoteAddr(), why)
	}
	return v.Preflight, nil
}
