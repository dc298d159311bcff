// Package frame holds the framing of berth's page streams, shared by everything that writes one:
// oci/transfer's relays (berthctl migrate's copy and lazy modes) and the shim's armed page stream
// (a kubelet checkpoint in copy mode). A stream is a run of frames, each a 4-byte big-endian length
// and then that many bytes of CRIU's page-server stream; a frame of length 0 ends it, so that a cut
// link is never taken for the stream's end. Reading frames stays in oci/transfer, whose receiver
// classifies what it reads.
package frame

import (
	"encoding/binary"
	"hash"
	"io"
)

// MaxSize is the largest payload of one frame, in bytes (1 MiB); a reader refuses a larger length.
const MaxSize = 1 << 20

// Write copies r to w in frames of at most MaxSize bytes, writing every byte it forwards into h
// too, and ends the stream with an empty frame once r returns io.EOF. It returns how many bytes of
// r it forwarded (without the 4-byte headers), and r's or w's first error other than r's io.EOF;
// after an error no end frame is written, so the reader sees a cut stream.
func Write(w io.Writer, r io.Reader, h hash.Hash) (int64, error) {
	buf := make([]byte, 4+MaxSize)
	var n int64
	for {
		k, rerr := r.Read(buf[4:])
		if k > 0 {
			h.Write(buf[4 : 4+k])
			binary.BigEndian.PutUint32(buf[:4], uint32(k))
			if _, err := w.Write(buf[:4+k]); err != nil {
				return n, err
			}
			n += int64(k)
		}
		if rerr == io.EOF {
			binary.BigEndian.PutUint32(buf[:4], 0)
			_, err := w.Write(buf[:4])
			return n, err
		}
		if rerr != nil {
			return n, rerr
		}
	}
}
