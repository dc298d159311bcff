package checkpoint

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"strings"

	"github.com/zeebo/blake3"
)

// Page stream digest algorithms (PageStream.Digest is "<algorithm>:<64 lowercase hex>"). A copy-mode
// page stream is digested twice per byte on the critical path of a move (by the source's relay,
// which signs it, and by the receiver, which must match it before it keeps the pages), so it may
// use a faster hash than the files' SHA-256: BLAKE3 (github.com/zeebo/blake3, 256-bit output),
// measured here at 2.5-3.8 GB/s against SHA-256's 1.1-1.6 GB/s (BENCHMARKS.md). Every other
// digest in a manifest stays SHA-256 (DigestAlgorithm).
const (
	// PageDigestSHA256 is SHA-256, what every page stream used before the algorithm was named
	// (a relay's header without pageDigest, an armed request without digest).
	PageDigestSHA256 = "sha256"
	// PageDigestBLAKE3 is BLAKE3 with its default 32-byte output.
	PageDigestBLAKE3 = "blake3"
	// PageDigestDefault is the algorithm berth's relays digest new page streams with.
	PageDigestDefault = PageDigestBLAKE3
)

// PageDigestAlgorithms lists the page stream digest algorithms this berth verifies, in the
// order an error message names them.
var PageDigestAlgorithms = []string{PageDigestSHA256, PageDigestBLAKE3}

// ErrPageDigestAlgorithm: a page stream's digest algorithm (announced by its sender, or recorded
// in a manifest's pageStream) is not one this berth verifies (PageDigestAlgorithms).
var ErrPageDigestAlgorithm = errors.New("page stream digest algorithm not known")

// NewPageDigest returns a new hash for page stream digest algorithm alg ("" is PageDigestSHA256,
// what senders that named no algorithm used). Errors: ErrPageDigestAlgorithm (wrapped, naming alg
// and the known ones) for any other name.
func NewPageDigest(alg string) (hash.Hash, error) {
	switch alg {
	case PageDigestSHA256, "":
		return sha256.New(), nil
	case PageDigestBLAKE3:
		return blake3.New(), nil
	}
	return nil, fmt.Errorf("%w: %q (this berth verifies %s; upgrade it to one that knows %q, or move in stored mode)",
		ErrPageDigestAlgorithm, alg, strings.Join(PageDigestAlgorithms, ", "), alg)
}

// PageDigest returns the PageStream.Digest of h, a hash NewPageDigest made for alg: "<alg>:" and
// the lowercase hex of h's sum ("sha256:" when alg is "").
func PageDigest(alg string, h hash.Hash) string {
	if alg == "" {
		alg = PageDigestSHA256
	}
	return alg + ":" + hex.EncodeToString(h.Sum(nil))
}

// PageDigestAlgorithm returns the algorithm d (a PageStream.Digest) names, once d is a known
// algorithm, ":" and 64 lowercase hex digits. Errors: ErrPageDigestAlgorithm for an algorithm
// this berth does not know; ErrInvalidManifest for any other shape.
func PageDigestAlgorithm(d string) (string, error) {
	alg, hexPart, ok := strings.Cut(d, ":")
	if !ok || alg == "" {
		return "", fmt.Errorf("%w: pageStream digest %q is not <algorithm>:<hex>", ErrInvalidManifest, d)
	}
	if _, err := NewPageDigest(alg); err != nil {
		return "", fmt.Errorf("pageStream digest %q: %w", d, err)
	}
	if !lowerHex(hexPart, 64) {
		return "", fmt.Errorf("%w: pageStream digest %q is not %s:<64 lowercase hex>", ErrInvalidManifest, d, alg)
	}
	return alg, nil
}

// lowerHex reports whether s is n lowercase hex digits.
func lowerHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
