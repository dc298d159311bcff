package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// criuConfigName is the file the shim writes into each bundle and points org.criu.config at.
const criuConfigName = "berth-criu.conf"

// Deps are the shim's outside dependencies, passed in so tests can replace them.
type Deps struct {
	// Fingerprint returns this node's fingerprint (fingerprint.Collect with real probes).
	Fingerprint func(ctx context.Context) (fingerprint.Fingerprint, error)
	// DumpStats reads CRIU's stats-dump from a CRIU work directory (criu.ReadDumpStats).
	DumpStats func(workDir string) (checkpoint.CRIUStats, error)
	// Now is the clock.
	Now func() time.Time
	// GPU is the node's GPU backend (driver, inventory, container device convention); nil on a
	// node without GPUs, where a GPU container's checkpoint cannot be restored.
	GPU gpu.Backend
}

// Service is the berth task service: runc's task service with berth's checkpoint and restore.
// Every method it does not define is runc's, unchanged.
type Service struct {
	taskAPI.TTRPCTaskService

	cfg  Config
	deps Deps

	mu    sync.Mutex
	plans map[string]*restorePlan // task id -> checkpoint it is restored from, until Start returns
	// ownNetns holds the ids of tasks created from a checkpoint whose network namespace runc
	// creates (no path in the spec): Start sets their loopback up after CRIU restored them.
	ownNetns map[string]bool
	// stdinHolds are the stdin FIFOs held open for restored tasks (restoreStdio).
	stdinHolds map[string]*os.File
}

// NewService wraps inner (containerd's runc task service) with berth's steps.
func NewService(inner taskAPI.TTRPCTaskService, cfg Config, deps Deps) *Service {
	if deps.Now == nil {
		deps.Now = time.Now
	}
	return &Service{TTRPCTaskService: inner, cfg: cfg, deps: deps, plans: map[string]*restorePlan{}, ownNetns: map[string]bool{}, stdinHolds: map[string]*os.File{}}
}

// RegisterTTRPC registers the wrapper (not the inner service) as the task service.
func (s *Service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, s)
	return nil
}

// Create creates the task. A spec with berth.dev/restore-from (a path under the checkpoint root
// or an oci:// reference from an allowed registry), or a request whose checkpoint directory (from
// containerd) carries a berth manifest, is validated first: resolved inside the checkpoint root,
// digests verified, fingerprint compared, Kubernetes namespace checked, and for GPU checkpoints
// the destination GPUs checked and mapped (the spec is rewritten to give the container the mapped
// GPUs). Nothing is created when validation fails; the error names the cause and the value
// (errdefs classes InvalidArgument, NotFound, FailedPrecondition, PermissionDenied). A restored
// task gets pipes for the standard streams it has none for (restoreStdio).
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", r.ID))
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	plan, err := s.prepareRestore(ctx, r, spec)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("restore %s: %w", r.ID, err))
	}
	defer func() {
		if retErr != nil && plan != nil {
			plan.cleanup()
		}
	}()
	specChanged := false
	if plan != nil && plan.manifest != nil && plan.manifest.GPU != nil {
		// before anything is created: can this node take the checkpoint's GPUs?
		if plan.gpuPairs, err = s.planGPURestore(spec, plan.manifest.GPU); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("restore %s: %w", r.ID, err))
		}
		specChanged = true
	}
	changed, err := s.setCRIUConfig(r.Bundle, spec)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if changed || specChanged {
		if err := writeSpec(r.Bundle, spec); err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
	}
	if plan != nil {
		r.Checkpoint = plan.imagesDir
	}
	if r.Checkpoint != "" {
		hold, err := restoreStdio(r)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		if hold != nil {
			defer func() {
				if retErr != nil {
					hold.Close()
					return
				}
				s.mu.Lock()
				s.stdinHolds[r.ID] = hold
				s.mu.Unlock()
			}()
		}
	}
	resp, err := s.TTRPCTaskService.Create(ctx, r)
	if err != nil {
		return resp, err
	}
	if r.Checkpoint != "" && ownsNetns(spec) {
		s.mu.Lock()
		s.ownNetns[r.ID] = true
		s.mu.Unlock()
	}
	if plan == nil {
		return resp, nil
	}
	defer func() {
		if retErr != nil {
			// nothing half-created: remove the task runc created from the checkpoint
			if _, derr := s.TTRPCTaskService.Delete(ctx, &taskAPI.DeleteRequest{ID: r.ID}); derr != nil {
				log.G(ctx).WithError(derr).Warn("remove task after failed restore preparation")
			}
		}
	}()
	if err := plan.applyRootfsDiff(ctx, filepath.Join(r.Bundle, "rootfs")); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("restore %s: %w", r.ID, err))
	}
	s.mu.Lock()
	s.plans[r.ID] = plan
	s.mu.Unlock()
	log.G(ctx).WithField("checkpoint", plan.dir).Info("task created from berth checkpoint; Start restores it with CRIU")
	return resp, nil
}

