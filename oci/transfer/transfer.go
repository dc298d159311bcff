// Package transfer moves a berth checkpoint directory, or a CRI checkpoint archive as the kubelet
// wrote it (SendCRIArchive, LayoutCRI), from one node to another over a net.Conn: Send on the
// source node, Receiver on the destination.
//
// Protocol (version Magic, "berth-transfer/2"), one connection per checkpoint. The receiver
// speaks first:
//
//  1. receiver → sender: the greeting line Greeting, "berth-transfer/2 ready\n", as soon as it
//     accepts the connection. The sender (Handshake) waits for it, at most HandshakeTimeout,
//     before it sends anything; berthctl migrate waits for it before it pauses the source, so a
//     peer that is not a berth receiver of this version (another service on the port, a stalled
//     process, a receiver of another version) costs nothing.
//  2. sender → receiver: one header line, JSON then "\n":
//     {"magic":"berth-transfer/2","name":"<name>","totalBytes":<n>,"manifest":"<base64 of berth.json>"}
//     totalBytes is the exact length of the tar stream that follows, in bytes; manifest is the
//     checkpoint's berth.json, byte for byte. With "layout":"cri" (LayoutCRI, SendCRIArchive)
//     the stream is a CRI checkpoint archive as the node wrote it and manifest is its
//     checkpoint/berth.json, which covers the CRIU images.
//  3. sender → receiver: the checkpoint as a tar stream (oci/archive), exactly totalBytes long,
//     berth.json first (a CRI archive: in the order the node wrote it).
//  4. receiver → sender: one verdict line, {"ok":true,"path":"<path on the receiver>"} or
//     {"ok":false,"error":"<why>"}. A receiver that refuses early (bad header, existing name)
//     answers at once and stops reading; the sender watches for that while it streams.
//
// A connection may instead ask a question: a header with "preflight" (and a name, no stream) asks
// the receiver whether its node can restore a container; the verdict line carries the answer,
// {"ok":true,"preflight":{...}} (QueryPreflight, Receiver.Preflight). The question rides in
// version 2 without changing it: a version 2 receiver that predates it ignores the field, finds
// no manifest in the header and answers {"ok":false,...}, which the sender reads as "no answer"
// (ErrNoPreflight) and goes on without the receiver's checks.
//
// In version 1 the sender spoke first and the receiver never greeted. The version changed with
// the wire: a version 2 receiver refuses a version 1 header by its magic, and a version 2 sender
// refuses a receiver that sends no greeting, or another version's.
//
// The receiver only ever writes verified checkpoints: it extracts into a staging directory,
// checks the berth.json it received against the header's and every file against the manifest
// (checkpoint.Verify), calls the Verify hook (berthctl wires the node's trust policy there: the
// berth.sig beside berth.json must be a trusted key's signature of it), and only then renames
// the staging directory into place. It never restores anything.
//
// Between nodes the protocol runs over mutual TLS (TLS 1.3): both ends present a
// certificate of the cluster's CA (TLSFiles, ServerTLS, ClientTLS) and Listen and Dial refuse
// plain TCP except on loopback. Before greeting, a receiver may instead answer one line,
// "<magic> busy" (all slots in use: ErrBusy) or "<magic> refused: <why>" (ErrRefused).
//
// A connection whose header says "pages" carries a checkpoint's memory instead, beside its
// checkpoint's own connection: in copy mode CRIU's page stream to a `criu page-server` the
// receiver runs (pages.go), in lazy (post-copy) mode, with "lazy" too, the pages a
// `criu lazy-pages` daemon the receiver runs asks the source's CRIU for after the restore
// (lazy.go). On the source, the relay reaches CRIU's lazy page server over TLS with identities
// made for the one dump (lazytls.go), so that no other local process is served its pages.
//
// What belongs here: the wire protocol and the receiving side's file handling. What does not:
// the tar format (oci/archive), manifests and digests (oci/checkpoint), progress display (the CLI: Send only
// calls a callback), choosing peers or restoring.
package transfer

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/berth-dev/berth/oci/internal/quote"
)

// Magic identifies the protocol and its version, in the greeting and in the header line.
const Magic = "berth-transfer/2"

// MaxNameLen is the longest checkpoint name, in bytes. It leaves room, within a file system's
// 255-byte name limit, for the receiver's staging name (".incoming-<name>-<16 hex>").
const MaxNameLen = 200

