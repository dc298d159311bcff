package shim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/privilege"
)

// checkpoint is Checkpoint with native errors, in steps: check the task, set CRIU's work
// directory, take the GPU session forward, dump, give the GPUs back unless the task exits, write
// the rootfs diff and the contents of the pod's tmpfs mounts (tmpfs.go) beside the images, build and write the manifest, restrict the checkpoint's
// modes and sign it. In lazy mode (checkpoint.LazyPagesRequestFile) it returns once CRIU's lazy
// page server listens, with everything but the memory written and signed; CRIU then serves the
// pages from the frozen task in the background (lazy.go), and the GPUs are given back only if
// that fails (the task then runs on here); on success the caller stops the task. In copy mode
// armed by the node's agent (pagearm.go) the pages go through the shim's relay, and the
// checkpoint fails (the task runs on) unless the destination took the whole stream.
func (s *Service) checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (retErr error) {
	var cleanups []func() // run on return, or by the lazy dump's end in lazy mode
	background := false
	defer func() {
		if !background {
			for i := len(cleanups) - 1; i >= 0; i-- {
				cleanups[i]()
			}
		}
	}()
	// a pause lease never resumes a task CRIU is dumping; a Pause either froze the task before
	// its state is read here or waits for the checkpoint's end (gate)
	ungate := s.gate(r.ID)
	cleanups = append(cleanups, s.checkpointing(r.ID))
	st, err := s.checkpointable(ctx, r)
	ungate()
	if err != nil {
		return err
	}
	spec, err := readSpec(st.Bundle)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	opts, done, err := s.criuWorkDir(r, st.Bundle)
	if err != nil {
		return err
	}
	cleanups = append(cleanups, done)
	s.leaseWorkDir(r.ID, leasedCheckpointDir(r.Path, opts.WorkPath, st.Bundle))
	// copy mode armed by the node's agent (pagearm.go): a page-server request for usePageServer
	armed, err := s.armPageStream(ctx, r.ID, opts.WorkPath)
	if err != nil {
		return err
	}
	if armed != nil {
		cleanups = append(cleanups, func() {
			armed.close()
			_ = os.Remove(filepath.Join(opts.WorkPath, checkpoint.PageServerRequestFile))
		})
	}
	undo, lazy, err := s.usePageServer(ctx, r.ID, opts.WorkPath, st.Bundle, spec)
	if err != nil {
		return err
	}
	cleanups = append(cleanups, undo)
	if lazy != "" {
		// the TLS identity of CRIU's lazy page server, once the dump ended (CRIU reads it when
		// its client connects); the caller removes it sooner, but may die first
		cleanups = append(cleanups, func() { _ = os.RemoveAll(checkpoint.LazyTLSDir(opts.WorkPath)) })
	}
	if lazy != "" && opts.Exit {
		return fmt.Errorf("checkpoint %s: lazy mode keeps the task frozen until its pages are served; it cannot exit with the dump: %w", r.ID, errdefs.ErrInvalidArgument)
	}
	g, err := s.beginGPUCheckpoint(ctx, r.ID, st)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	ph := checkpoint.NewPhases(s.deps.Now)
	if g != nil {
		ph.Add(g.phases.List()...)
	}
	created := s.deps.Now()
	var (
		known map[string]checkpoint.File
		ld    *lazyDump
	)
	if lazy != "" {
		ld, known, err = s.dumpLazy(ctx, r, st, opts.WorkPath, lazy, g, ph)
		if err != nil {
			return err
		}
		defer func() {
			if retErr != nil { // the rest failed: end the page server, so that the task is left as it was
				ld.abort(ctx)
			}
		}()
	} else {
		if known, err = s.dump(ctx, r, opts.WorkPath, g, ph); err != nil {
			if st.Status == task.Status_PAUSED {
				// a CRIU that died mid-dump leaves the cgroup it thawed thawed (lazy.go: refreeze)
				if ferr := refreeze(int(st.Pid)); ferr != nil {
					log.G(ctx).WithError(ferr).Error("failed dump: freezing the paused task's cgroup again failed")
				}
			}
			return err
		}
	}
	if g != nil && !opts.Exit && ld == nil {
		n := g.phases.Len()
		if err := g.release(ctx); err != nil {
			return fmt.Errorf("checkpoint %s: written, but giving the GPUs back failed: %w", r.ID, err)
		}
		ph.Add(g.phases.List()[n:]...)
	}
	var pages *checkpoint.PageStream
	if armed != nil {
		ps, err := armed.wait(ctx)
		if err != nil {
			return fmt.Errorf("checkpoint %s: dumped, but its memory did not reach the destination: %w", r.ID, err)
		}
		pages = &ps
	}
	if err := s.writeRootfsDiff(ctx, r); err != nil {
		return err
	}
	if err := writeTmpfs(ctx, spec, r.Path); err != nil {
		return fmt.Errorf("checkpoint %s: written, but the contents of its pod's tmpfs mounts were not: %w", r.ID, err)
	}
	m, err := s.manifest(ctx, r.ID, spec, opts.WorkPath, g, ph, created, ld != nil)
	if err != nil {
		return err
	}
	m.PageStream = pages // signed below with the rest
	if err := s.writeManifest(ctx, r, m, known, ph); err != nil {
		return err
	}
	if err := checkpoint.RestrictModes(r.Path); err != nil {
		return fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	if err := s.sign(ctx, r); err != nil {
		return err
	}
	if ld != nil {
		background = true
		ld.handOff(ctx, s, cleanups)
	}
	return nil
}

// writeRootfsDiff writes the changes of the task's writable layer into the CRIU image directory
// (checkpoint.ImagesRootfsDiffFile), so that the images' signed manifest covers them: a CRI
// checkpoint's own rootfs-diff.tar is written by containerd after the shim returns, and nothing
// the shim signs can cover it. A task whose root filesystem is not an overlay gets none.
func (s *Service) writeRootfsDiff(ctx context.Context, r *taskAPI.CheckpointTaskRequest) error {
	s.mu.Lock()
	mounts := s.rootfs[r.ID]
	s.mu.Unlock()
	wrote, err := writeRootfsDiff(ctx, mounts, filepath.Join(r.Path, checkpoint.ImagesRootfsDiffFile))
	if err != nil {
		return fmt.Errorf("checkpoint %s: written, but its rootfs diff was not: %w", r.ID, err)
	}
	if !wrote {
		log.G(ctx).Info("root filesystem is not an overlay with an upper directory: no rootfs diff beside the images")
	}
	return nil
}

// sign signs the manifest in r.Path with the node's key (berth.sig, 0600). Without a signing key
// the checkpoint stays unsigned, with a warning: only nodes that allow unsigned checkpoints
// restore it.
func (s *Service) sign(ctx context.Context, r *taskAPI.CheckpointTaskRequest) error {
	id, err := s.deps.Trust.Sign(ctx, r.Path)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	if id == "" {
		log.G(ctx).WithField("path", r.Path).Warnf("checkpoint written unsigned: no signing_key in %s; nodes that do not set allow_unsigned refuse to restore it", s.configName())
		return nil
	}
	log.G(ctx).WithFields(log.Fields{"path": r.Path, "key": id}).Info("checkpoint signed")
	return nil
}

// checkpointable returns the task's state when it can be checkpointed: running or paused, and an
// image path given. Otherwise the error names the status (errdefs.ErrFailedPrecondition) or the
// missing path (errdefs.ErrInvalidArgument).
func (s *Service) checkpointable(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*taskAPI.StateResponse, error) {
	st, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: r.ID})
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	if st.Status != task.Status_RUNNING && st.Status != task.Status_PAUSED {
		return nil, fmt.Errorf("checkpoint %s: task is %s, not running: %w",
			r.ID, strings.ToLower(st.Status.String()), errdefs.ErrFailedPrecondition)
	}
	if r.Path == "" {
		return nil, fmt.Errorf("checkpoint %s: no image path given: %w", r.ID, errdefs.ErrInvalidArgument)
	}
	return st, nil
}

