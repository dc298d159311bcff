package checkpoint

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// PageStream describes the memory pages of a checkpoint moved in copy mode: CRIU on the source
// sent them (page server protocol) straight to the destination, where CRIU's page server wrote
// them as the page images (pagemap-*.img, pages-*.img) of the CRIU image directory. The source
// never holds them on disk, so it cannot digest the files; it digests the stream instead, as
// its relay forwards it, and signs that digest with the rest of the manifest. The destination's
// receiver digests the same stream as it arrives, compares the two before it keeps the
// checkpoint, and records the page images it kept in its stamp (WriteStamp): a restore accepts
// page images only through a stamp that matches them (VerifyHeld); without one it refuses them
// (ErrPagesUnverified), since nothing can digest them against the signature afterwards.
type PageStream struct {
	// Digest is "<algorithm>:<64 lowercase hex>" of every byte CRIU sent to the page server, in
	// order: "blake3:" (PageDigestDefault) from this berth's relays, "sha256:" from older ones;
	// a manifest naming any other algorithm is refused (PageDigestAlgorithm).
	Digest string `json:"digest"`
	// Size is the stream's length in bytes.
	Size int64 `json:"size"`
	// ID is the page stream's ID (32 lowercase hex digits, NewStreamID) that its sender
	// announced to the receiver: the receiver adopts for this checkpoint only the stream of that
	// ID, so a peer that opens a page stream under the checkpoint's name first neither takes the
	// name nor is taken for the move's. "" from senders before it (the stream is then matched by
	// name alone).
	ID string `json:"id,omitempty"`
}

// NewStreamID returns a random page stream ID: 128 bits as 32 lowercase hex digits.
func NewStreamID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand never fails
	return hex.EncodeToString(b[:])
}

// ValidStreamID reports whether id is a stream ID NewStreamID could have made ("" is not).
func ValidStreamID(id string) bool { return lowerHex(id, 32) }

// PageServerRequestFile, in the CRIU work directory of a checkpoint request to berth's shim, asks
// for a dump in copy mode: it holds "ADDR:PORT" of the page server CRIU sends the memory pages to
// instead of writing page images into the image directory. containerd's Checkpoint request
// carries runc's options, which have no page-server field; the work directory is the caller's,
// on the shim's node, and only root writes there (berthctl makes it 0700). The address must be
// loopback: CRIU's page client speaks in the clear, so it reaches the node's own relay
// (transfer.PageRelay), which carries the stream over mutual TLS and digests it. The caller
// removes the file before it digests the checkpoint.
const PageServerRequestFile = "berth-page-server"

// ErrPagesUnverified: a copy-mode checkpoint holds page images that no receiver's stamp records
// as received from its signed page stream.
var ErrPagesUnverified = errors.New("page image not verified by a receiver against the signed page stream")

// IsPageImage reports whether p (slash-separated, relative to the directory of the manifest
// that records the checkpoint's PageStream) is a page image CRIU's page server writes:
// ImagesDir/pagemap-*.img or ImagesDir/pages-*.img for berth's own layout (berth.json beside
// ImagesDir), or pagemap-*.img, pages-*.img for a CRI checkpoint's (the shim's berth.json inside
// ImagesDir, the CRIU image directory itself).
func IsPageImage(p string) bool {
	dir, base := path.Split(p)
	if (dir != "" && dir != ImagesDir+"/") || !strings.HasSuffix(base, ".img") {
		return false
	}
	return strings.HasPrefix(base, "pagemap-") || strings.HasPrefix(base, "pages-")
}

