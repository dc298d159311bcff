package move

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	tasks "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types/runc/options"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/diff"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/rootfs"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// CheckpointOptions say what to checkpoint and where.
type CheckpointOptions struct {
	// Namespace and ID name the container on the source containerd.
	Namespace, ID string
	// Dir is the checkpoint directory to create; it must not exist.
	Dir string
	// Exit makes CRIU end the task after the dump (ctr's --exit). Without it the task stays
	// paused when Checkpoint returns, so the caller decides: Resume it (leave-running, or the move
	// failed) or stop it (the destination restore succeeded).
	Exit bool
	// Sign signs the checkpoint directory once its berth.json is written (signature.Policy.Sign:
	// berth.sig beside it) and returns the key's id; "" with a nil error leaves it unsigned.
	// nil: unsigned.
	Sign func(ctx context.Context, dir string) (string, error)
	// PageServer, when set, asks the shim for a copy-mode dump: CRIU sends the memory pages to
	// this loopback ADDR:PORT (a transfer.PageRelay) instead of writing them into Dir.
	// PageStream then returns the stream's digest and length once it ended; it goes into the
	// manifest, under the signature.
	PageServer string
	PageStream func(ctx context.Context) (checkpoint.PageStream, error)
	// LazyPages, when set, asks the shim for a lazy (post-copy) dump: CRIU listens on this
	// loopback ADDR:PORT (a transfer.LazyRelay's) once everything but the memory is dumped, and
	// Checkpoint returns then, the checkpoint marked PostCopy, while the task stays frozen and
	// CRIU serves its pages (until they are all served, or the stream fails).
	LazyPages string
	// LazyStream, with LazyPages, is the ID of the lazy page stream (transfer.LazyRelay.ID),
	// recorded in the signed manifest (checkpoint.Manifest.LazyStream).
	LazyStream string
	// LazyTLS, with LazyPages, is the TLS identity of CRIU's lazy page server
	// (transfer.LazyRelay.ServerTLS), written to checkpoint.LazyTLSDir(Dir) before the task is
	// paused; the shim refuses a lazy dump without it. Checkpoint removes that directory when it
	// fails; after a success the caller removes it once its relay connected to CRIU.
	LazyTLS checkpoint.LazyTLS
	// PauseLease, when positive, is a pause lease held on the task from before it is paused
	// until the caller resumes or stops it (Source.Resume, Source.Release): berth's shim resumes
	// the task by itself if this process dies meanwhile (oci.AnnotationPauseLease).
	PauseLease time.Duration
}

// Source is a checkpointed container on the source node.
type Source struct {
	// Task is the source task, paused (nil when Exit was set).
	Task containerd.Task
	// Manifest is the checkpoint's berth manifest, as written to Dir/berth.json.
	Manifest *checkpoint.Manifest
	// Dir is the checkpoint directory.
	Dir string
	// SignedBy is the id of the key that signed it ("" when unsigned).
	SignedBy string
	// Spec is the container's OCI spec as the source's containerd reports it (what spec.dump
	// holds); nil when containerd has none.
	Spec *specs.Spec
	// lease is the pause lease held on Task (nil without one).
	lease *pauseLease
}

// Resume thaws a paused source task (leave-running, or a failed move) and releases its pause
// lease.
func (s *Source) Resume(ctx context.Context) error {
	if s.Task == nil {
		return nil
	}
	err := s.Task.Resume(ctx)
	s.lease.release(ctx)
	return err
}

// StopLease stops renewing the source's pause lease once the caller stopped the task (the move
// succeeded); the lease is not released, so a task that somehow outlives it paused is ended by
// it (resumed, or killed once committed).
func (s *Source) StopLease() { s.lease.stopRenewing() }

// CommitLease tells the source's shim that the move is decided (the destination runs the
// container): should this process die before it stops the source, the lease's end kills the
// paused source instead of resuming it, so the two never run at once.
func (s *Source) CommitLease(ctx context.Context) error { return s.lease.commit(ctx) }

