package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	berthArchive "github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/oci/signature"
)

// prepareRestore returns nil when the task is created fresh, or the checkpoint it is restored
// from, verified and admitted (admit) and held open until Start.
//
// A restore-from reference (a path under the checkpoint root, an archive there, or an oci://
// reference pulled first) is resolved, extracted when it is an archive, and admitted with its
// rootfs diff. A checkpoint that containerd itself passes (r.Checkpoint, e.g. ctr containers
// restore) is admitted the same way when it carries a berth manifest (it wins over a restore-from
// annotation the container's spec still carries from an earlier restore) (containerd applies the
// container's writable layer itself); one without a berth manifest is refused unless the trust
// policy allows unsigned checkpoints, and its processes are compared with the spec either way;
// a signed one is refused when the spec runs an OCI hook the signed manifest does not record
// for the source container (privilege.CheckHooks).
func (s *Service) prepareRestore(ctx context.Context, r *taskAPI.CreateTaskRequest, spec *specs.Spec) (_ *restorePlan, retErr error) {
	ref := spec.Annotations[oci.AnnotationRestoreFrom]
	if spec.Annotations[oci.AnnotationCRIContainerType] == "sandbox" {
		ref = "" // a pod annotation also reaches the pod's sandbox (pause) container: never restore that
	}
	switch {
	case ref == "" && r.Checkpoint == "":
		return nil, nil
	case ref == "":
		return s.prepareContainerdRestore(ctx, r, spec)
	case r.Checkpoint != "":
		// a container berthctl restored keeps the annotation in its spec, so containerd's own
		// checkpoint of it carries it too: what containerd passes for this task is the checkpoint
		// asked for now (ctr containers restore), verified like any other
		log.G(ctx).WithFields(log.Fields{"annotation": ref, "checkpoint": r.Checkpoint}).Info("restoring containerd's checkpoint; the spec's restore-from annotation names where the container came from before")
		return s.prepareContainerdRestore(ctx, r, spec)
	}
	if err := checkReference(ref); err != nil {
		return nil, err
	}
	src, err := s.parseRestoreFrom(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("annotation %s: %w", oci.AnnotationRestoreFrom, err)
	}
	var path string
	if src.IsOCI() {
		if path, err = s.pullCheckpoint(ctx, src); err != nil {
			return nil, fmt.Errorf("annotation %s=%s: %w", oci.AnnotationRestoreFrom, quote(ref), err)
		}
	} else if path, err = checkpoint.ResolveRestoreFrom(s.cfg.CheckpointRoot, ref); err != nil {
		return nil, fmt.Errorf("annotation %s=%s: %w", oci.AnnotationRestoreFrom, quote(ref), err)
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
		plan.extracted, plan.archive = dest, path
		if err := berthArchive.Extract(f, dest, berthArchive.Limits{
			MaxFileBytes: s.cfg.MaxArchiveBytes, MaxTotalBytes: s.cfg.MaxArchiveBytes, MaxEntries: MaxArchiveEntries,
		}); err != nil {
			return nil, fmt.Errorf("extract checkpoint archive %s: %w", path, mark(err, ErrBadArchive))
		}
		plan.dir = dest
	}
	if err := plan.hold(s.cfg.CheckpointRoot); err != nil {
		return nil, err
	}
	if err := s.admit(ctx, plan, spec, true); err != nil {
		return nil, plan.named(err)
	}
	return plan, nil
}

// parseRestoreFrom parses the berth.dev/restore-from value ref: a path here
// (regdef.ParseRestoreFromPath), an oci:// reference by Deps.Registry (berth-shim-helper runs
// reference.ParseRestoreFrom, oras-go's grammar, which the shim does not link). Errors wrap
// checkpoint.ErrInvalidRef for a value that does not parse.
func (s *Service) parseRestoreFrom(ctx context.Context, ref string) (regdef.RestoreFrom, error) {
	if src, ok, err := regdef.ParseRestoreFromPath(ref); err != nil || ok {
		return src, err
	}
	if s.deps.Registry == nil {
		return regdef.RestoreFrom{}, fmt.Errorf("%s: restore from a registry: this shim has no registry client", quote(ref))
	}
	return s.deps.Registry.ParseRestoreFrom(ctx, ref)
}

