package registry

import (
	"context"
	"crypto"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sync"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	orasreg "oras.land/oras-go/v2/registry"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/errcode"
	"oras.land/oras-go/v2/registry/remote/retry"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/internal/quote"
	"github.com/berth-dev/berth/oci/registry/reference"
)

// Media types and annotations of a checkpoint artifact (see the package documentation).
const (
	// ArtifactType is the OCI manifest's artifactType.
	ArtifactType = "application/vnd.berth.checkpoint.v1"
	// ConfigMediaType is the media type of the config blob, which is berth.json as written.
	ConfigMediaType = "application/vnd.berth.manifest.v1+json"
	// FileMediaType is the media type of each layer: one checkpoint file, raw.
	FileMediaType = "application/vnd.berth.checkpoint.file.v1"
	// SignatureMediaType is the media type of the last layer of a signed checkpoint: berth.sig,
	// the DSSE envelope that signs berth.json (package oci/signature).
	SignatureMediaType = "application/vnd.dsse.envelope.v1+json"

	// AnnotationContainerID is the checkpointed container's id on the source node.
	AnnotationContainerID = "dev.berth.checkpoint.container.id"
	// AnnotationContainerNamespace is its containerd namespace on the source node.
	AnnotationContainerNamespace = "dev.berth.checkpoint.container.namespace"
	// AnnotationImage is the image reference the container was created from.
	AnnotationImage = "dev.berth.checkpoint.image"
	// AnnotationImageDigest is the digest of that image's manifest.
	AnnotationImageDigest = "dev.berth.checkpoint.image.digest"
	// AnnotationFingerprintHash is fingerprint.Fingerprint.Hash of the source node: a restore
	// can be ruled out from the manifest alone when it differs from the destination's.
	AnnotationFingerprintHash = "dev.berth.checkpoint.fingerprint.hash"
)

// DefaultConcurrency is the number of blobs transferred at once when Options.Concurrency is 0.
const DefaultConcurrency = 4

// maxOCIManifestBytes bounds the OCI manifest Pull accepts, in bytes (oras-go's own default).
const maxOCIManifestBytes = 4 << 20

// maxSignatureBytes bounds the berth.sig layer, in bytes (oci/signature reads at most as much).
const maxSignatureBytes = 24 << 20

// Errors of this package (declared in package reference, which the shim imports without the
// registry client); they are returned wrapped, with the reference and registry.
var (
	// ErrNotCheckpoint: see reference.ErrNotCheckpoint.
	ErrNotCheckpoint = reference.ErrNotCheckpoint
	// ErrLayerMismatch: see reference.ErrLayerMismatch.
	ErrLayerMismatch = reference.ErrLayerMismatch
	// ErrNoTag: see reference.ErrNoTag.
	ErrNoTag = reference.ErrNoTag
	// ErrUnauthorized: see reference.ErrUnauthorized.
	ErrUnauthorized = reference.ErrUnauthorized
	// ErrCredentialsInReference: see reference.ErrCredentialsInReference.
	ErrCredentialsInReference = reference.ErrCredentialsInReference
)

// MaxReferenceBytes bounds a registry reference, in bytes (reference.MaxReferenceBytes).
const MaxReferenceBytes = reference.MaxReferenceBytes

// parseRef is reference.Parse.
func parseRef(ref string) (orasreg.Reference, error) { return reference.Parse(ref) }

// shortURL drops the query from the URL of a failed request (an upload URL carries a long state
// token that says nothing to a reader); other errors are returned as they are.
func shortURL(err error) error {
	ue, ok := err.(*url.Error)
	if !ok {
		return err
	}
	u, perr := url.Parse(ue.URL)
	if perr != nil || u.RawQuery == "" {
		return err
	}
	u.RawQuery = ""
	return &url.Error{Op: ue.Op, URL: u.String(), Err: ue.Err}
}

// classify adds this package's sentinels to oras-go's errors where they mean one of them.
func classify(err error) error {
	var resp *errcode.ErrorResponse
	if errors.Is(err, auth.ErrBasicCredentialNotFound) ||
		(errors.As(err, &resp) && resp.StatusCode == http.StatusUnauthorized) {
		return fmt.Errorf("%w: %w", ErrUnauthorized, err)
	}
	return err
}

// Descriptor describes a pushed checkpoint artifact: its OCI manifest's media type, digest and
// size in bytes, and ArtifactType.
type Descriptor = ocispec.Descriptor

// Progress is called with the bytes transferred so far and the total, both in bytes, of the
// blobs (config and files; not the small OCI manifest). Calls are serialized and done never
// decreases; blobs the registry already has count as done when found. On success the last call
// has done == total.
type Progress func(done, total int64)