// Checkpoint pauses the container's task, has berth's shim dump it with CRIU into Dir/checkpoint
// (no content store), saves the writable layer's changes as Dir/rootfs-diff.tar, the spec and the
// container's metadata, writes Dir/berth.json covering every file and signs it (Sign). Every
// file is left mode 0600 and every directory 0700: they hold the process's memory. On error the task is
// resumed and Dir removed: the container keeps running exactly as before. Errors: the container
// or task is missing (errdefs.ErrNotFound), the task is not running (errdefs.ErrFailedPrecondition,
// naming its status), and the shim's or CRIU's error.
func Checkpoint(ctx context.Context, c *containerd.Client, o CheckpointOptions) (_ *Source, retErr error) {
	ctx = namespaces.WithNamespace(ctx, o.Namespace)
	var phases []checkpoint.Phase
	t0 := time.Now()
	phase := func(name string) {
		now := time.Now()
		phases = append(phases, checkpoint.Phase{Name: name, Ms: float64(now.Sub(t0).Microseconds()) / 1000})
		t0 = now
	}
	ctr, err := c.LoadContainer(ctx, o.ID)
	if err != nil {
		return nil, fmt.Errorf("container %s in namespace %s: %w", o.ID, o.Namespace, err)
	}
	info, err := ctr.Info(ctx)
	if err != nil {
		return nil, err
	}
	task, err := ctr.Task(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("container %s has no task: %w", o.ID, err)
	}
	st, err := task.Status(ctx)
	if err != nil {
		return nil, err
	}
	if isPaused(st.Status) {
		return nil, fmt.Errorf("checkpoint %s: task is paused, not running (%s): %w", o.ID, pausedHint(o.Namespace, o.ID), errdefs.ErrFailedPrecondition)
	}
	if st.Status != containerd.Running {
		return nil, fmt.Errorf("checkpoint %s: task is %s, not running: %w", o.ID, st.Status, errdefs.ErrFailedPrecondition)
	}
	var imageDigest string
	if info.Image != "" {
		if img, err := c.GetImage(ctx, info.Image); err == nil {
			imageDigest = img.Target().Digest.String()
		}
	}
	if _, err := os.Stat(o.Dir); err == nil {
		return nil, fmt.Errorf("checkpoint directory %s already exists: %w", o.Dir, errdefs.ErrAlreadyExists)
	}
	images := filepath.Join(o.Dir, checkpoint.ImagesDir)
	if err := os.MkdirAll(images, 0o700); err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil {
			os.RemoveAll(o.Dir)
		}
	}()
	if o.PageServer != "" {
		if err := os.WriteFile(filepath.Join(o.Dir, checkpoint.PageServerRequestFile), []byte(o.PageServer+"\n"), 0o600); err != nil {
			return nil, err
		}
	}
	if o.LazyPages != "" {
		if o.Exit || o.PageServer != "" {
			return nil, fmt.Errorf("checkpoint %s: lazy mode takes neither Exit nor a page server: %w", o.ID, errdefs.ErrInvalidArgument)
		}
		if err := os.WriteFile(filepath.Join(o.Dir, checkpoint.LazyPagesRequestFile), []byte(o.LazyPages+"\n"), 0o600); err != nil {
			return nil, err
		}
		if err := checkpoint.WriteLazyTLS(o.Dir, o.LazyTLS); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
		}
		defer func() {
			if retErr != nil {
				os.RemoveAll(checkpoint.LazyTLSDir(o.Dir))
			}
		}()
	}
	var lease *pauseLease
	if o.PauseLease > 0 && !o.Exit {
		// before the pause: a kill between the pause and the grant must not strand the task
		if lease, err = holdLease(ctx, task, o.PauseLease); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
		}
		defer func() {
			if retErr != nil {
				lease.release(ctx)
			}
		}()
	}
	if err := task.Pause(ctx); err != nil {
		return nil, fmt.Errorf("pause %s: %w", o.ID, err)
	}
	defer func() {
		if retErr != nil && !o.Exit {
			if err := task.Resume(context.WithoutCancel(ctx)); err != nil {
				log.G(ctx).WithError(err).Error("resume source task after failed checkpoint")
			}
		}
	}()
	phase("pause")

	opts, err := typeurl.MarshalAnyToProto(&options.CheckpointOptions{
		Exit: o.Exit, ImagePath: images, WorkPath: o.Dir,
	})
	if err != nil {
		return nil, err
	}
	if _, err := c.TaskService().Checkpoint(ctx, &tasks.CheckpointTaskRequest{ContainerID: o.ID, Options: opts}); err != nil {
		err = errgrpc.ToNative(err)
		if o.PageStream != nil { // copy mode: a broken page stream is the likelier cause; say how it ended
			wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			if _, perr := o.PageStream(wctx); perr != nil && wctx.Err() == nil {
				err = fmt.Errorf("%w (the page stream to the destination: %v)", err, perr)
			}
			cancel()
		}
		if strings.HasPrefix(err.Error(), "checkpoint "+o.ID+":") { // the shim named it already
			return nil, err
		}
		return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
	}
	phase("shim-checkpoint")
	if o.LazyPages != "" {
		defer func() {
			if retErr != nil {
				// CRIU serves the pages from the frozen task: hang up on it first, so that it
				// fails the transfer and lets the task go (the resume above waits for that)
				abandonLazy(o.LazyPages)
			}
		}()
	}
	var pages *checkpoint.PageStream
	if o.PageServer != "" {
		if err := os.Remove(filepath.Join(o.Dir, checkpoint.PageServerRequestFile)); err != nil {
			return nil, err
		}
		if o.PageStream != nil {
			ps, err := o.PageStream(ctx)
			if err != nil {
				return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
			}
			pages = &ps
		}
		phase("page-stream")
	}
	if o.LazyPages != "" {
		if err := os.Remove(filepath.Join(o.Dir, checkpoint.LazyPagesRequestFile)); err != nil {
			return nil, err
		}
	}

	if info.SnapshotKey != "" {
		if err := writeRootfsDiff(ctx, c, info.Snapshotter, info.SnapshotKey, filepath.Join(o.Dir, checkpoint.RootfsDiffFile)); err != nil {
			return nil, fmt.Errorf("checkpoint %s: rootfs diff: %w", o.ID, err)
		}
	}
	phase("rootfs-diff")

	inner, err := checkpoint.ReadManifest(images)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: the shim wrote no berth manifest (is the container's runtime io.containerd.berth.v2? it is %s): %w", o.ID, info.Runtime.Name, err)
	}
	cinfo := checkpoint.ContainerInfo{
		ID: o.ID, Namespace: o.Namespace, Image: info.Image, ImageDigest: imageDigest,
		Runtime: info.Runtime.Name, SnapshotKey: info.SnapshotKey, Snapshotter: info.Snapshotter,
	}
	if err := writeJSON(filepath.Join(o.Dir, checkpoint.ConfigFile), cinfo); err != nil {
		return nil, err
	}
	var spec json.RawMessage
	if info.Spec != nil {
		spec = info.Spec.GetValue()
	}
	if err := os.WriteFile(filepath.Join(o.Dir, checkpoint.SpecFile), spec, 0o600); err != nil {
		return nil, err
	}
	var liveSpec *specs.Spec
	if len(spec) > 0 {
		liveSpec = &specs.Spec{}
		if err := json.Unmarshal(spec, liveSpec); err != nil {
			return nil, fmt.Errorf("checkpoint %s: the container's spec: %w", o.ID, err)
		}
	}
	m := &checkpoint.Manifest{
		Version:     checkpoint.ManifestVersion,
		Created:     time.Now().UTC(),
		Container:   cinfo,
		Fingerprint: inner.Fingerprint,
		CRIU:        inner.CRIU,
		GPU:         inner.GPU,
		PageStream:  pages,
		PostCopy:    inner.PostCopy,
		LazyStream:  o.LazyStream,
	}
	m.Fingerprint.ImageDigest = imageDigest
	// the shim just digested the CRIU images: reuse those digests instead of reading the images again
	known := map[string]checkpoint.File{}
	for _, f := range inner.Files {
		known[checkpoint.ImagesDir+"/"+f.Path] = checkpoint.File{Path: checkpoint.ImagesDir + "/" + f.Path, Size: f.Size, Digest: f.Digest}
	}
	if m.Files, m.ImageSize, err = checkpoint.DigestDirKnown(o.Dir, known); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
	}
	m.Phases = phases
	for _, p := range inner.Phases {
		m.Phases = append(m.Phases, checkpoint.Phase{Name: "shim/" + p.Name, Ms: p.Ms})
	}
	if err := checkpoint.WriteManifest(o.Dir, m); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
	}
	var signedBy string
	if o.Sign != nil {
		if signedBy, err = o.Sign(ctx, o.Dir); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
		}
	}
	// CRIU writes its images with its own modes (0644): only root may read process memory
	if err := checkpoint.RestrictModes(o.Dir); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", o.ID, err)
	}
	src := &Source{Task: task, Manifest: m, Dir: o.Dir, SignedBy: signedBy, Spec: liveSpec, lease: lease}
	if o.Exit {
		src.Task = nil
	}
	return src, nil
}

// abandonLazy ends a lazy dump whose page server listens at addr and has no client yet: it
// connects and hangs up, so that CRIU fails the transfer and leaves the task as it was.
func abandonLazy(addr string) {
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
	}
}

// writeRootfsDiff writes the changes of the container's writable snapshot as an uncompressed tar.
func writeRootfsDiff(ctx context.Context, c *containerd.Client, snapshotter, key, path string) error {
	ctx, done, err := c.WithLease(ctx)
	if err != nil {
		return err
	}
	defer done(context.WithoutCancel(ctx))
	desc, err := rootfs.CreateDiff(ctx, key, c.SnapshotService(snapshotter), c.DiffService(),
		diff.WithMediaType(ocispec.MediaTypeImageLayer), diff.WithReference("berth-rootfs-diff-"+key))
	if err != nil {
		return err
	}
	ra, err := c.ContentStore().ReaderAt(ctx, desc)
	if err != nil {
		return err
	}
	defer ra.Close()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, content.NewReader(ra)); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := c.ContentStore().Delete(ctx, desc.Digest); err != nil && !errdefs.IsNotFound(err) {
		log.G(ctx).WithError(err).Debug("remove rootfs diff blob")
	}
	return nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