// prepareContainerdRestore is prepareRestore for a checkpoint containerd passes in r.Checkpoint.
func (s *Service) prepareContainerdRestore(ctx context.Context, r *taskAPI.CreateTaskRequest, spec *specs.Spec) (_ *restorePlan, retErr error) {
	plan := &restorePlan{dir: r.Checkpoint}
	defer func() {
		if retErr != nil {
			plan.cleanup()
		}
	}()
	if err := checkContainerdSpec(r.Bundle, spec); err != nil {
		return nil, err
	}
	if err := plan.hold(""); err != nil {
		return nil, err
	}
	if _, err := os.Lstat(filepath.Join(plan.root(), checkpoint.ManifestFile)); err == nil {
		if err := s.admit(ctx, plan, spec, false); err != nil {
			return nil, plan.named(err)
		}
		// ctr containers restore takes the spec from containerd's checkpoint image, which no
		// berth signature covers: a hook in it runs as root here, so only the source's own
		// (recorded in the signed manifest) may run
		var src []privilege.Hook
		if sec := plan.manifest.Security; sec != nil {
			src = sec.Hooks
		}
		if err := privilege.CheckHooks(src, spec); err != nil {
			return nil, plan.named(fmt.Errorf("%w (the spec containerd passed runs hooks the checkpointed container did not; restore with the container's own spec, e.g. berthctl restore)", err))
		}
		return plan, nil
	}
	if !s.deps.Trust.AllowUnsigned {
		return nil, fmt.Errorf("checkpoint %s has no berth manifest, so nothing proves who made it: %w (restore checkpoints taken with the berth runtime, or set allow_unsigned = true in %s on a single-node lab)",
			plan.name(), signature.ErrUnsigned, s.configName())
	}
	log.G(ctx).WithField("checkpoint", plan.name()).Warn("allow_unsigned: restoring a checkpoint without a berth manifest: nothing proves who made it")
	if err := plan.statNow(); err != nil {
		return nil, err
	}
	if err := s.checkProcesses(plan, spec); err != nil {
		return nil, plan.named(err)
	}
	return plan, nil
}

