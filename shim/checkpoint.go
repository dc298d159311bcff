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

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// checkpoint is Checkpoint with native errors, in steps: check the task, set CRIU's work
// directory, take the GPU session forward, dump, give the GPUs back unless the task exits, build
// and write the manifest.
func (s *Service) checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) error {
	st, err := s.checkpointable(ctx, r)
	if err != nil {
		return err
	}
	opts, done, err := s.criuWorkDir(r, st.Bundle)
	if err != nil {
		return err
	}
	defer done()
	g, err := s.beginGPUCheckpoint(ctx, r.ID, st)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	ph := checkpoint.NewPhases(s.deps.Now)
	if g != nil {
		ph.Add(g.phases.List()...)
	}
	created := s.deps.Now()
	known, err := s.dump(ctx, r, opts.WorkPath, g, ph)
	if err != nil {
		return err
	}
	if g != nil && !opts.Exit {
		n := g.phases.Len()
		if err := g.release(ctx); err != nil {
			return fmt.Errorf("checkpoint %s: written, but giving the GPUs back failed: %w", r.ID, err)
		}
		ph.Add(g.phases.List()[n:]...)
	}
	m, err := s.manifest(ctx, r.ID, opts.WorkPath, g, ph, created)
	if err != nil {
		return err
	}
	return s.writeManifest(ctx, r, m, known, ph)
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
	workDir := filepath.Join(bundle, "berth-criu-work")
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
	logPath := filepath.Join(workDir, checkpoint.DumpLogFile)
	if tail := criuErrors(logPath, 4); tail != "" {
		return nil, fmt.Errorf("%w; CRIU says: %s", err, tail)
	}
	if _, serr := os.Stat(logPath); serr != nil {
		// CRIU stopped before it opened its log: it refused its options
		return nil, fmt.Errorf("%w; CRIU wrote no log, so it refused its options: check criu_options in %s and the bundle's %s",
			err, s.cfg.Path, criuConfigName)
	}
	return nil, err
}

// manifest builds the checkpoint's manifest (without its files): the container, CRIU's dump
// statistics from workDir (logged, not fatal, when missing), this node's fingerprint with the
// container's GPUs instead of the node's (none for a container without GPUs: it can be restored
// on any node), the GPU state, and the phases so far plus fingerprint. created is when the dump
// began.
func (s *Service) manifest(ctx context.Context, id, workDir string, g *gpuSession, ph *checkpoint.Phases, created time.Time) (*checkpoint.Manifest, error) {
	m := &checkpoint.Manifest{
		Version:   checkpoint.ManifestVersion,
		Created:   created.UTC(),
		Container: checkpoint.ContainerInfo{ID: id, Runtime: oci.RuntimeName},
	}
	err := ph.Time("fingerprint", func() error {
		if stats, err := s.deps.DumpStats(workDir); err != nil {
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
