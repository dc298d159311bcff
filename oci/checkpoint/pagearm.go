package checkpoint

import (
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"time"
)

// Armed page streams: copy mode for a checkpoint whose request berth does not write itself (the
// kubelet checkpoint API's: the kubelet, then containerd's CRI plugin, call the shim, and the
// request carries no page server). The node's agent (`berthctl send-pages`, which `kubectl berth
// move` runs there) arms a page stream for one container before the kubelet is asked: it listens
// on a unix socket in the node's DefaultPageStreamDir and writes a PageStreamRequest there as
// <container id>.json. The shim, on that container's Checkpoint request, if the request carries
// the deadline the armed one names (PageStreamRequest.Takes: the mover's own checkpoint call),
// claims the request (renames it away, so that one checkpoint takes it), points CRIU's page server at a relay of its
// own on 127.0.0.1, digests the stream as it forwards it to the agent's socket (in the page
// stream's frames: transfer's), and signs the digest and length as the manifest's PageStream.
// The agent carries the frames to the destination's receiver over mutual TLS; it neither sees
// the digest before it is signed nor holds a key.

// DefaultPageStreamDir is the node directory of armed page streams: the shim's
// page_stream_dir, and what berth-agent-daemonset.yaml mounts into the agent. Only root writes
// there (berthctl send-pages creates it 0700; the shim reads only regular files and dials only
// sockets there, never through a symbolic link).
const DefaultPageStreamDir = "/run/berth/page-streams"

// PageStreamRequestSuffix ends an armed request's file name: <container id> + this.
const PageStreamRequestSuffix = ".json"

// PageStreamRequest is an armed page stream, as JSON in DefaultPageStreamDir.
type PageStreamRequest struct {
	// Container is the containerd id of the container whose checkpoint call (the one this
	// request is bound to: Armed, CheckpointTimeout) streams its pages (the file's name without
	// PageStreamRequestSuffix, repeated so a renamed file cannot redirect another container's
	// memory).
	Container string `json:"container"`
	// Name is the checkpoint's name at the destination (transfer.ValidName), for the logs.
	Name string `json:"name"`
	// Socket is the base name of the agent's unix socket in the same directory, where the
	// shim's relay sends the framed page stream and reads the page server's answers back.
	Socket string `json:"socket"`
	// Armed is when the agent armed it, before it said so: the checkpoint call that is to take it
	// was made after.
	Armed time.Time `json:"armed"`
	// CheckpointTimeout is the timeout, in whole seconds, of the one checkpoint call that is to
	// take this stream: the mover asks the kubelet checkpoint API with ?timeout= this (or CRI
	// CheckpointContainer with this deadline: crictl --timeout), and the kubelet, containerd's CRI
	// plugin and ttrpc carry that deadline to the shim's Checkpoint request; the location, options
	// and annotations the kubelet chooses never reach the shim. The mover picks it at random
	// (NewCheckpointTimeout), so that another party's checkpoint of the container while it is
	// armed (another timeout, the kubelet's default, or none: ctr, nerdctl) is taken as if
	// nothing were armed (Takes). It must exceed the kubelet's runtimeRequestTimeout (2 min by
	// default), which the kubelet uses instead of a shorter one.
	CheckpointTimeout int64 `json:"checkpointTimeout"`
	// Expires is when the request lapses: a checkpoint after it is taken as if none were armed
	// (stored: page images in the checkpoint), and the agent removes the file.
	Expires time.Time `json:"expires"`
	// Digest is the algorithm the shim digests the stream with (PageDigestAlgorithms), the one
	// the agent announced to the receiver; "" is PageDigestSHA256 (agents before it). The shim
	// refuses a request naming one it does not know (ErrBadPageStreamRequest). A shim older than
	// this field ignores it and signs a SHA-256 digest; the receiver then refuses the checkpoint,
	// whose manifest records another algorithm than the one announced, and the move fails with
	// the source running.
	Digest string `json:"digest,omitempty"`
	// StreamID is the ID the agent announced the stream under (NewStreamID); the shim signs it
	// as the checkpoint's PageStream.ID, so that the receiver adopts this stream only for this
	// checkpoint. "" from agents before it; one that is not 32 lowercase hex digits is refused
	// (ErrBadPageStreamRequest).
	StreamID string `json:"streamId,omitempty"`
}

// deadlineSlack is how much later than the call's start plus CheckpointTimeout a checkpoint
// request's deadline may be on arrival at the shim: gRPC sends a deadline over a day away in
// whole seconds, rounded up, and each hop (kubelet, containerd, ttrpc) re-bases it on its own
// receipt.
const deadlineSlack = 5 * time.Second

// Takes reports whether a Checkpoint request that arrived at now with the deadline deadline (ok:
// it has one) is the checkpoint call this request was armed for: one made between Armed and now
// with CheckpointTimeout as its timeout, that is deadline - CheckpointTimeout within [Armed - 1
// s, now + deadlineSlack]. The clocks are one node's (the agent's, the kubelet's and the shim's).
func (r PageStreamRequest) Takes(deadline time.Time, ok bool, now time.Time) bool {
	if !ok || r.CheckpointTimeout <= 0 {
		return false
	}
	start := deadline.Add(-time.Duration(r.CheckpointTimeout) * time.Second)
	return !start.Before(r.Armed.Add(-time.Second)) && !start.After(now.Add(deadlineSlack))
}

// Checkpoint timeouts that NewCheckpointTimeout picks from: [MinCheckpointTimeout,
// MinCheckpointTimeout + checkpointTimeoutSpan) seconds, a day to about 13 days. Only the
// shim's match needs such a timeout; the checkpoint takes seconds, and the kubelet's call ends
// with the mover's request anyway.
const (
	MinCheckpointTimeout  = 24 * 60 * 60
	checkpointTimeoutSpan = 1 << 20
)

// NewCheckpointTimeout returns a random CheckpointTimeout in seconds (about 20 bits: another
// party guessing it must also call within the armed window, seconds wide). Errors: the system's
// random source.
func NewCheckpointTimeout() (int64, error) {
	n, err := rand.Int(rand.Reader, big.NewInt(checkpointTimeoutSpan))
	if err != nil {
		return 0, fmt.Errorf("checkpoint timeout: %w", err)
	}
	return MinCheckpointTimeout + n.Int64(), nil
}

// ErrBadPageStreamRequest: an armed page stream request is not one this shim can serve (not
// JSON, another container's, a socket outside its directory).
var ErrBadPageStreamRequest = errors.New("bad armed page stream request")
