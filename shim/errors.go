package shim

import (
	"context"
	"errors"
	"os"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"google.golang.org/grpc/status"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/privilege/seccompbpf"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/oci/signature"
)

// Conditions the shim itself detects. Each is wrapped, with the values it concerns, into the
// error of the call that met it (the message stays the one users know; errors.Is finds the
// sentinel), and errorClass gives it its errdefs class.
var (
	// ErrInvalidSpec: the bundle's config.json, or a checkpoint's spec.dump, is not a valid OCI
	// runtime spec (InvalidArgument).
	ErrInvalidSpec = errors.New("invalid OCI runtime spec")
	// ErrNamespaceRefused: the checkpoint was taken in another Kubernetes namespace than the pod
	// it would be restored into, and namespace_mappings does not allow the pair (PermissionDenied).
	ErrNamespaceRefused = errors.New("restore into another Kubernetes namespace refused")
	// ErrRegistryNotAllowed: berth.dev/restore-from names a registry that is not in
	// allowed_registries (PermissionDenied).
	ErrRegistryNotAllowed = errors.New("registry not allowed")
	// ErrRegistryDigest: the registry resolved a reference to a digest that is not sha256
	// (InvalidArgument).
	ErrRegistryDigest = errors.New("registry answered an unusable digest")
	// ErrBadArchive: a restore-from archive cannot be extracted (unsafe, over the limits, cut
	// short or not a tar) (InvalidArgument).
	ErrBadArchive = errors.New("checkpoint archive cannot be extracted")
	// ErrUncoveredRootfsDiff: a checkpoint's rootfs diff is not covered by a signature (a CRI
	// archive's rootfs-diff.tar, written by containerd after the shim signed the images, without
	// a top-level berth.json signed by berthctl and without the shim's own copy) and is not
	// empty (PermissionDenied).
	ErrUncoveredRootfsDiff = errors.New("rootfs diff not covered by a signature")
	// ErrRootfsDiffTooLarge: a rootfs diff would write more than max_rootfs_diff_bytes or has
	// more than MaxArchiveEntries entries (InvalidArgument, like an archive over its limits).
	ErrRootfsDiffTooLarge = errors.New("rootfs diff exceeds its limits")
	// ErrNoSecurityContext: a signed manifest records no security context of the source
	// container, so the restore cannot be compared with the destination spec (FailedPrecondition).
	ErrNoSecurityContext = errors.New("checkpoint records no security context")
	// ErrBadReference: berth.dev/restore-from is too long or carries credentials
	// (InvalidArgument).
	ErrBadReference = errors.New("unusable restore-from reference")

	// Causes of a failed CRIU dump or restore, told from CRIU's log and the spec (restorefail.go).

	// ErrMountSource: a bind mount's source, or a file the checkpointed process held open on
	// one, is missing on this node (FailedPrecondition).
	ErrMountSource = errors.New("bind mount source missing on this node")
	// ErrShmFile: the checkpointed process held a file on /dev/shm open that the container's
	// /dev/shm here lacks (FailedPrecondition).
	ErrShmFile = errors.New("open /dev/shm file missing on this node")
	// ErrPIDInUse: a PID of the checkpoint is taken in the PID namespace the container joins
	// (FailedPrecondition).
	ErrPIDInUse = errors.New("checkpoint PID already in use")
	// ErrOutOfMemory: the container's memory limit is below what the checkpoint holds, or CRIU
	// was killed restoring it (ResourceExhausted).
	ErrOutOfMemory = errors.New("memory limit below the checkpoint")
	// ErrCRIUOptions: CRIU refused its options (criu_options, the bundle's CRIU configuration)
	// before it wrote a log (InvalidArgument).
	ErrCRIUOptions = errors.New("CRIU refused its options")
	// ErrMissingCapability: this node's root lacks a capability CRIU needs (CAP_SYS_RESOURCE to
	// read a non-root process's rlimits) (FailedPrecondition).
	ErrMissingCapability = errors.New("CRIU lacks a capability on this node")
)

// mark returns err tagged with sentinel: its message is err's own, and errors.Is finds both err's
// chain and sentinel. nil stays nil.
func mark(err, sentinel error) error {
	if err == nil {
		return nil
	}
	return marked{err: err, sentinel: sentinel}
}

type marked struct {
	err, sentinel error
}

func (m marked) Error() string        { return m.err.Error() }
func (m marked) Unwrap() error        { return m.err }
func (m marked) Is(target error) bool { return target == m.sentinel }

