package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	berthArchive "github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// restorePlan is a validated checkpoint that Create hands to runc.
type restorePlan struct {
	dir        string // checkpoint directory holding berth.json
	imagesDir  string // CRIU image directory
	rootfsDiff string // rootfs-diff.tar to apply, "" when none
	extracted  string // directory extracted from an archive, removed by cleanup; "" when none
	manifest   *oci.Manifest
	gpuPairs   []gpu.UUIDPair // device map for the GPU restore in Start; nil without GPUs
}

func (p *restorePlan) cleanup() {
	if p.extracted != "" {
		os.RemoveAll(p.extracted)
	}
}

// prepareRestore returns nil when the task is created fresh, or the validated checkpoint.
// For a checkpoint that containerd itself passes (r.Checkpoint, e.g. ctr containers restore), it
// verifies the berth manifest when there is one and returns nil: runc restores from r.Checkpoint
// and containerd applies the rootfs diff.
func (s *Service) prepareRestore(ctx context.Context, r *taskAPI.CreateTaskRequest, spec *specs.Spec) (_ *restorePlan, retErr error) {
	ref := spec.Annotations[oci.AnnotationRestoreFrom]
	switch {
	case ref == "" && r.Checkpoint == "":
		return nil, nil
	case ref == "":
		if _, err := os.Stat(filepath.Join(r.Checkpoint, oci.ManifestFile)); err != nil {
			log.G(ctx).Info("restoring a checkpoint without a berth manifest: not verified")
			return nil, nil
		}
		m, err := s.verify(ctx, r.Checkpoint)
		if err != nil {
			return nil, err
		}
		return &restorePlan{dir: r.Checkpoint, imagesDir: r.Checkpoint, manifest: m}, nil
	case r.Checkpoint != "":
		return nil, fmt.Errorf("annotation %s=%q and a containerd checkpoint %q both given: %w",
			oci.AnnotationRestoreFrom, ref, r.Checkpoint, errdefs.ErrInvalidArgument)
	}

	path, err := oci.ResolveRestoreFrom(s.cfg.CheckpointRoot, ref)
	if err != nil {
		return nil, classify(fmt.Errorf("annotation %s=%q: %w", oci.AnnotationRestoreFrom, ref, err))
	}
	plan := &restorePlan{dir: path}
	defer func() {
		if retErr != nil {
			plan.cleanup()
		}
	}()
	fi, err := os.Stat(path)
	if err != nil {
		return nil, classify(err)
	}
	if !fi.IsDir() {
		dest := filepath.Join(s.cfg.CheckpointRoot, fmt.Sprintf(".restore-%s-%d", r.ID, time.Now().UnixNano()))
		f, err := os.Open(path)
		if err != nil {
			return nil, classify(err)
		}
		defer f.Close()
		plan.extracted = dest
		if err := berthArchive.Extract(f, dest, berthArchive.Limits{
			MaxFileBytes: s.cfg.MaxArchiveBytes, MaxTotalBytes: s.cfg.MaxArchiveBytes, MaxEntries: 1 << 16,
		}); err != nil {
			return nil, fmt.Errorf("extract checkpoint archive %s: %w", path, withClass(err, errdefs.ErrInvalidArgument))
		}
		plan.dir = dest
	}
	if plan.manifest, err = s.verify(ctx, plan.dir); err != nil {
		return nil, err
	}
	plan.imagesDir = plan.dir
	if fi, err := os.Stat(filepath.Join(plan.dir, oci.ImagesDir)); err == nil && fi.IsDir() {
		plan.imagesDir = filepath.Join(plan.dir, oci.ImagesDir)
	}
	if _, err := os.Stat(filepath.Join(plan.dir, oci.RootfsDiffFile)); err == nil {
		plan.rootfsDiff = filepath.Join(plan.dir, oci.RootfsDiffFile)
	}
	return plan, nil
}

// verify reads dir's manifest, checks every digest and compares the fingerprint with this node's.
func (s *Service) verify(ctx context.Context, dir string) (*oci.Manifest, error) {
	m, err := oci.ReadManifest(dir)
	if err != nil {
		return nil, classify(fmt.Errorf("checkpoint %s: %w", dir, err))
	}
	stamped, err := oci.VerifyStamped(dir, m)
	log.G(ctx).WithFields(log.Fields{"checkpoint": dir, "receiver_stamp": stamped}).Debug("checkpoint verified")
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, withClass(err, errdefs.ErrFailedPrecondition))
	}
	node, err := s.deps.Fingerprint(ctx)
	if err != nil {
		return nil, fmt.Errorf("fingerprint of this node: %w", err)
	}
	node.ImageDigest = m.Fingerprint.ImageDigest // the shim cannot see the image; berthctl compares it
	// GPUs: a checkpoint records its container's GPUs, not a node's; planGPURestore compares them
	// with the GPUs the device map picks here. A checkpoint claiming GPUs without GPU state is
	// compared with none.
	node.GPUs = nil
	if m.GPU != nil {
		node.GPUs = m.Fingerprint.GPUs
	}
	if err := fingerprint.Compare(m.Fingerprint, node); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, withClass(err, errdefs.ErrFailedPrecondition))
	}
	return m, nil
}

// applyRootfsDiff applies the checkpoint's rootfs-diff.tar (whiteouts included) to the mounted rootfs.
func (p *restorePlan) applyRootfsDiff(ctx context.Context, rootfs string) error {
	if p.rootfsDiff == "" {
		return nil
	}
	f, err := os.Open(p.rootfsDiff)
	if err != nil {
		return fmt.Errorf("open rootfs diff: %w", err)
	}
	defer f.Close()
	if _, err := archive.Apply(ctx, rootfs, f); err != nil {
		return fmt.Errorf("apply %s to rootfs: %w", p.rootfsDiff, err)
	}
	return nil
}

// classify adds an errdefs class to errors from the oci package so the wire error carries it.
func classify(err error) error {
	switch {
	case errors.Is(err, os.ErrNotExist):
		return withClass(err, errdefs.ErrNotFound)
	case errors.Is(err, oci.ErrOutsideRoot), errors.Is(err, oci.ErrInvalidRef):
		return withClass(err, errdefs.ErrInvalidArgument)
	}
	return err
}

// The error types below give an error an errdefs class without changing its message: errdefs
// resolves classes through these marker methods, so errgrpc maps them to the right wire code.
type invalidArgument struct{ error }

func (invalidArgument) InvalidParameter() {}
func (e invalidArgument) Unwrap() error   { return e.error }

type notFound struct{ error }

func (notFound) NotFound()       {}
func (e notFound) Unwrap() error { return e.error }

type failedPrecondition struct{ error }

func (failedPrecondition) FailedPrecondition() {}
func (e failedPrecondition) Unwrap() error     { return e.error }

// withClass returns err classified as class (errdefs.ErrInvalidArgument, ErrNotFound or
// ErrFailedPrecondition; any other class returns err unchanged).
func withClass(err, class error) error {
	switch class {
	case errdefs.ErrInvalidArgument:
		return invalidArgument{err}
	case errdefs.ErrNotFound:
		return notFound{err}
	case errdefs.ErrFailedPrecondition:
		return failedPrecondition{err}
	}
	return err
}
