package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	berthArchive "github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/registry"
)

// restorePlan is a validated checkpoint that Create hands to runc.
type restorePlan struct {
	dir        string // checkpoint directory holding berth.json
	imagesDir  string // CRIU image directory
	rootfsDiff string // rootfs-diff.tar to apply, "" when none
	extracted  string // directory extracted from an archive, removed by cleanup; "" when none
	manifest   *checkpoint.Manifest
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
	if spec.Annotations[oci.AnnotationCRIContainerType] == "sandbox" {
		ref = "" // a pod annotation also reaches the pod's sandbox (pause) container: never restore that
	}
	switch {
	case ref == "" && r.Checkpoint == "":
		return nil, nil
	case ref == "":
		if _, err := os.Stat(filepath.Join(r.Checkpoint, checkpoint.ManifestFile)); err != nil {
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

	src, err := registry.ParseRestoreFrom(ref)
	if err != nil {
		return nil, fmt.Errorf("annotation %s: %w", oci.AnnotationRestoreFrom, err)
	}
	var path string
	if src.IsOCI() {
		if path, err = s.pullCheckpoint(ctx, src); err != nil {
			return nil, fmt.Errorf("annotation %s=%q: %w", oci.AnnotationRestoreFrom, ref, err)
		}
	} else if path, err = checkpoint.ResolveRestoreFrom(s.cfg.CheckpointRoot, ref); err != nil {
		return nil, fmt.Errorf("annotation %s=%q: %w", oci.AnnotationRestoreFrom, ref, err)
	}
	plan := &restorePlan{dir: path}
	defer func() {
		if retErr != nil {
			plan.cleanup()
		}
	}()
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		dest := filepath.Join(s.cfg.CheckpointRoot, fmt.Sprintf(".restore-%s-%d", r.ID, s.deps.Now().UnixNano()))
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		plan.extracted = dest
		if err := berthArchive.Extract(f, dest, berthArchive.Limits{
			MaxFileBytes: s.cfg.MaxArchiveBytes, MaxTotalBytes: s.cfg.MaxArchiveBytes, MaxEntries: 1 << 16,
		}); err != nil {
			return nil, fmt.Errorf("extract checkpoint archive %s: %w", path, mark(err, ErrBadArchive))
		}
		plan.dir = dest
	}
	verified := plan.dir
	if _, err := os.Stat(filepath.Join(plan.dir, checkpoint.ManifestFile)); errors.Is(err, os.ErrNotExist) {
		// A CRI checkpoint archive (kubelet checkpoint API, crictl checkpoint --export): containerd
		// writes rootfs-diff.tar, spec.dump and config.dump after the shim signed the CRIU images,
		// so only checkpoint/berth.json exists and covers the images. `berthctl push` signs the
		// whole archive; a local CRI archive's other files pass safe extraction only.
		if _, err := os.Stat(filepath.Join(plan.dir, checkpoint.ImagesDir, checkpoint.ManifestFile)); err == nil {
			verified = filepath.Join(plan.dir, checkpoint.ImagesDir)
			log.G(ctx).WithField("checkpoint", plan.dir).Warn("CRI checkpoint archive: only the CRIU images are covered by digests")
		}
	}
	if plan.manifest, err = s.verify(ctx, verified); err != nil {
		return nil, err
	}
	if err := s.checkNamespace(plan.dir, spec); err != nil {
		return nil, err
	}
	plan.imagesDir = plan.dir
	if fi, err := os.Stat(filepath.Join(plan.dir, checkpoint.ImagesDir)); err == nil && fi.IsDir() {
		plan.imagesDir = filepath.Join(plan.dir, checkpoint.ImagesDir)
	}
	if _, err := os.Stat(filepath.Join(plan.dir, checkpoint.RootfsDiffFile)); err == nil {
		plan.rootfsDiff = filepath.Join(plan.dir, checkpoint.RootfsDiffFile)
	}
	return plan, nil
}

// checkNamespace refuses to restore a checkpoint taken in one Kubernetes namespace into a pod of
// another (a checkpoint holds the process's memory, secrets included), unless the shim config's
// namespace_mappings allows "source:destination". The source namespace comes from the
// checkpoint's spec.dump; checkpoints of containers outside Kubernetes have none and pass.
func (s *Service) checkNamespace(dir string, spec *specs.Spec) error {
	dst := spec.Annotations[oci.AnnotationCRISandboxNamespace]
	b, err := os.ReadFile(filepath.Join(dir, checkpoint.SpecFile))
	if err != nil || dst == "" {
		return nil
	}
	var src specs.Spec
	if err := json.Unmarshal(b, &src); err != nil {
		return fmt.Errorf("checkpoint %s: %s: %w", dir, checkpoint.SpecFile, mark(err, ErrInvalidSpec))
	}
	from := src.Annotations[oci.AnnotationCRISandboxNamespace]
	if from == "" || from == dst {
		return nil
	}
	for _, m := range s.cfg.NamespaceMappings {
		if m == from+":"+dst {
			return nil
		}
	}
	return mark(fmt.Errorf("checkpoint %s was taken in Kubernetes namespace %q and may not be restored into namespace %q (allow it with namespace_mappings = [\"%s:%s\"] in the shim config)",
		dir, from, dst, from, dst), ErrNamespaceRefused)
}

// verify reads dir's manifest, checks every digest and compares the fingerprint with this node's.
func (s *Service) verify(ctx context.Context, dir string) (*checkpoint.Manifest, error) {
	m, err := checkpoint.ReadManifest(dir)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	stamped, err := checkpoint.VerifyStamped(dir, m)
	log.G(ctx).WithFields(log.Fields{"checkpoint": dir, "receiver_stamp": stamped}).Debug("checkpoint verified")
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
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
		return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
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
	// containerd's own rw layer (CRI checkpoint archives) is gzip-compressed; berth's is plain
	r, err := compression.DecompressStream(f)
	if err != nil {
		return fmt.Errorf("read rootfs diff %s: %w", p.rootfsDiff, err)
	}
	defer r.Close()
	if _, err := archive.Apply(ctx, rootfs, r); err != nil {
		return fmt.Errorf("apply %s to rootfs: %w", p.rootfsDiff, err)
	}
	return nil
}
