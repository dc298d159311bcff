package shim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// tailDigester hashes the files of a CRIU image directory while CRIU writes them, so the
// manifest's digests are ready moments after the dump instead of after a second full read. CRIU
// writes image files front to back and does not rewrite what it wrote. A file that shrinks, is
// replaced, or cannot be read is left out of the result and read in full afterwards
// (checkpoint.DigestDirKnown). Were bytes ever rewritten in place after being hashed, the recorded
// digest would not match and every restore would refuse the checkpoint: a loud failure, never a
// silent corruption.
type tailDigester struct {
	dir  string
	stop chan struct{}
	done chan struct{}

	files map[string]*tailFile // only the goroutine uses it until done is closed; then finish
}

type tailFile struct {
	h   hash.Hash
	off int64
	ino uint64
	bad bool
}

const tailPoll = 20 * time.Millisecond

func startTailDigester(ctx context.Context, dir string) *tailDigester {
	t := &tailDigester{dir: dir, stop: make(chan struct{}), done: make(chan struct{}), files: map[string]*tailFile{}}
	go func() {
		defer close(t.done)
		buf := make([]byte, 1<<20)
		for {
			t.pass(buf)
			select {
			case <-t.stop:
				return
			case <-ctx.Done():
				return
			case <-time.After(tailPoll):
			}
		}
	}()
	return t
}

// finish stops following, hashes what was appended since the last pass, and returns the digests
// (path relative to dir -> File) of every file it followed to the end.
func (t *tailDigester) finish() map[string]checkpoint.File {
	close(t.stop)
	<-t.done
	buf := make([]byte, 1<<20)
	t.pass(buf)
	out := map[string]checkpoint.File{}
	for p, f := range t.files {
		if !f.bad {
			out[p] = checkpoint.File{Path: p, Size: f.off, Digest: checkpoint.DigestAlgorithm + hex.EncodeToString(f.h.Sum(nil))}
		}
	}
	return out
}

// pass reads what was appended to every regular file under dir since the last pass.
func (t *tailDigester) pass(buf []byte) {
	_ = filepath.WalkDir(t.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(t.dir, p)
		if err != nil || rel == checkpoint.ManifestFile {
			return nil
		}
		rel = filepath.ToSlash(rel)
		f := t.files[rel]
		if f == nil {
			f = &tailFile{h: sha256.New()}
			t.files[rel] = f
		}
		if !f.bad {
			t.follow(p, f, buf)
		}
		return nil
	})
}

func (t *tailDigester) follow(path string, f *tailFile, buf []byte) {
	fh, err := os.Open(path)
	if err != nil {
		f.bad = true
		return
	}
	defer fh.Close()
	fi, err := fh.Stat()
	if err != nil {
		f.bad = true
		return
	}
	ino := inode(fi)
	if (f.ino != 0 && ino != f.ino) || fi.Size() < f.off {
		f.bad = true // replaced or truncated: let DigestDirKnown read it in full
		return
	}
	f.ino = ino
	if fi.Size() == f.off {
		return
	}
	n, err := io.CopyBuffer(f.h, io.NewSectionReader(fh, f.off, fi.Size()-f.off), buf)
	f.off += n
	if err != nil {
		f.bad = true
	}
}
