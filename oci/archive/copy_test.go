package archive

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"
)

// recordReader returns at most 16 KiB per Read, as a TLS connection returns one record.
type recordReader struct{ r io.Reader }

func (t recordReader) Read(p []byte) (int, error) { return t.r.Read(p[:min(len(p), 16<<10)]) }

// writeLog records its writes; it fails the write numbered failAt (from 1), if set.
type writeLog struct {
	bytes.Buffer
	writes, failAt int
}

var errDiskFull = errors.New("no space left on device")

func (w *writeLog) Write(p []byte) (int, error) {
	w.writes++
	if w.writes == w.failAt {
		return 0, errDiskFull
	}
	return w.Buffer.Write(p)
}

// TestCopyFull: the bytes arrive whole and in order, in writes of full buffers (not one per
// 16 KiB read); a short stream is no error (the caller compares the count); a write error stops
// the copy and is returned; a read error is returned.
func TestCopyFull(t *testing.T) {
	const bufSize = 64 << 10
	data := make([]byte, 5*bufSize+123)
	for i := range data {
		data[i] = byte(i * 7)
	}
	bufs := func() []byte { return make([]byte, bufSize) }
	for _, size := range []int{0, 100, bufSize, bufSize + 1, len(data)} {
		var w writeLog
		n, err := copyFull(&w, recordReader{bytes.NewReader(data[:size])}, int64(size), bufs())
		if err != nil || n != int64(size) || !bytes.Equal(w.Bytes(), data[:size]) {
			t.Errorf("size %d: %d bytes, %v; or the content differs", size, n, err)
		}
		if most := max(1, (size+bufSize-1)/bufSize); w.writes > most {
			t.Errorf("size %d: %d writes, want at most %d", size, w.writes, most)
		}
	}

	var w writeLog
	n, err := copyFull(&w, bytes.NewReader(data[:3*bufSize]), int64(len(data)), bufs())
	if err != nil || n != 3*bufSize {
		t.Errorf("short stream: %d bytes, %v; want %d, no error", n, err, 3*bufSize)
	}

	w = writeLog{failAt: 2}
	r := bytes.NewReader(data)
	n, err = copyFull(&w, r, int64(len(data)), bufs())
	if !errors.Is(err, errDiskFull) || n != bufSize {
		t.Errorf("failing writer: %d bytes, %v; want %d, %v", n, err, bufSize, errDiskFull)
	}
	if r.Len() == 0 {
		t.Error("failing writer: the whole stream was read anyway")
	}

	errConn := errors.New("connection reset")
	w = writeLog{}
	n, err = copyFull(&w, io.MultiReader(bytes.NewReader(data[:bufSize+10]), iotest.ErrReader(errConn)), int64(len(data)), bufs())
	if !errors.Is(err, errConn) || n != bufSize+10 {
		t.Errorf("read error: %d bytes, %v; want %d, %v", n, err, bufSize+10, errConn)
	}
}