// admit verifies and admits the held checkpoint plan for spec, before anything is created, in
// this order: the signature of its berth.json (checked against the keys the trust policy trusts
// for the destination pod's Kubernetes namespace, "" outside Kubernetes), the manifest taken
// from the signed bytes, every file's digest against it (the directory must not change while it
// is verified), the fingerprint, the Kubernetes namespace the signed manifest records, every
// process's credentials in the CRIU images and the source container's security context against
// spec (privilege.CheckProcesses, CheckContainer), and, with withDiff, the rootfs diff to apply
// (chooseRootfsDiff). Under allow_unsigned a checkpoint that is unsigned or signed by an unknown
// key passes with a warning, its manifest read from disk; everything else is still checked.
func (s *Service) admit(ctx context.Context, plan *restorePlan, spec *specs.Spec, withDiff bool) error {
	root := plan.root()
	// where berth.json is: at the top, or (a CRI checkpoint archive) only beside the CRIU images
	signedDir, atTop := root, true
	if _, err := os.Lstat(filepath.Join(root, checkpoint.ManifestFile)); errors.Is(err, os.ErrNotExist) {
		if _, err := os.Lstat(filepath.Join(root, checkpoint.ImagesDir, checkpoint.ManifestFile)); err == nil {
			signedDir, atTop = filepath.Join(root, checkpoint.ImagesDir), false
		}
	}
	before, err := checkpoint.StatDir(root)
	if err != nil {
		return err
	}
	dstNS := spec.Annotations[oci.AnnotationCRISandboxNamespace]
	m, keyID, err := s.verifySignature(ctx, plan.name(), signedDir, dstNS)
	if err != nil {
		return err
	}
	signed := keyID != ""
	// a receiver's (or a pull's) stamp, kept beside the checkpoint in the root, spares reading
	// files it recorded as verified and unchanged since; for a CRI checkpoint a receiver
	// extracted (transfer.LayoutCRI) it is beside checkpoint/, inside the checkpoint directory
	var stamped bool
	if atTop {
		stamped, err = checkpoint.VerifyHeld(root, plan.dir, m)
	} else {
		stamped, err = checkpoint.VerifyHeld(signedDir, filepath.Join(plan.dir, checkpoint.ImagesDir), m)
	}
	log.G(ctx).WithFields(log.Fields{"checkpoint": plan.name(), "receiver_stamp": stamped}).Debug("checkpoint digests verified")
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", plan.name(), err)
	}
	after, err := checkpoint.StatDir(root)
	if err != nil {
		return err
	}
	if err := before.Same(after); err != nil {
		return fmt.Errorf("checkpoint %s changed while it was verified: %w", plan.name(), err)
	}
	plan.stat, plan.manifest = after, m
	if !atTop {
		// a CRI archive: its berth.json covers checkpoint/ only, so nothing but containerd's own
		// files may lie beside it (a receiver's stamp of checkpoint/ too, never in an archive)
		if err := checkpoint.CheckCRITop(root, plan.extracted == ""); err != nil {
			return fmt.Errorf("checkpoint %s: %w", plan.name(), err)
		}
	}
	if err := s.compareFingerprint(ctx, plan.name(), m); err != nil {
		return err
	}
	src := sourceOf(root, m, atTop)
	if signed && src.namespace != dstNS && !s.deps.Trust.TrustedFor(keyID, src.namespace) {
		// the keys were chosen for the destination's namespace; the signer must also be
		// trusted for the namespace its signed manifest says the checkpoint was taken in
		return fmt.Errorf("checkpoint %s: signed by %s, which is not trusted for namespace %q, where its signed manifest says it was taken: %w (trust policy of %s)",
			plan.name(), keyID, src.namespace, signature.ErrUntrustedKey, s.configName())
	}
	if err := s.checkNamespace(plan.name(), src.namespace, dstNS); err != nil {
		return err
	}
	if err := s.checkProcesses(plan, spec); err != nil {
		return err
	}
	switch {
	case src.security != nil:
		if err := privilege.CheckContainer(*src.security, spec); err != nil {
			return fmt.Errorf("checkpoint %s: %w", plan.name(), err)
		}
	case signed:
		return fmt.Errorf("checkpoint %s: its signed manifest records no security context of the source container, so the restore cannot be compared with this pod's spec: %w",
			plan.name(), ErrNoSecurityContext)
	default:
		log.G(ctx).WithField("checkpoint", plan.name()).Warn("allow_unsigned: the checkpoint records no security context of its source container; only its processes' credentials are compared with the spec")
	}
	if withDiff {
		if plan.rootfsDiff, err = s.chooseRootfsDiff(ctx, plan, atTop); err != nil {
			return err
		}
	}
	return nil
}

// verifySignature checks the signature of dir's berth.json (signedDir is where it is, read
// through the held directory) with the trust policy for Kubernetes namespace ns, and returns the
// manifest parsed from the signed bytes and the signing key's id. Under allow_unsigned, a
// checkpoint that is unsigned or signed by an unknown key is logged as a warning and its
// manifest read from disk (key id "").
func (s *Service) verifySignature(ctx context.Context, dir, signedDir, ns string) (_ *checkpoint.Manifest, keyID string, _ error) {
	v, err := s.deps.Trust.Verify(ctx, signedDir, ns)
	if err != nil {
		return nil, "", fmt.Errorf("%w (trust policy of %s: a checkpoint restores only when a key in trusted_keys signed it)", err, s.configName())
	}
	if v.Warning != nil {
		log.G(ctx).WithError(v.Warning).WithField("checkpoint", dir).Warn("allow_unsigned: restoring a checkpoint that no trusted key signed")
		m, err := checkpoint.ReadManifest(signedDir)
		if err != nil {
			return nil, "", fmt.Errorf("checkpoint %s: %w", dir, err)
		}
		return m, "", nil
	}
	m, err := checkpoint.ParseManifest(v.Manifest)
	if err != nil {
		return nil, "", fmt.Errorf("checkpoint %s: signed %s: %w", dir, checkpoint.ManifestFile, err)
	}
	log.G(ctx).WithFields(log.Fields{"checkpoint": dir, "key": v.KeyID}).Info("checkpoint signature verified")
	return m, v.KeyID, nil
}

