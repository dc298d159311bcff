package checkpoint

import (
	"errors"
	"time"
)

// Armed page streams: copy mode for a checkpoint whose request berth does not write itself (the
// kubelet checkpoint API's: the kubelet, then containerd's CRI plugin, call the shim, and the
// request carries no page server). The node's agent (`berthctl send-pages`, which `kubectl berth
// move` runs there) arms a page stream for one container before the kubelet is asked: it listens
// on a unix socket in the node's DefaultPageStreamDir and writes a PageStreamRequest there as
// <container id>.json. The shim, on that container's Checkpoint request, claims the request
// (renames it away, so that one checkpoint takes it), points CRIU's page server at a relay of its
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
	// Container is the containerd id of the container whose next checkpoint streams its pages
	// (the file's name without PageStreamRequestSuffix, repeated so a renamed file cannot
	// redirect another container's memory).
	Container string `json:"container"`
	// Name is the checkpoint's name at the destination (transfer.ValidName), for the logs.
	Name string `json:"name"`
	// Socket is the base name of the agent's unix socket in the same directory, where the
	// shim's relay sends the framed page stream and reads the page server's answers back.
	Socket string `json:"socket"`
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
}

// ErrBadPageStreamRequest: an armed page stream request is not one this shim can serve (not
// JSON, another container's, a socket outside its directory).
var ErrBadPageStreamRequest = errors.New("bad armed page stream request")