// PageImages lists the page images (IsPageImage) in dir's CRIU image directory ImagesDir and,
// for a CRI checkpoint's image directory, in dir itself (slash-separated paths, relative to dir),
// sorted.
func PageImages(dir string) ([]string, error) {
	var out []string
	for _, sub := range []string{"", ImagesDir} {
		ents, err := os.ReadDir(filepath.Join(dir, sub))
		if err != nil {
			if sub != "" && errors.Is(err, fs.ErrNotExist) {
				continue // a CRI checkpoint's image directory: no ImagesDir inside
			}
			return nil, err
		}
		for _, e := range ents {
			p := path.Join(sub, e.Name())
			if e.Type().IsRegular() && IsPageImage(p) {
				out = append(out, p)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

// pageStampFiles returns the stamp entries of dir's page images.
func pageStampFiles(dir string) ([]stampFile, error) {
	pages, err := PageImages(dir)
	if err != nil {
		return nil, err
	}
	out := make([]stampFile, 0, len(pages))
	for _, p := range pages {
		fi, err := os.Lstat(filepath.Join(dir, filepath.FromSlash(p)))
		if err != nil {
			return nil, err
		}
		sys, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || !fi.Mode().IsRegular() {
			return nil, fmt.Errorf("%s: not a regular file", p)
		}
		out = append(out, stampFile{Path: p, Size: fi.Size(), Ino: sys.Ino, CtimeNs: sys.Ctim.Nano()})
	}
	return out, nil
}

// stampedPages returns the page images a stamp records (those that are not m's files).
func stampedPages(st stamp, m *Manifest) map[string]bool {
	if m.PageStream == nil {
		return nil
	}
	listed := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		listed[f.Path] = true
	}
	pages := map[string]bool{}
	for _, f := range st.Files {
		if !listed[f.Path] && IsPageImage(f.Path) {
			pages[f.Path] = true
		}
	}
	return pages
}

// LazyPagesRequestFile, in the CRIU work directory of a checkpoint request to berth's shim, asks
// for a lazy (post-copy) dump: it holds "ADDR:PORT", a loopback address where CRIU's lazy page
// server is to listen once the non-memory images are written. The shim's Checkpoint request
// returns at that moment, with the checkpoint (less its memory) written and signed, while the
// task stays frozen and CRIU serves its pages until the destination has them all (or the stream
// fails, and the task is left as it was). Like PageServerRequestFile it is the caller's, in a
// directory only root writes, and the caller removes it before it digests the checkpoint.
const LazyPagesRequestFile = "berth-lazy-pages"

// LazyPagesDir is the directory beside checkpoint directory dir (in the same checkpoint root)
// where a destination's `criu lazy-pages` daemon for that checkpoint keeps its socket
// (lazy-pages.socket) and log while it serves the memory of a task restored from it in lazy
// mode; berth's shim points CRIU's restore there (its work-dir). It exists only while the
// daemon runs.
func LazyPagesDir(dir string) string {
	dir = filepath.Clean(dir)
	return filepath.Join(filepath.Dir(dir), ".lazy-"+filepath.Base(dir))
}

// The TLS identity of CRIU's lazy page server for one lazy dump, in LazyTLSDir: the PEM files
// CRIU's --tls-cacert, --tls-cert and --tls-key name. CRIU then speaks TLS on that server and
// requires of its client a certificate issued by that CA for 127.0.0.1, so that only the relay
// that holds the client's key (in memory, never on disk) is served the frozen task's pages.
const (
	LazyTLSCA   = "ca.pem"
	LazyTLSCert = "server.pem"
	LazyTLSKey  = "server-key.pem"
)

// LazyTLS is what LazyTLSDir holds: PEM bytes of the one-dump CA's certificate, and of the lazy
// page server's certificate and private key (PKCS#8).
type LazyTLS struct {
	CA, Cert, Key []byte
}

// LazyTLSDir is the directory beside checkpoint directory dir (the CRIU work directory of a lazy
// dump on the source) that holds the TLS identity of CRIU's lazy page server (LazyTLSCA,
// LazyTLSCert, LazyTLSKey). It is outside dir, which is digested and sent. CRIU reads the files
// when its client connects; the caller removes the directory once its relay connected, and
// berth's shim when the dump ended (a caller that died between writing it and the checkpoint
// request leaves it: root's alone, for a CA nobody holds the key of). Its caller writes it
// (WriteLazyTLS) beside LazyPagesRequestFile; berth's shim refuses a lazy dump without it.
func LazyTLSDir(dir string) string {
	dir = filepath.Clean(dir)
	return filepath.Join(filepath.Dir(dir), ".lazytls-"+filepath.Base(dir))
}

// WriteLazyTLS creates LazyTLSDir(dir) (mode 0700; it must not exist) and writes t's three files
// into it (mode 0600). Errors: os.Mkdir's (fs.ErrExist for a directory left there) and
// os.WriteFile's; on an error nothing is left behind.
func WriteLazyTLS(dir string, t LazyTLS) (retErr error) {
	d := LazyTLSDir(dir)
	if err := os.Mkdir(d, 0o700); err != nil {
		return fmt.Errorf("lazy page server TLS: %w", err)
	}
	defer func() {
		if retErr != nil {
			os.RemoveAll(d)
		}
	}()
	for name, b := range map[string][]byte{LazyTLSCA: t.CA, LazyTLSCert: t.Cert, LazyTLSKey: t.Key} {
		if err := os.WriteFile(filepath.Join(d, name), b, 0o600); err != nil {
			return fmt.Errorf("lazy page server TLS: %w", err)
		}
	}
	return nil
}