// Options configure Push and Pull. The zero value talks HTTPS to the registry, anonymously.
type Options struct {
	// Username and Password are basic credentials for the registry (a token registry exchanges
	// them for a token). Used when Username is set; DockerConfig is then ignored.
	Username, Password string
	// DockerConfig is the path of a Docker config.json whose credentials (auths, credential
	// helpers) are used for the registry. Empty: anonymous unless Username is set.
	DockerConfig string
	// PlainHTTP talks HTTP instead of HTTPS: for a registry on loopback.
	PlainHTTP bool
	// InsecureSkipVerify accepts any TLS certificate from the registry. Off by default; never
	// use it across a network you do not control.
	InsecureSkipVerify bool
	// Concurrency is the number of blobs transferred at once; 0 means DefaultConcurrency.
	Concurrency int
	// Progress, if set, is told the bytes transferred (see Progress).
	Progress Progress
	// Limits bound what Pull accepts, checked against the OCI manifest before anything is
	// written: MaxEntries is the largest number of files, MaxFileBytes the largest file and
	// MaxTotalBytes the largest sum of file sizes, in bytes. Zero fields take archive's defaults.
	Limits archive.Limits
	// TempDir is where Push extracts a checkpoint archive before uploading it; empty means
	// os.TempDir(). Not used for directories.
	TempDir string

	// Verify, if set, is the trust check (signature.Policy.Verify, as berthctl wires it). Push
	// calls it on the checkpoint before anything is uploaded, so a node never vouches for a
	// checkpoint it would not restore; Pull calls it on the new checkpoint as soon as its
	// berth.json and berth.sig are written, before any other file is fetched. Its error refuses
	// the checkpoint (Pull removes everything it wrote).
	Verify func(ctx context.Context, dir string) error
	// SignCRI, if set, signs the top-level berth.json that Push writes for a CRI checkpoint
	// archive (signature.Policy.Sign), so that the berth.sig pushed with it covers the whole
	// archive. Without it such a checkpoint is pushed unsigned.
	SignCRI func(ctx context.Context, dir string) error
	// Signer, if set, signs the pushed artifact's OCI manifest in cosign's format once the tag is
	// written (CosignSignatureTag), for the ecosystem's verifiers.
	Signer crypto.Signer
}

func (o Options) concurrency() int {
	if o.Concurrency > 0 {
		return o.Concurrency
	}
	return DefaultConcurrency
}

// target is a parsed reference with its repository client.
type target struct {
	ref  orasreg.Reference
	repo *remote.Repository
}

// String names the reference and the registry, for error messages.
func (t *target) String() string {
	return fmt.Sprintf("%s (registry %s)", t.ref, t.ref.Registry)
}

// newTarget parses ref ("host[:port]/repository[:tag|@digest]") and sets up its client.
func newTarget(ref string, o Options) (*target, error) {
	r, err := parseRef(ref)
	if err != nil {
		return nil, err
	}
	repo, err := remote.NewRepository(r.String())
	if err != nil {
		return nil, fmt.Errorf("reference %s: %w", quote.Ref(ref), err)
	}
	repo.Reference = r
	repo.PlainHTTP = o.PlainHTTP
	repo.SkipReferrersGC = true

	base := http.DefaultTransport.(*http.Transport).Clone()
	if o.InsecureSkipVerify {
		base.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} //nolint:gosec // explicit opt-in
	}
	client := &auth.Client{
		Client: &http.Client{Transport: retry.NewTransport(base)},
		Cache:  auth.NewCache(),
	}
	client.SetUserAgent("berth")
	switch {
	case o.Username != "":
		client.Credential = auth.StaticCredential(r.Registry, auth.Credential{Username: o.Username, Password: o.Password})
	case o.DockerConfig != "":
		if _, err := os.Stat(o.DockerConfig); err != nil {
			return nil, fmt.Errorf("docker config: %w", err)
		}
		store, err := credentials.NewStore(o.DockerConfig, credentials.StoreOptions{})
		if err != nil {
			return nil, fmt.Errorf("docker config %s: %w", o.DockerConfig, err)
		}
		client.Credential = credentials.Credential(store)
	}
	repo.Client = client
	return &target{ref: r, repo: repo}, nil
}

// progress serializes Progress calls over concurrent transfers.
type progress struct {
	mu    sync.Mutex
	fn    Progress
	done  int64
	total int64
}

func (p *progress) add(n int64) {
	if p.fn == nil || n == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += n
	p.fn(p.done, p.total)
}

// start reports 0 of total once, so a display can size itself before the first byte.
func (p *progress) start() {
	if p.fn == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fn(p.done, p.total)
}

// reader counts the bytes read through it into a progress.
type reader struct {
	r io.Reader
	p *progress
}

func (r reader) Read(b []byte) (int, error) {
	n, err := r.r.Read(b)
	r.p.add(int64(n))
	return n, err
}

// QuoteRef returns ref quoted for an error message or a log: without the user and password a
// user may have written into it ("user:pass@host/repo:tag" reads "<redacted>@host/repo:tag"),
// and cut to a sane length.
func QuoteRef(ref string) string { return quote.Ref(ref) }

// RedactRef returns ref without the user information a user may have written into it, for
// display (a progress bar); QuoteRef is for errors.
func RedactRef(ref string) string { return quote.StripCredentials(ref) }