// Start starts the task; a task created from a berth checkpoint is restored by CRIU here (runc
// restore). An archive extracted for the restore is removed once Start returns.
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	if r.ExecID != "" {
		return s.TTRPCTaskService.Start(ctx, r)
	}
	s.mu.Lock()
	plan, netns := s.plans[r.ID], s.ownNetns[r.ID]
	delete(s.plans, r.ID)
	delete(s.ownNetns, r.ID)
	s.mu.Unlock()
	if plan != nil {
		defer plan.cleanup()
	}
	start := s.deps.Now()
	resp, err := s.TTRPCTaskService.Start(ctx, r)
	if err != nil || (plan == nil && !netns) {
		return resp, err
	}
	if netns {
		if err := loopbackUp(int(resp.Pid)); err != nil {
			log.G(ctx).WithError(err).Warn("restored task's loopback stays down")
		}
	}
	if plan != nil && len(plan.gpuPairs) > 0 {
		if _, err := s.restoreGPUs(ctx, r.ID, plan.gpuPairs); err != nil {
			// the driver cannot roll a failed GPU restore back: do not leave a task without its
			// device memory running; the checkpoint is untouched and can be restored again
			if _, kerr := s.TTRPCTaskService.Kill(ctx, &taskAPI.KillRequest{ID: r.ID, Signal: 9, All: true}); kerr != nil {
				log.G(ctx).WithError(kerr).Error("kill task after failed GPU restore")
			} else {
				// wait for the exit: the caller deletes the task next, which needs it stopped
				_, _ = s.TTRPCTaskService.Wait(ctx, &taskAPI.WaitRequest{ID: r.ID})
			}
			return nil, errgrpc.ToGRPC(fmt.Errorf("restore %s: %w; the task was killed, the checkpoint %s is intact", r.ID, err, plan.dir))
		}
	}
	log.G(ctx).WithFields(log.Fields{"id": r.ID, "restore_ms": ms(s.deps.Now().Sub(start))}).Info("restored with CRIU")
	return resp, nil
}

// ownsNetns reports whether the spec gives the container a network namespace of its own that
// runc creates (type network without a path).
func ownsNetns(spec *specs.Spec) bool {
	if spec.Linux == nil {
		return false
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			return ns.Path == ""
		}
	}
	return false
}

// Delete deletes the task or exec, and forgets a restore that never started.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	if r.ExecID == "" {
		s.mu.Lock()
		plan := s.plans[r.ID]
		delete(s.plans, r.ID)
		delete(s.ownNetns, r.ID)
		hold := s.stdinHolds[r.ID]
		delete(s.stdinHolds, r.ID)
		s.mu.Unlock()
		if plan != nil {
			plan.cleanup()
		}
		if hold != nil {
			defer hold.Close()
		}
	}
	return s.TTRPCTaskService.Delete(ctx, r)
}