// source is what a checkpoint's manifest says of the container it was taken from.
type source struct {
	// namespace is the source pod's Kubernetes namespace ("" outside Kubernetes).
	namespace string
	// security is the source container's security context; nil when not recorded.
	security *privilege.Container
}

// sourceOf returns the source of the checkpoint at root whose verified manifest is m. A
// top-level manifest (berthctl's) that does not record it defers to the shim's manifest beside
// the CRIU images, which the top-level digests cover.
func sourceOf(root string, m *checkpoint.Manifest, atTop bool) source {
	src := source{namespace: m.Container.KubernetesNamespace, security: m.Security}
	if atTop && (src.namespace == "" || src.security == nil) {
		if inner, err := checkpoint.ReadManifest(filepath.Join(root, checkpoint.ImagesDir)); err == nil {
			if src.namespace == "" {
				src.namespace = inner.Container.KubernetesNamespace
			}
			if src.security == nil {
				src.security = inner.Security
			}
		}
	}
	return src
}

// checkProcesses reads every thread's credentials from the held CRIU images (through the
// path a child can open: ReadProcesses runs in berth-shim-helper) and refuses a
// restore that would give any of them more than spec grants (privilege.CheckProcesses: the
// error names the process, the field and both values).
func (s *Service) checkProcesses(plan *restorePlan, spec *specs.Spec) error {
	procs, err := s.deps.ReadProcesses(plan.runcImages())
	if err != nil {
		return fmt.Errorf("checkpoint %s: read the credentials of its processes: %w", plan.name(), err)
	}
	if err := privilege.CheckProcesses(procs, spec); err != nil {
		return fmt.Errorf("checkpoint %s: %w", plan.name(), err)
	}
	if spec.Linux != nil && spec.Linux.Seccomp != nil {
		// CRIU restores the processes' own filters, never this spec's profile: they must be at
		// least as strict, signed or not (a forged seccomp.img once restored RET ALLOW)
		if err := s.deps.CheckSeccomp(plan.runcImages(), spec.Linux.Seccomp); err != nil {
			return fmt.Errorf("checkpoint %s: its processes' seccomp filters against this pod's profile: %w", plan.name(), err)
		}
	}
	return nil
}

// checkNamespace refuses to restore a checkpoint taken in one Kubernetes namespace (from, as its
// signed manifest records it) into a pod of another (to), unless the shim config's
// namespace_mappings allows "from:to": a checkpoint holds the process's memory, secrets
// included. A checkpoint of a container outside Kubernetes (from "") restores into a pod only
// when namespace_mappings allows ":to". Restores outside Kubernetes (to "") pass.
func (s *Service) checkNamespace(dir, from, to string) error {
	if to == "" || from == to {
		return nil // not a pod (ctr, berthctl restore: the node's operator), or the same namespace
	}
	for _, m := range s.cfg.NamespaceMappings {
		if m == from+":"+to {
			return nil
		}
	}
	if from == "" {
		// a checkpoint of a container outside Kubernetes (ctr, nerdctl, berthctl migrate) holds
		// that container's memory: no pod may take it unless the node says which namespace may
		return mark(fmt.Errorf("checkpoint %s is of a container outside Kubernetes and may not be restored into a pod of namespace %q (allow it with namespace_mappings = [\":%s\"] in the shim config)",
			dir, to, to), ErrNamespaceRefused)
	}
	return mark(fmt.Errorf("checkpoint %s was taken in Kubernetes namespace %q and may not be restored into namespace %q (allow it with namespace_mappings = [\"%s:%s\"] in the shim config)",
		dir, from, to, from, to), ErrNamespaceRefused)
}