var (
	// ErrRejected is returned by Send (wrapped, with the receiver's error text) when the
	// receiver answered {"ok":false}.
	ErrRejected = errors.New("checkpoint rejected by receiver")
	// ErrProtocol is returned (wrapped, with the reason) for a malformed header or verdict, a
	// wrong magic, a stream shorter or longer than announced, or a berth.json in the stream that
	// differs from the header's.
	ErrProtocol = errors.New("transfer protocol error")
	// ErrInvalidName is returned (wrapped, quoting the name) for a checkpoint name that is not a
	// single, plain path element; see ValidName.
	ErrInvalidName = errors.New("invalid checkpoint name")
	// ErrExists is returned by the receiver (wrapped, naming the path) when a checkpoint of that
	// name exists under its Root, or is being received on another connection.
	ErrExists = errors.New("checkpoint already exists")
)

// header is the protocol's first line.
type header struct {
	Magic string `json:"magic"`
	Name  string `json:"name"`
	// TotalBytes is the exact length of the tar stream, in bytes.
	TotalBytes int64 `json:"totalBytes"`
	// Manifest is berth.json's exact content (base64 in JSON).
	Manifest []byte `json:"manifest"`
	// Pages marks a connection that carries the page stream of checkpoint Name (copy mode,
	// pages.go) instead of the checkpoint.
	Pages bool `json:"pages,omitempty"`
	// PageBytes, with Pages (copy mode), is the page stream's length as its sender states it,
	// in bytes; 0: not stated. The receiver refuses a stated length that does not fit its free
	// space before the page server starts, and ends a stream that goes past it; it counts every
	// stream's bytes as they arrive either way (pagespace.go).
	PageBytes int64 `json:"pageBytes,omitempty"`
	// PageDigest, with Pages (copy mode), is the algorithm the sender digests the page stream
	// with and signs (checkpoint.PageDigestAlgorithms); "" is checkpoint.PageDigestSHA256, what
	// senders before it used. The receiver digests with the same one, and refuses a stream
	// whose algorithm it does not know before its page server starts.
	PageDigest string `json:"pageDigest,omitempty"`
	// Layout is "" for a berth checkpoint directory packed by oci/archive (Manifest is its
	// top-level berth.json), or LayoutCRI for a CRI checkpoint archive sent as it is (Manifest
	// is its checkpoint/berth.json).
	Layout string `json:"layout,omitempty"`
	// Lazy, with Pages, marks a lazy (post-copy) page stream (lazy.go): both ways, after the
	// restore.
	Lazy bool `json:"lazy,omitempty"`
	// StreamID, with Pages, is the page stream's ID (checkpoint.NewStreamID). With Lazy, the
	// lazy page stream's (LazyRelay.ID): the receiver serves a checkpoint only when its signed
	// manifest records the same (checkpoint.Manifest.LazyStream). In copy mode, the one the
	// checkpoint's signed manifest records as its PageStream.ID: the receiver keeps each stream
	// under its name and ID and adopts for a checkpoint only the stream of its ID. "" (senders
	// before it) matches a manifest without one.
	StreamID string `json:"streamId,omitempty"`
	// Preflight marks a connection that asks the receiver's node whether it can restore a
	// container (preflight.go) instead of sending a checkpoint: the query, opaque JSON.
	Preflight json.RawMessage `json:"preflight,omitempty"`
}

// verdict is the receiver's answer line.
type verdict struct {
	OK    bool   `json:"ok"`
	Path  string `json:"path,omitempty"`
	Error string `json:"error,omitempty"`
	// Preflight is the answer to a preflight query (opaque JSON); absent otherwise.
	Preflight json.RawMessage `json:"preflight,omitempty"`
}

// ValidName checks a checkpoint name: 1 to MaxNameLen bytes of [A-Za-z0-9._-], not starting with
// "." (so neither "." nor ".." nor a hidden or staging name), and without "..". Such a name is a
// single path element on every system.
//
// Errors: ErrInvalidName, wrapped with the quoted name and the rule it breaks.
func ValidName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty", ErrInvalidName)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w: %s is longer than %d bytes", ErrInvalidName, quote.Value(name), MaxNameLen)
	case name[0] == '.':
		return fmt.Errorf("%w: %s starts with \".\"", ErrInvalidName, quote.Value(name))
	case strings.Contains(name, ".."):
		return fmt.Errorf("%w: %s contains \"..\"", ErrInvalidName, quote.Value(name))
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w: %s contains %q (allowed: A-Z a-z 0-9 . _ -)", ErrInvalidName, quote.Value(name), c)
		}
	}
	return nil
}