// leasedCheckpointDir is what an expired pause lease removes of a checkpoint written into
// imagePath (the CRIU images: the task's memory) with CRIU work directory workPath: workPath
// when the caller named it and the images lie inside it (berthctl's layout: DIR/checkpoint with
// DIR as work path, DIR holding the rest of the checkpoint), else the images directory alone.
// It is "" (nothing) when imagePath is not an absolute path below "/".
func leasedCheckpointDir(imagePath, workPath, bundle string) string {
	if !filepath.IsAbs(imagePath) || filepath.Clean(imagePath) == "/" {
		return ""
	}
	imagePath = filepath.Clean(imagePath)
	if filepath.IsAbs(workPath) {
		workPath = filepath.Clean(workPath)
		if workPath != filepath.Join(bundle, shimCRIUWorkDir) && workPath != "/" && strings.HasPrefix(imagePath, workPath+"/") {
			return workPath
		}
	}
	return imagePath
}

// shimCRIUWorkDir is the CRIU work directory, in the bundle, of a checkpoint whose caller names
// none (criuWorkDir).
const shimCRIUWorkDir = "berth-criu-work"

// criuWorkDir returns r's runc checkpoint options with a CRIU work directory: the caller's, or
// berth-criu-work beside the bundle, created now and written back into r.Options. done removes a
// directory the shim created.
func (s *Service) criuWorkDir(r *taskAPI.CheckpointTaskRequest, bundle string) (_ *options.CheckpointOptions, done func(), _ error) {
	done = func() {}
	opts := &options.CheckpointOptions{}
	if r.Options != nil && r.Options.GetValue() != nil {
		if err := typeurl.UnmarshalTo(r.Options, opts); err != nil {
			return nil, done, fmt.Errorf("checkpoint %s: options: %w", r.ID, err)
		}
	}
	if opts.WorkPath != "" {
		return opts, done, nil
	}
	workDir := filepath.Join(bundle, shimCRIUWorkDir)
	if err := os.MkdirAll(workDir, 0o700); err != nil {
		return nil, done, fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	done = func() { os.RemoveAll(workDir) }
	opts.WorkPath = workDir
	anyOpts, err := typeurl.MarshalAnyToProto(opts)
	if err != nil {
		done()
		return nil, func() {}, err
	}
	r.Options = anyOpts
	return opts, done, nil
}

// dump has runc/CRIU write the task's images into r.Path (phase criu-dump) while they are hashed
// (tailDigester), and returns the digests known at the end. If the dump fails, the GPU session is
// undone (the workload keeps running, its GPUs unlocked) and the error carries the last errors of
// CRIU's log, or says that CRIU refused its options when it wrote no log.
func (s *Service) dump(ctx context.Context, r *taskAPI.CheckpointTaskRequest, workDir string, g *gpuSession, ph *checkpoint.Phases) (_ map[string]checkpoint.File, retErr error) {
	defer func() {
		if retErr != nil && g != nil {
			g.abort(ctx)
		}
	}()
	tail := startTailDigester(ctx, r.Path) // hash the images while CRIU writes them
	err := ph.Time("criu-dump", func() error {
		_, err := s.TTRPCTaskService.Checkpoint(ctx, r)
		return errgrpc.ToNative(err)
	})
	known := tail.finish()
	if err == nil {
		return known, nil
	}
	return nil, s.explainDump(err, workDir)
}

// manifest builds the checkpoint's manifest (without its files): the container (with its
// Kubernetes namespace, pod, name and image from spec's CRI annotations) and its security context
// (privilege.FromSpec of spec), CRIU's dump
// statistics from workDir (logged, not fatal, when missing; none for postCopy, a lazy dump), this node's fingerprint with the
// container's GPUs instead of the node's (none for a container without GPUs: it can be restored
// on any node), the GPU state, and the phases so far plus fingerprint. created is when the dump
// began.
func (s *Service) manifest(ctx context.Context, id string, spec *specs.Spec, workDir string, g *gpuSession, ph *checkpoint.Phases, created time.Time, postCopy bool) (*checkpoint.Manifest, error) {
	security := privilege.FromSpec(spec)
	m := &checkpoint.Manifest{
		Version: checkpoint.ManifestVersion,
		Created: created.UTC(),
		Container: checkpoint.ContainerInfo{
			ID:                  id,
			KubernetesNamespace: spec.Annotations[oci.AnnotationCRISandboxNamespace],
			Pod:                 spec.Annotations[oci.AnnotationCRISandboxName],
			ContainerName:       spec.Annotations[oci.AnnotationCRIContainerName],
			Image:               spec.Annotations[oci.AnnotationCRIImageName],
			Runtime:             oci.RuntimeName,
		},
		Security: &security,
		PostCopy: postCopy,
	}
	err := ph.Time("fingerprint", func() error {
		if postCopy {
			// a lazy dump writes its statistics only once every page is served, and they say
			// nothing then (CRIU counts no pages and the whole wait as frozen time)
		} else if stats, err := s.deps.DumpStats(workDir); err != nil {
			log.G(ctx).WithError(err).Warn("no CRIU dump statistics")
		} else {
			m.CRIU = stats
		}
		fp, err := s.deps.Fingerprint(ctx)
		if err != nil {
			return fmt.Errorf("checkpoint %s: fingerprint: %w", id, err)
		}
		m.Fingerprint = fp
		m.Fingerprint.GPUs = nil
		if g != nil {
			m.GPU = g.manifestState()
			m.Fingerprint.GPUs = g.fingerprintGPUs()
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	m.Phases = ph.List()
	return m, nil
}

// writeManifest digests r.Path's files (those in known are not read again) and writes m there.
func (s *Service) writeManifest(ctx context.Context, r *taskAPI.CheckpointTaskRequest, m *checkpoint.Manifest, known map[string]checkpoint.File, ph *checkpoint.Phases) error {
	end := ph.Start("manifest") // logged only: the manifest cannot hold its own writing
	var err error
	if m.Files, m.ImageSize, err = checkpoint.DigestDirKnown(r.Path, known); err != nil {
		return fmt.Errorf("checkpoint %s: digest images: %w", r.ID, err)
	}
	if err := checkpoint.WriteManifest(r.Path, m); err != nil {
		return fmt.Errorf("checkpoint %s: write manifest: %w", r.ID, err)
	}
	end()
	fields := log.Fields{"path": r.Path, "bytes": m.ImageSize}
	for _, p := range ph.List() {
		switch p.Name {
		case "criu-dump":
			fields["criu_ms"] = p.Ms
		case "manifest":
			fields["manifest_ms"] = p.Ms
		}
	}
	log.G(ctx).WithFields(fields).Info("checkpoint written")
	return nil
}
