package transfer

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/berth-dev/berth/oci/internal/quote"
)

// The receiver's first line on a connection is one of:
//
//	<Magic> ready            the receiver waits for the header
//	<Magic> busy             all its slots are in use; it closes the connection (ErrBusy)
//	<Magic> refused: <why>   it will not take checkpoints from this peer (ErrRefused)
const (
	// Greeting is the line a receiver sends as soon as it accepts a connection, before the
	// sender sends anything.
	Greeting      = Magic + " ready\n"
	busyLine      = Magic + " busy\n"
	refusedPrefix = Magic + " refused: "
	// maxGreetingBytes bounds the first line a sender reads, in bytes.
	maxGreetingBytes = 4 << 10
)

var (
	// ErrBusy is returned by Handshake, Dial and Send (wrapped, naming the receiver) when the
	// receiver answered that all its transfer slots are in use. Nothing was sent; try later.
	ErrBusy = errors.New("receiver busy")
	// ErrRefused is returned by Handshake, Dial and Send (wrapped, naming the receiver and
	// with its reason) when the receiver will not take checkpoints from this node: it requires
	// TLS, the certificate is not allowed, or the TLS session ended on a certificate error.
	ErrRefused = errors.New("connection refused by receiver")
)

// HandshakeTimeout bounds how long Handshake waits for a receiver's greeting, and Dial for the
// TLS handshake and the greeting together.
var HandshakeTimeout = 5 * time.Second

// Greeted is a connection whose receiver has greeted (Handshake); Send does not wait for the
// greeting again.
type Greeted struct{ net.Conn }

// Handshake waits for a berth receiver's greeting on conn (at most HandshakeTimeout) and returns
// the connection marked as greeted. Call it right after dialing (Dial does) and before anything
// is paused or checkpointed: a peer that is not a berth receiver (another service on that port,
// a stalled process), a busy receiver and one that refuses this node are found in seconds.
//
// Errors: ErrBusy; ErrRefused with the receiver's reason (or the TLS alert it sent); otherwise
// ErrProtocol, quoting what the peer sent or the read error (a timeout when it sent nothing).
// All name the peer's address.
func Handshake(conn net.Conn) (Greeted, error) {
	if g, ok := conn.(Greeted); ok {
		return g, nil
	}
	_ = conn.SetReadDeadline(time.Now().Add(HandshakeTimeout))
	defer conn.SetReadDeadline(time.Time{})
	line, err := readGreeting(conn)
	switch {
	case err != nil && isRemoteTLSAlert(err):
		return Greeted{}, fmt.Errorf("%w: %s ended the TLS session: %w (is this node's certificate issued by the receiver's CA, with the \"client auth\" usage?)",
			ErrRefused, conn.RemoteAddr(), err)
	case err != nil && len(line) > 0:
		return Greeted{}, fmt.Errorf("%w: %s is not a berth receiver (it sent %s, then: %v)", ErrProtocol, conn.RemoteAddr(), quote.Value(line), err)
	case err != nil:
		return Greeted{}, fmt.Errorf("%w: no berth receiver greeting from %s within %v: %w (a receiver that requires TLS waits for a TLS handshake)",
			ErrProtocol, conn.RemoteAddr(), HandshakeTimeout, err)
	case line == Greeting:
		return Greeted{conn}, nil
	case line == busyLine:
		return Greeted{}, fmt.Errorf("%w: %s has all its transfer slots in use; try again later", ErrBusy, conn.RemoteAddr())
	case strings.HasPrefix(line, refusedPrefix):
		return Greeted{}, fmt.Errorf("%w: %s: %s", ErrRefused, conn.RemoteAddr(), strings.TrimSuffix(line[len(refusedPrefix):], "\n"))
	case strings.HasPrefix(line, "berth-transfer/"):
		return Greeted{}, fmt.Errorf("%w: %s is a berth receiver of another protocol version (it sent %s, want %q)", ErrProtocol, conn.RemoteAddr(), quote.Value(line), Greeting)
	default:
		return Greeted{}, fmt.Errorf("%w: %s is not a berth receiver (it sent %s)", ErrProtocol, conn.RemoteAddr(), quote.Value(line))
	}
}

// readGreeting reads the receiver's first line, "\n" included, one byte at a time (nothing after
// it is consumed) and at most maxGreetingBytes. On error it returns what it read so far.
func readGreeting(conn net.Conn) (string, error) {
	var buf bytes.Buffer
	b := make([]byte, 1)
	for buf.Len() < maxGreetingBytes {
		n, err := conn.Read(b)
		if n == 1 {
			buf.WriteByte(b[0])
			if b[0] == '\n' {
				return buf.String(), nil
			}
			continue
		}
		if err != nil {
			return buf.String(), err
		}
	}
	return buf.String(), fmt.Errorf("line longer than %d bytes", maxGreetingBytes)
}

// isRemoteTLSAlert reports whether err is a TLS alert sent by the peer (crypto/tls reports it
// as a *net.OpError with Op "remote error"): with TLS 1.3 a server's refusal of the client's
// certificate reaches the client on its first read, after its own handshake completed.
func isRemoteTLSAlert(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "remote error"
}

// writeLine writes one greeting-position line (busy, refused) to conn, bounded by timeout.
func writeLine(conn net.Conn, line string, timeout time.Duration) error {
	_ = conn.SetWriteDeadline(time.Now().Add(timeout))
	_, err := conn.Write([]byte(line))
	return err
}

// refusal returns the refused line for reason (one line, bounded).
func refusal(reason string) string {
	reason = strings.ReplaceAll(reason, "\n", " ")
	if max := maxGreetingBytes - len(refusedPrefix) - 1; len(reason) > max {
		reason = reason[:max]
	}
	return refusedPrefix + reason + "\n"
}