// Checkpoint dumps the task with runc/CRIU into r.Path and writes the berth manifest there. The
// task must be running or paused (containerd pauses it first); otherwise the error is of class
// errdefs.ErrFailedPrecondition and names the status. When the caller gives no CRIU work
// directory, the shim uses its own beside the bundle and removes it afterwards.
func (s *Service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", r.ID))
	st, err := s.TTRPCTaskService.State(ctx, &taskAPI.StateRequest{ID: r.ID})
	if err != nil {
		return nil, err
	}
	if st.Status != task.Status_RUNNING && st.Status != task.Status_PAUSED {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: task is %s, not running: %w",
			r.ID, strings.ToLower(st.Status.String()), errdefs.ErrFailedPrecondition))
	}
	if r.Path == "" {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: no image path given: %w", r.ID, errdefs.ErrInvalidArgument))
	}
	opts := &options.CheckpointOptions{}
	if r.Options != nil && r.Options.GetValue() != nil {
		if err := typeurl.UnmarshalTo(r.Options, opts); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: options: %w", r.ID, err))
		}
	}
	workDir := opts.WorkPath
	if workDir == "" {
		workDir = filepath.Join(st.Bundle, "berth-criu-work")
		if err := os.MkdirAll(workDir, 0o700); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: %w", r.ID, err))
		}
		defer os.RemoveAll(workDir)
		opts.WorkPath = workDir
		anyOpts, err := typeurl.MarshalAnyToProto(opts)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		r.Options = anyOpts
	}

	g, err := s.beginGPUCheckpoint(ctx, r.ID, st)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: %w", r.ID, err))
	}
	start := s.deps.Now()
	tail := startTailDigester(ctx, r.Path) // hash the images while CRIU writes them
	if _, err := s.TTRPCTaskService.Checkpoint(ctx, r); err != nil {
		tail.finish()
		if g != nil {
			g.abort(context.WithoutCancel(ctx)) // the workload keeps running, its GPUs unlocked
		}
		if tail := criuErrors(filepath.Join(workDir, checkpoint.DumpLogFile), 4); tail != "" {
			return nil, errgrpc.ToGRPC(fmt.Errorf("%w; CRIU says: %s", errgrpc.ToNative(err), tail))
		}
		if _, serr := os.Stat(filepath.Join(workDir, checkpoint.DumpLogFile)); serr != nil {
			// CRIU stopped before it opened its log: it refused its options
			return nil, errgrpc.ToGRPC(fmt.Errorf("%w; CRIU wrote no log, so it refused its options: check criu_options in %s and the bundle's %s",
				errgrpc.ToNative(err), s.cfg.Path, criuConfigName))
		}
		return nil, err
	}
	dumped := s.deps.Now()
	known := tail.finish()
	var phases []checkpoint.Phase
	if g != nil {
		for _, st := range g.steps {
			phases = append(phases, checkpoint.Phase{Name: st.Name, Ms: st.Ms})
		}
	}
	phases = append(phases, checkpoint.Phase{Name: "criu-dump", Ms: ms(dumped.Sub(start))})
	if g != nil && !opts.Exit {
		n := len(g.steps)
		if err := g.release(ctx); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: written, but giving the GPUs back failed: %w", r.ID, err))
		}
		phases = append(phases, g.steps[n:]...)
		dumped = s.deps.Now()
	}
	m := &checkpoint.Manifest{
		Version: checkpoint.ManifestVersion,
		Created: start.UTC(),
		Container: checkpoint.ContainerInfo{
			ID:      r.ID,
			Runtime: oci.RuntimeName,
		},
		Phases: phases,
	}
	if stats, err := s.deps.DumpStats(workDir); err != nil {
		log.G(ctx).WithError(err).Warn("no CRIU dump statistics")
	} else {
		m.CRIU = stats
	}
	if fp, err := s.deps.Fingerprint(ctx); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: fingerprint: %w", r.ID, err))
	} else {
		m.Fingerprint = fp
	}
	// a checkpoint's fingerprint lists the container's GPUs, not the node's (none for a
	// container without GPUs: it can be restored on any node)
	m.Fingerprint.GPUs = nil
	if g != nil {
		g.state.Steps = g.steps
		m.GPU = g.state
		m.Fingerprint.GPUs = g.fingerprintGPUs()
	}
	m.Phases = append(m.Phases, checkpoint.Phase{Name: "fingerprint", Ms: ms(s.deps.Now().Sub(dumped))})
	t := s.deps.Now()
	var err2 error
	if m.Files, m.ImageSize, err2 = checkpoint.DigestDirKnown(r.Path, known); err2 != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: digest images: %w", r.ID, err2))
	}
	if err := checkpoint.WriteManifest(r.Path, m); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("checkpoint %s: write manifest: %w", r.ID, err))
	}
	log.G(ctx).WithFields(log.Fields{
		"path": r.Path, "bytes": m.ImageSize, "criu_ms": ms(dumped.Sub(start)), "manifest_ms": ms(s.deps.Now().Sub(t)),
	}).Info("checkpoint written")
	return &ptypes.Empty{}, nil
}

// setCRIUConfig writes the bundle's CRIU configuration file and points runc at it through the
// org.criu.config annotation, unless the spec already names another file. It reports whether
// spec changed (the caller writes config.json).
func (s *Service) setCRIUConfig(bundle string, spec *specs.Spec) (bool, error) {
	path := filepath.Join(bundle, criuConfigName)
	if cur, ok := spec.Annotations[oci.AnnotationCRIUConfig]; ok && filepath.Base(cur) != criuConfigName {
		return false, nil // the user chose their own CRIU configuration
	}
	body := strings.Join(s.cfg.CRIUOptions, "\n") + "\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		return false, fmt.Errorf("write CRIU config: %w", err)
	}
	if spec.Annotations == nil {
		spec.Annotations = map[string]string{}
	}
	if spec.Annotations[oci.AnnotationCRIUConfig] == path {
		return false, nil
	}
	spec.Annotations[oci.AnnotationCRIUConfig] = path
	return true, nil
}

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("parse bundle spec %s: %w", filepath.Join(bundle, "config.json"), withClass(err, errdefs.ErrInvalidArgument))
	}
	return &spec, nil
}

func writeSpec(bundle string, spec *specs.Spec) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	p := filepath.Join(bundle, "config.json")
	tmp := p + ".berth"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	return os.Rename(tmp, p)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// criuErrors returns the last n error lines of a CRIU log, joined with " | ", or "".
func criuErrors(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") || strings.Contains(l, "error") {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > n {
		errs = errs[len(errs)-n:]
	}
	return strings.Join(errs, " | ")
}
