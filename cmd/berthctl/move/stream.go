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
