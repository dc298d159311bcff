package transfer

import (
	"errors"
	"fmt"
	"io"
)

// Free space for copy-mode page streams (pages.go). A page stream's length is known only once
// CRIU ended it, so the receiver counts its bytes as they arrive: every spaceCheckBytes it asks
// the file system again (Receiver.FreeBytes) and ends the stream with ErrNoSpace when the next
// spaceCheckBytes, what the other transfers have yet to write and the margin
// (Receiver.ReserveBytes) would not fit; otherwise it reserves those spaceCheckBytes (the other
// transfers count them as still to come). A sender may also state the stream's length up front
// (header.PageBytes): a stated length that does not fit is refused before the page server
// starts, the other transfers count it as still to come, and a stream longer than stated is
// ended. Ended, the page server exits and its staging directory is removed (receivePages).

// spaceCheckBytes is how many bytes of a page stream the receiver writes between two free-space
// checks: each check requires room for that much beyond the margin, so the margin holds until
// the next one.
const spaceCheckBytes = 64 << 20

// pagesFlightKey is the page stream of checkpoint name in Receiver.inFlight: it starts with a
// dot, which no checkpoint name does (ValidName).
func pagesFlightKey(name string) string { return ".pages-" + name }

// pageSpace is a page stream's share of the free-space accounting.
type pageSpace struct {
	r      *Receiver
	root   string
	f      *inFlight
	stated int64 // header.PageBytes; 0: not stated
	next   int64 // the written count at which to check again
}

// claimPages registers checkpoint name's page stream, with stated bytes (0: unknown), for
// the free-space accounting of root. Errors: claim's (ErrNoSpace when stated does not fit).
// Release it with r.release(pagesFlightKey(name)).
func (r *Receiver) claimPages(name string, stated int64, root string) (*pageSpace, error) {
	if stated < 0 {
		return nil, fmt.Errorf("%w: page stream of %d bytes stated", ErrProtocol, stated)
	}
	f, err := r.claim(pagesFlightKey(name), stated, root)
	if err != nil {
		return nil, err
	}
	return &pageSpace{r: r, root: root, f: f, stated: stated}, nil
}

// writer returns w, counting the bytes written to it and failing (ErrNoSpace) before a write
// that would go past the stated length or into the margin.
func (s *pageSpace) writer(w io.Writer) io.Writer { return &spaceWriter{s: s, w: w} }

type spaceWriter struct {
	s *pageSpace
	w io.Writer
}

func (sw *spaceWriter) Write(p []byte) (int, error) {
	if err := sw.s.reserve(int64(len(p))); err != nil {
		return 0, err
	}
	n, err := sw.w.Write(p)
	sw.s.f.written.Add(int64(n))
	return n, err
}

// reserve checks that n more bytes may be written.
func (s *pageSpace) reserve(n int64) error {
	written := s.f.written.Load()
	if s.stated > 0 && written+n > s.stated {
		return fmt.Errorf("%w: the page stream goes past the %d bytes its sender stated", ErrNoSpace, s.stated)
	}
	if written+n <= s.next {
		return nil
	}
	room := max(n, spaceCheckBytes)
	if err := s.r.roomFor(s.f, room, s.root); err != nil {
		return fmt.Errorf("page stream after %d bytes: %w", written, err)
	}
	s.next = written + room
	return nil
}

// roomFor fails with ErrNoSpace when n bytes, what the transfers in progress but self have yet
// to write and the margin exceed the free space of root's file system. Otherwise it reserves
// them: self's announced bytes grow to cover n more, so that the other transfers count them as
// still to come.
func (r *Receiver) roomFor(self *inFlight, n int64, root string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	grow := func() {
		if w := self.written.Load(); self.announced < w+n {
			self.announced = w + n
		}
	}
	free := r.FreeBytes
	if free == nil {
		free = statfsFree
	}
	avail, err := free(root)
	if errors.Is(err, errors.ErrUnsupported) {
		grow()
		return nil
	}
	if err != nil {
		return fmt.Errorf("free space of %s: %w", root, err)
	}
	margin := r.ReserveBytes
	if margin == 0 {
		margin = DefaultReserveBytes
	}
	margin = max(margin, 0)
	var pending int64
	for _, f := range r.inFlight {
		if f != self {
			pending += max(f.announced-f.written.Load(), 0)
		}
	}
	if need := uint64(n) + uint64(pending) + uint64(margin); need > avail {
		return fmt.Errorf("%w: %d bytes free on the file system of %s, margin %d bytes, %d bytes still to come for other transfers: no room for %d more",
			ErrNoSpace, avail, root, margin, pending, n)
	}
	grow()
	return nil
}