// compareFingerprint compares the checkpoint's fingerprint (from its verified manifest m) with
// this node's.
func (s *Service) compareFingerprint(ctx context.Context, dir string, m *checkpoint.Manifest) error {
	node, err := s.deps.Fingerprint(ctx)
	if err != nil {
		return fmt.Errorf("fingerprint of this node: %w", err)
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
		return fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	return nil
}

// chooseRootfsDiff returns the rootfs diff the restore applies (a path relative to the
// checkpoint directory, "" for none), after checking it against the limits (scanRootfsDiff).
// Only a diff that the verified manifest lists is applied, whatever else lies in the directory:
//
//   - a checkpoint whose berth.json is at its top (berthctl's, or an archive that `berthctl
//     checkpoint push` signed whole): its rootfs-diff.tar when listed, else the shim's own copy
//     (checkpoint.ImagesRootfsDiffFile) inside its CRIU image directory, or at its top when the
//     checkpoint is a bare CRIU image directory of the shim's;
//   - a CRI archive (berth.json only beside the CRIU images): the shim's own copy beside the
//     images, when the images' berth.json lists it;
//   - a CRI archive's rootfs-diff.tar, which containerd writes after the shim signed the images,
//     is covered by nothing: when it is not empty it is refused (ErrUncoveredRootfsDiff), unless
//     the trust policy allows unsigned checkpoints (then it is applied with a warning).
//
// A berth-rootfs-diff.tar at the top of a CRI archive is never taken (admit refused it already:
// checkpoint.CheckCRITop).
func (s *Service) chooseRootfsDiff(ctx context.Context, plan *restorePlan, atTop bool) (string, error) {
	root := plan.root()
	choice := rootfsDiffOf(plan.manifest, atTop)
	if choice == "" {
		fi, err := os.Lstat(filepath.Join(root, checkpoint.RootfsDiffFile))
		if atTop || err != nil || !fi.Mode().IsRegular() {
			return "", nil
		}
		entries, err := s.scanRootfsDiff(filepath.Join(root, checkpoint.RootfsDiffFile))
		if err != nil {
			return "", fmt.Errorf("checkpoint %s: %s: %w", plan.name(), checkpoint.RootfsDiffFile, err)
		}
		if entries == 0 {
			return "", nil
		}
		if !s.deps.Trust.AllowUnsigned {
			return "", mark(fmt.Errorf("checkpoint %s: %s (%d entries) is not covered by a signature: containerd wrote it after berth signed the CRIU images, and the checkpoint has no %s/%s of berth's own; sign the whole archive on its source node with `berthctl checkpoint push` (its top-level %s covers every file), or take the checkpoint again with this berth, which records the rootfs diff beside the images",
				plan.name(), checkpoint.RootfsDiffFile, entries, checkpoint.ImagesDir, checkpoint.ImagesRootfsDiffFile, checkpoint.ManifestFile), ErrUncoveredRootfsDiff)
		}
		log.G(ctx).WithField("checkpoint", plan.name()).Warn("allow_unsigned: applying a rootfs diff that no signature covers")
		return checkpoint.RootfsDiffFile, nil
	}
	if _, err := s.scanRootfsDiff(filepath.Join(root, choice)); err != nil {
		return "", fmt.Errorf("checkpoint %s: %s: %w", plan.name(), choice, err)
	}
	return choice, nil
}

// rootfsDiffOf returns the rootfs diff that the verified manifest m lists, as a path relative to
// the checkpoint directory ("" when it lists none), in chooseRootfsDiff's order. atTop says
// whether m is the checkpoint's top-level berth.json (else it is the CRIU images' own, inside
// checkpoint.ImagesDir). admit verified every file m lists, so the path returned was digested.
func rootfsDiffOf(m *checkpoint.Manifest, atTop bool) string {
	if m == nil {
		return ""
	}
	listed := func(rel string) bool {
		return slices.ContainsFunc(m.Files, func(f checkpoint.File) bool { return f.Path == rel })
	}
	inImages := checkpoint.ImagesDir + "/" + checkpoint.ImagesRootfsDiffFile
	switch {
	case !atTop && listed(checkpoint.ImagesRootfsDiffFile):
		return inImages // the images' manifest: its paths are relative to checkpoint/
	case !atTop:
		return ""
	case listed(checkpoint.RootfsDiffFile):
		return checkpoint.RootfsDiffFile
	case listed(inImages):
		return inImages
	case listed(checkpoint.ImagesRootfsDiffFile):
		return checkpoint.ImagesRootfsDiffFile // a bare CRIU image directory of the shim's
	}
	return ""
}

// applyRootfsDiff applies the rootfs diff chosen in Create (whiteouts included) to the mounted
// rootfs, reading it from the held checkpoint after checking that nothing changed since it was
// verified, within the same limits it was scanned against.
func (s *Service) applyRootfsDiff(ctx context.Context, p *restorePlan, rootfs string) error {
	if p.rootfsDiff == "" {
		return nil
	}
	if err := p.unchanged(); err != nil {
		return err
	}
	if err := s.applyDiff(ctx, filepath.Join(p.root(), p.rootfsDiff), rootfs); err != nil {
		return fmt.Errorf("apply %s of checkpoint %s to the rootfs: %w", p.rootfsDiff, p.name(), err)
	}
	return nil
}

// configName names the shim's configuration file in messages.
func (s *Service) configName() string {
	if s.cfg.Path == "" {
		return "the shim config"
	}
	return s.cfg.Path
}

// restorePlan is a checkpoint that Create verified and admitted, held open until Start so that
// runc restores exactly what was verified.
type restorePlan struct {
	dir       string // the checkpoint directory: as resolved, or extracted
	archive   string // the archive dir was extracted from; "" when none
	extracted string // directory extracted from an archive, removed by cleanup; "" when none
	// held is dir, opened in Create; every check reads through it (root), and runc restores from
	// heldImages, the CRIU image directory inside it (/proc/<shim>/fd/N): a directory swapped in
	// at dir's path later is never read.
	held, heldImages *os.File
	imagesSub        bool // the CRIU image directory is ImagesDir inside dir, not dir itself
	// stat is the held directory as it was verified; Start refuses to restore when it changed.
	stat       checkpoint.DirStat
	rootfsDiff string               // rootfs diff to apply, relative to dir; "" when none
	manifest   *checkpoint.Manifest // the verified manifest; nil for a containerd checkpoint without one
	gpuPairs   []gpu.UUIDPair       // device map for the GPU restore in Start; nil without GPUs
	gpuReason  string               // why the device map was chosen (devicemap.Choice.Reason)
}

// hold opens the checkpoint directory and its CRIU image directory (ImagesDir inside it when
// there is one, else the directory itself). With a checkpoint root, the directory opened must
// lie inside it (a path component swapped for a symbolic link since it was resolved is caught).
func (p *restorePlan) hold(checkpointRoot string) error {
	f, err := openDir(p.dir)
	if err != nil {
		return fmt.Errorf("open checkpoint: %w", err)
	}
	p.held = f
	if checkpointRoot != "" {
		real, err := os.Readlink(p.root())
		realRoot, rerr := filepath.EvalSymlinks(checkpointRoot)
		if err != nil || rerr != nil || !strings.HasPrefix(real, realRoot+string(filepath.Separator)) {
			return fmt.Errorf("%w: checkpoint %s opened as %s, outside %s", checkpoint.ErrOutsideRoot, p.dir, real, realRoot)
		}
	}
	p.heldImages = f
	if fi, err := os.Lstat(filepath.Join(p.root(), checkpoint.ImagesDir)); err == nil && fi.IsDir() {
		if p.heldImages, err = openDir(filepath.Join(p.root(), checkpoint.ImagesDir)); err != nil {
			p.heldImages = nil
			return fmt.Errorf("open checkpoint images: %w", err)
		}
		p.imagesSub = true
	}
	return nil
}

// statNow records the held directory as it is now (for a checkpoint without a manifest).
func (p *restorePlan) statNow() (err error) {
	p.stat, err = checkpoint.StatDir(p.root())
	return err
}

// root is the held checkpoint directory's path for this process.
func (p *restorePlan) root() string { return fdPath("self", p.held) }

// images is the held CRIU image directory's path for this process.
func (p *restorePlan) images() string { return fdPath("self", p.heldImages) }

// runcImages is the held CRIU image directory's path for a child of this process (runc, and
// berth-shim-helper reading the processes' credentials), and for this process too.
func (p *restorePlan) runcImages() string { return fdPath(fmt.Sprint(os.Getpid()), p.heldImages) }

// name names the checkpoint in messages: its archive, or its directory.
func (p *restorePlan) name() string {
	if p.archive != "" {
		return p.archive
	}
	return p.dir
}

// imagesDir is the CRIU image directory's path as named, for messages.
func (p *restorePlan) imagesDir() string {
	if p.imagesSub {
		return filepath.Join(p.dir, checkpoint.ImagesDir)
	}
	return p.dir
}

// unchanged returns nil when the held checkpoint is still what Create verified, else an error
// wrapping checkpoint.ErrChanged that names the file.
func (p *restorePlan) unchanged() error {
	now, err := checkpoint.StatDir(p.root())
	if err == nil {
		err = p.stat.Same(now)
	}
	if err != nil {
		return p.named(fmt.Errorf("checkpoint %s is not what Create verified: %w", p.name(), err))
	}
	return nil
}

// named returns err with the held directory's paths in its message replaced by the
// checkpoint's own path (errors.Is and As still see err).
func (p *restorePlan) named(err error) error {
	if err == nil || p.held == nil {
		return err
	}
	return renamed{err: err, old: p.root(), new: p.name()}
}

// cleanup releases the held directories and removes an extracted archive. It may be called
// more than once.
func (p *restorePlan) cleanup() {
	if p.heldImages != nil && p.heldImages != p.held {
		p.heldImages.Close()
	}
	if p.held != nil {
		p.held.Close()
	}
	p.held, p.heldImages = nil, nil
	if p.extracted != "" {
		os.RemoveAll(p.extracted)
		p.extracted = ""
	}
}

// renamed is an error whose message shows new where err's shows old.
type renamed struct {
	err      error
	old, new string
}

func (r renamed) Error() string { return strings.ReplaceAll(r.err.Error(), r.old, r.new) }
func (r renamed) Unwrap() error { return r.err }

// openDir opens the directory path itself (not a symbolic link to one), close-on-exec.
func openDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// fdPath is the /proc path of f, an open directory, for process pid ("self" or a number).
func fdPath(pid string, f *os.File) string {
	if f == nil {
		return ""
	}
	return "/proc/" + pid + "/fd/" + strconv.Itoa(int(f.Fd()))
}

// checkContainerdSpec refuses, for a restore of a checkpoint containerd passes, the parts of
// spec that would act as root on this node outside the container and that no signature covers
// (ctr containers restore takes the spec from containerd's checkpoint image): an
// org.criu.config annotation naming any file but the shim's own in bundle (CRIU, root, would
// read its libdir or action-script), and a root.path other than the bundle's rootfs (runc gives
// it to CRIU as the restored tree's root). Errors wrap privilege.ErrExceedsSpec.
func checkContainerdSpec(bundle string, spec *specs.Spec) error {
	if cur, ok := spec.Annotations[oci.AnnotationCRIUConfig]; ok && cur != filepath.Join(bundle, criuConfigName) {
		return fmt.Errorf("%w: the spec's %s annotation names %s, not the shim's own CRIU configuration: CRIU would read it as root on this node (remove the annotation; set criu_options in %s instead)",
			privilege.ErrExceedsSpec, oci.AnnotationCRIUConfig, quote(cur), "the shim's configuration")
	}
	if spec.Root == nil {
		return nil // runc refuses a spec without a root
	}
	root := spec.Root.Path
	if !filepath.IsAbs(root) {
		root = filepath.Join(bundle, root)
	}
	if filepath.Clean(root) != filepath.Join(bundle, "rootfs") {
		return fmt.Errorf("%w: the spec's root.path is %s, not the bundle's rootfs: the restored processes would see it as /",
			privilege.ErrExceedsSpec, quote(spec.Root.Path))
	}
	return nil
}
