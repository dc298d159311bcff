package move

import (
	"context"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// PageRelay is the source's end of a copy-mode page stream (transfer.PageRelay): CRIU sends the
// memory pages to Addr, a loopback address; the relay forwards them to the destination's page
// server and digests them. Wait returns the digest and length once the dump ended the stream and
// the destination's page server exited; Close abandons it (a failed move: the destination
// removes the pages it got).
type PageRelay interface {
	Addr() string
	Wait(ctx context.Context) (checkpoint.PageStream, error)
	Close()
}

// LazyRelay is the source's end of a lazy (post-copy) page stream (transfer.LazyRelay): CRIU's
// lazy page server listens on Addr, a loopback address, once the checkpoint (less its memory)
// is written. Start connects to it and returns once the destination's lazy-pages daemon for the
// checkpoint runs (the restore may begin); Wait returns nil once the daemon has every page, or
// the stream's failure; Close abandons it (CRIU then lets the frozen task go, the destination's
// daemon stops). ID is the stream's ID, which the signed manifest records
// (checkpoint.Manifest.LazyStream) and the destination requires of the stream. Bytes is what
// CRIU's lazy page server sent through the relay, in bytes (the pages and CRIU's page-server
// headers), once Wait returned nil; 0 before. ServerTLS is the TLS identity CRIU's lazy page
// server is to show (CheckpointOptions.LazyTLS); Start requires it, and serves no other server.
type LazyRelay interface {
	Addr() string
	ID() string
	ServerTLS() checkpoint.LazyTLS
	Start(ctx context.Context) error
	Wait(ctx context.Context) error
	Bytes() int64
	Close()
}