// errorClasses is the one table from the errors berth's steps return to the errdefs class the task
// API answers with: the first row whose condition holds decides. It lists the sentinels of the
// packages that own each concept (oci/checkpoint: references, verification, manifests; oci/archive;
// oci/registry; oci/fingerprint; oci/signature; oci/privilege; gpu; this package's own above) and
// os.ErrNotExist. An error that
// matches no row keeps the class it already carries (errdefs, or the code of a runc task service
// error), else it is Unknown.
func errorClasses() []struct {
	match func(error) bool
	class error
} {
	is := func(sentinels ...error) func(error) bool {
		return func(err error) bool {
			for _, s := range sentinels {
				if errors.Is(err, s) {
					return true
				}
			}
			return false
		}
	}
	fingerprintMismatch := func(err error) bool {
		var m *fingerprint.MismatchError
		return errors.As(err, &m)
	}
	return []struct {
		match func(error) bool
		class error
	}{
		// who may restore what: namespaces, registries, signatures, privileges
		{is(ErrNamespaceRefused, ErrRegistryNotAllowed, regdef.ErrUnauthorized,
			signature.ErrUnsigned, signature.ErrUntrustedKey, signature.ErrBadSignature,
			privilege.ErrExceedsSpec, seccompbpf.ErrMorePermissive, ErrUncoveredRootfsDiff), errdefs.ErrPermissionDenied},
		// what the caller asked for is malformed or points outside what is allowed
		{is(checkpoint.ErrInvalidRef, checkpoint.ErrOutsideRoot, regdef.ErrNoTag, ErrInvalidSpec, ErrRegistryDigest,
			ErrBadArchive, archive.ErrUnsafePath, archive.ErrLink, archive.ErrSpecialFile, archive.ErrFileTooLarge,
			archive.ErrTotalTooLarge, archive.ErrTooManyEntries, archive.ErrDuplicateEntry, backend.ErrUnknown,
			ErrRootfsDiffTooLarge, ErrBadReference, ErrCRIUOptions, checkpoint.ErrBadPageStreamRequest), errdefs.ErrInvalidArgument},
		// the checkpoint does not fit this node's memory limit
		{is(ErrOutOfMemory), errdefs.ErrResourceExhausted},
		// this node lacks what the checkpoint's processes held: a file, a PID, a capability
		{is(ErrMountSource, ErrShmFile, ErrPIDInUse, ErrMissingCapability), errdefs.ErrFailedPrecondition},
		// the checkpoint is damaged, is not berth's, or does not fit this node
		{is(checkpoint.ErrDigestMismatch, checkpoint.ErrMissingFile, checkpoint.ErrExtraFile, checkpoint.ErrTruncated,
			checkpoint.ErrSizeMismatch, checkpoint.ErrInvalidManifest, checkpoint.ErrUnsupportedVersion, checkpoint.ErrUnsupportedFile,
			checkpoint.ErrInvalidRoot, checkpoint.ErrPagesUnverified, regdef.ErrNotCheckpoint, regdef.ErrLayerMismatch,
			ErrNoSecurityContext, checkpoint.ErrChanged, signature.ErrBadKey,
			seccompbpf.ErrBadProgram, seccompbpf.ErrTooComplex, seccompbpf.ErrCompile), errdefs.ErrFailedPrecondition},
		{fingerprintMismatch, errdefs.ErrFailedPrecondition},
		// the GPUs cannot take the step now, or ever on this driver
		{is(gpu.ErrTimeout), errdefs.ErrUnavailable},
		// an armed page stream that did not reach the destination (pagearm.go)
		{is(ErrPageStreamLost), errdefs.ErrUnavailable},
		{is(gpu.ErrOutOfMemory), errdefs.ErrResourceExhausted},
		{is(gpu.ErrIllegalState, gpu.ErrUnsupported, gpu.ErrNotCUDA), errdefs.ErrFailedPrecondition},
		// what was named does not exist
		{is(regdef.ErrNotFound, os.ErrNotExist), errdefs.ErrNotFound},
	}
}

// errorClass returns err's errdefs class (errdefs.ErrInvalidArgument, ...): the first row of
// errorClasses that matches, else the class err carries, else errdefs.ErrUnknown. nil for nil.
func errorClass(err error) error {
	if err == nil {
		return nil
	}
	for _, row := range errorClasses() {
		if row.match(err) {
			return row.class
		}
	}
	if c := errdefs.Resolve(err); c != errdefs.ErrUnknown {
		return c
	}
	if _, ok := status.FromError(err); ok {
		// a runc task service error that was not made native: keep its code
		return errdefs.Resolve(errgrpc.ToNative(err))
	}
	return errdefs.ErrUnknown
}

// wireError is err, a native error of one of the service's steps, as the task API returns it:
// its message with credentials redacted and cut to a sane length (cleanMessage), its code from
// errorClass. Every exported method calls it once, last.
func wireError(err error) error {
	if err == nil {
		return nil
	}
	class := errorClass(err)
	msg := cleanMessage(err.Error())
	switch {
	case class == context.Canceled || class == context.DeadlineExceeded || class == errdefs.ErrUnknown:
		if msg != err.Error() {
			err = withMessage{err: err, msg: msg}
		}
		return errgrpc.ToGRPC(err)
	default:
		if c, ok := class.(interface{ WithMessage(string) error }); ok {
			return errgrpc.ToGRPC(c.WithMessage(msg))
		}
		return errgrpc.ToGRPC(withMessage{err: err, msg: msg})
	}
}

// withMessage is err with another message (cleanMessage's).
type withMessage struct {
	err error
	msg string
}

func (w withMessage) Error() string { return w.msg }
func (w withMessage) Unwrap() error { return w.err }
