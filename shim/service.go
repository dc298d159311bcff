package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/core/mount"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/shim/helper"
)

// criuConfigName is the file the shim writes into each bundle and points org.criu.config at.
const criuConfigName = "berth-criu.conf"

// Deps are the shim's outside dependencies, passed in so tests can replace them.
type Deps struct {
	// Fingerprint returns this node's fingerprint (fingerprint.Collect with real probes).
	Fingerprint func(ctx context.Context) (fingerprint.Fingerprint, error)
	// DumpStats reads CRIU's stats-dump from a CRIU work directory (criu.ReadDumpStats).
	DumpStats func(workDir string) (checkpoint.CRIUStats, error)
	// Now is the clock: every phase the shim times (checkpoint.Phases), the manifest's Created
	// time, and the unique names of the shim's temporary directories. nil means time.Now.
	Now func() time.Time
	// GPU is the node's GPU backend (driver, inventory, container device convention); nil on a
	// node without GPUs, where a GPU container's checkpoint cannot be restored.
	GPU gpu.Backend
	// Trust is the trust policy (signature.LoadPolicy of the configuration's trust keys): it
	// signs the checkpoints this node writes and says whose checkpoints restore here. nil is a
	// policy without keys: checkpoints are written unsigned and every restore is refused.
	Trust *signature.Policy
	// ReadProcesses reads every thread's credentials from a CRIU image directory
	// (images.ReadProcesses, which RealDeps runs in berth-shim-helper so that go-criu's image
	// bindings are not part of every container's shim; nil: the helper, run without the
	// reaper); a restore compares them with the destination spec.
	ReadProcesses func(imagesDir string) ([]privilege.Process, error)
	// CheckSeccomp compares the seccomp filters of the processes in a CRIU image directory with
	// the filter runc installs for a spec's profile (helper.Client.CheckSeccomp: in
	// berth-shim-helper, which links runc's seccomp code; nil: the helper, run without the
	// reaper). Its errors match seccompbpf's sentinels.
	CheckSeccomp func(imagesDir string, profile *specs.LinuxSeccomp) error
	// Registry parses values, resolves tags and pulls checkpoints for berth.dev/restore-from=oci://...
	// restores. RealDeps runs berth-shim-helper for each call (helper.Client), so that the
	// registry client is not part of every container's shim process. nil: such restores fail.
	Registry Registry
}

// Registry parses berth.dev/restore-from=oci://... values and resolves and pulls checkpoints
// from registries (helper.Client, which runs berth-shim-helper; the tests serve its requests in
// their own process). ParseRestoreFrom parses the value v (reference.ParseRestoreFrom: its
// errors match checkpoint.ErrInvalidRef). Resolve returns the digest ("sha256:<hex>") of
// the OCI manifest ref ("host[:port]/repository:tag") names; Pull pulls the checkpoint ref names
// into the new directory dir, every digest verified, nothing left at dir on failure. Errors
// match (errors.Is) package registry's, archive's and checkpoint's sentinels and the registry's
// regdef.ErrNotFound.
type Registry interface {
	ParseRestoreFrom(ctx context.Context, v string) (regdef.RestoreFrom, error)
	Resolve(ctx context.Context, ref string, o helper.RegistryOptions) (string, error)
	Pull(ctx context.Context, ref, dir string, o helper.RegistryOptions) error
}

// Service is the berth task service: runc's task service with berth's checkpoint and restore.
// Every method it does not define is runc's, unchanged. The methods it defines return the task
// API's wire errors: the native errors of their steps, classified once by errorClass (one table
// from berth's sentinel errors to errdefs classes) with their messages unchanged.
type Service struct {
	taskAPI.TTRPCTaskService

	cfg  Config
	deps Deps

	mu sync.Mutex
	// tasks holds the record of every task created from a checkpoint, from Create until Delete.
	tasks map[string]*restoredTask
	// rootfs holds the root filesystem mounts of every task this shim created, from Create until
	// Delete: Checkpoint writes the rootfs diff from the overlay's upper directory.
	rootfs map[string][]mount.Mount
	// leases are the tasks' pause leases (lease.go).
	leases leases
	// lazy holds the lazy dumps whose pages CRIU still serves, by task (lazy.go).
	lazy map[string]*lazyDump
}

// restoreStatus is where a task created from a checkpoint stands in the shim.
type restoreStatus int

const (
	// restoreCreated: runc created the task from the checkpoint; Start restores it.
	restoreCreated restoreStatus = iota
	// restoreStarted: Start ran the restore (successfully or not); the plan is cleaned up, the
	// record stays for what the task holds until Delete.
	restoreStarted
)

// restoredTask is the shim's one record of a task created from a checkpoint (a berth checkpoint
// validated in Create, or one containerd passed in), from Create until Delete.
type restoredTask struct {
	status restoreStatus
	bundle string
	// plan is the validated berth checkpoint (nil for a containerd checkpoint without a berth
	// manifest); Start takes it and cleans it up.
	plan *restorePlan
	// ownNetns: runc creates the task's network namespace (no path in the spec), and Start sets
	// its loopback up after CRIU restored it.
	ownNetns bool
	// stdin is the FIFO held open as the task's stdin (restoreStdio); nil for none. Delete closes it.
	stdin *os.File
	// uts is the pod's UTS namespace the task joins, with its names as Create found them; Start
	// writes them back after CRIU restored the checkpoint's (uts.go). nil when the task has a UTS
	// namespace of its own.
	uts *utsNames
	// criuWork is the CRIU work directory the caller's runc options name ("" for the bundle):
	// a failed restore quotes and keeps CRIU's restore.log from there.
	criuWork string
	// lazy is the lazy guard's verdict on a task restored lazily (post-copy); nil otherwise.
	// Delete reports it if the watch has not (lazy.go).
	lazy *lazyVerdict
}

// close releases what the record holds: the plan's extracted archive and the stdin FIFO.
func (t *restoredTask) close() {
	if t.plan != nil {
		t.plan.cleanup()
	}
	if t.stdin != nil {
		t.stdin.Close()
	}
}

// NewService wraps inner (containerd's runc task service) with berth's steps, configured by cfg
// (cfg.Path names the configuration file in errors) and using deps (a nil deps.Now is time.Now).
func NewService(inner taskAPI.TTRPCTaskService, cfg Config, deps Deps) *Service {
	if deps.Now == nil {
		deps.Now = time.Now
	}
	if deps.Trust == nil {
		deps.Trust = &signature.Policy{}
	}
	if deps.ReadProcesses == nil {
		deps.ReadProcesses = func(dir string) ([]privilege.Process, error) {
			return helper.Client{}.ReadProcesses(context.Background(), dir)
		}
	}
	if deps.CheckSeccomp == nil {
		deps.CheckSeccomp = func(dir string, profile *specs.LinuxSeccomp) error {
			return helper.Client{}.CheckSeccomp(context.Background(), dir, profile)
		}
	}
	return &Service{TTRPCTaskService: inner, cfg: cfg, deps: deps,
		tasks: map[string]*restoredTask{}, rootfs: map[string][]mount.Mount{}}
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
// GPUs). Nothing is created when validation fails; the error names the cause and the value, and
// its class comes from errorClass (InvalidArgument for a malformed or escaping reference or
// archive, NotFound for a missing checkpoint, FailedPrecondition for a damaged or incompatible
// one, PermissionDenied for a refused namespace or registry). A restored task gets pipes for the
// standard streams it has none for (restoreStdio).
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", r.ID))
	resp, err := s.create(ctx, r)
	if err != nil {
		return nil, wireError(err)
	}
	return resp, nil
}

// create is Create with native errors: prepare (validate, rewrite the spec), have runc create the
// task, apply the checkpoint's rootfs diff, and keep the record of a task created from a
// checkpoint for Start and Delete.
func (s *Service) create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	t, err := s.prepareCreate(ctx, r)
	if err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil && t != nil {
			t.close()
		}
	}()
	resp, err := s.TTRPCTaskService.Create(ctx, r)
	if err != nil {
		return nil, errgrpc.ToNative(err)
	}
	if t != nil && t.plan != nil {
		if err := s.restoreRootfs(ctx, r, t.plan); err != nil {
			return nil, err
		}
	}
	s.mu.Lock()
	s.rootfs[r.ID] = mount.FromProto(r.Rootfs)
	if t != nil {
		s.tasks[r.ID] = t
	}
	s.mu.Unlock()
	if t == nil {
		return resp, nil
	}
	if t.plan != nil {
		log.G(ctx).WithField("checkpoint", t.plan.dir).Info("task created from berth checkpoint; Start restores it with CRIU")
	}
	return resp, nil
}

// prepareCreate readies the bundle and r for runc. For a task restored from a checkpoint it
// validates the checkpoint (prepareRestore) and, for a GPU checkpoint, this node's GPUs
// (planGPURestore, which rewrites the spec); it points runc at the bundle's CRIU configuration,
// writes config.json when the spec changed, sets r.Checkpoint to the CRIU images, and gives the
// task its standard streams (restoreStdio). It returns the task's record, or nil for a task
// created fresh; on error nothing it made is left.
func (s *Service) prepareCreate(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *restoredTask, retErr error) {
	raw, ann, err := readSpecAnnotations(r.Bundle)
	if err != nil {
		return nil, err
	}
	if !restoreAsked(ann, r) {
		// a fresh task (nearly every one): only the CRIU configuration annotation is added, and
		// config.json is not decoded whole (a first decode of the whole spec type costs a new shim
		// about 1 ms on the start path)
		return nil, s.setCRIUConfigRaw(r.Bundle, raw, ann)
	}
	spec, err := parseSpec(r.Bundle, raw)
	if err != nil {
		return nil, err
	}
	plan, err := s.prepareRestore(ctx, r, spec)
	if err != nil {
		return nil, fmt.Errorf("restore %s: %w", r.ID, err)
	}
	t := &restoredTask{status: restoreCreated, bundle: r.Bundle, plan: plan}
	defer func() {
		if retErr != nil {
			t.close()
		}
	}()
	if plan != nil || r.Checkpoint != "" {
		if err := checkRestoreFits(plan, spec); err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
	}
	specChanged := false
	if plan != nil && plan.manifest != nil && plan.manifest.GPU != nil {
		// before anything is created: can this node take the checkpoint's GPUs?
		choice, err := s.planGPURestore(spec, plan.manifest.GPU)
		if err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
		plan.gpuPairs, plan.gpuReason = choice.Pairs, choice.Reason
		log.G(ctx).WithFields(log.Fields{"pairs": choice.Pairs, "reason": choice.Reason}).Info("GPU device map chosen")
		specChanged = true
	}
	changed, err := s.setCRIUConfig(r.Bundle, spec)
	if err != nil {
		return nil, err
	}
	if changed || specChanged {
		if err := writeSpec(r.Bundle, spec); err != nil {
			return nil, err
		}
	}
	if plan != nil {
		// runc restores from the image directory Create verified, held open, not from whatever
		// its path names by the time Start runs
		r.Checkpoint = plan.runcImages()
	}
	if r.Checkpoint == "" {
		return nil, nil
	}
	if err := checkRuncID(ctx, r); err != nil {
		return nil, fmt.Errorf("restore %s: %w", r.ID, err)
	}
	t.ownNetns = ownsNetns(spec)
	if p := joinedUTS(spec); p != "" {
		if t.uts, err = readUTS(p); err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
	}
	t.criuWork = criuWorkPath(r)
	if t.stdin, err = restoreStdio(r); err != nil {
		return nil, err
	}
	return t, nil
}

// restoreRootfs applies the checkpoint's rootfs diff to the task runc created from it and copies
// the contents of its pod's tmpfs mounts back (restoreTmpfs); on failure
// it removes that task again, so nothing is half-created.
func (s *Service) restoreRootfs(ctx context.Context, r *taskAPI.CreateTaskRequest, plan *restorePlan) (retErr error) {
	defer func() {
		if retErr != nil {
			if _, derr := s.TTRPCTaskService.Delete(ctx, &taskAPI.DeleteRequest{ID: r.ID}); derr != nil {
				log.G(ctx).WithError(derr).Warn("remove task after failed restore preparation")
			}
		}
	}()
	if err := s.applyRootfsDiff(ctx, plan, filepath.Join(r.Bundle, "rootfs")); err != nil {
		return fmt.Errorf("restore %s: %w", r.ID, err)
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return err
	}
	if err := s.restoreTmpfs(ctx, plan, spec); err != nil {
		return fmt.Errorf("restore %s: checkpoint %s: %w", r.ID, plan.name(), err)
	}
	return nil
}

// RestoreReportFile is the file Start writes into the bundle of a task it restored from a
// checkpoint: a RestoreReport as JSON.
const RestoreReportFile = "berth-restore.json"

// RestoreReport is what Start measured while restoring a task.
type RestoreReport struct {
	// Phases are the restore's steps in order, each with its wall time in ms: criu-restore (runc's
	// restore with CRIU), then for a GPU checkpoint gpu-restore and gpu-unlock (absent when the
	// step before failed).
	Phases []checkpoint.Phase `json:"phases"`
	// TotalMs is Start's wall time from the runc restore to the end of the GPU restore, in ms (the
	// log's restore_ms).
	TotalMs float64 `json:"totalMs"`
	// DeviceMap is the GPU device map of a GPU checkpoint (old UUID -> new UUID) and
	// DeviceMapReason why Create chose it (gpu/devicemap); absent without GPUs.
	DeviceMap       []gpu.UUIDPair `json:"deviceMap,omitempty"`
	DeviceMapReason string         `json:"deviceMapReason,omitempty"`
	// LazyFailure, for a task restored lazily (post-copy), is why its memory pages stopped coming
	// before all arrived: the guard of the lazy-pages daemon then killed the task before it could
	// read a missing page (shim/lazy.go). Absent otherwise.
	LazyFailure string `json:"lazyFailure,omitempty"`
}

// Start starts the task. A task created from a checkpoint is restored instead: runc restores it
// with CRIU; a task that owns its network namespace gets its loopback set up; for a GPU checkpoint
// the CUDA processes are brought back onto the mapped GPUs and unlocked. The driver cannot roll a
// failed GPU restore back, so the task is then killed (the checkpoint is untouched and can be
// restored again) and the error names the process and step. Once CRIU has restored the task, the
// restore's phases (RestoreReport) are logged (restore_ms the total, ms.<phase> each, in ms) and
// written into the bundle as RestoreReportFile, also when the GPU restore failed. An archive
// extracted for the restore is removed once Start returns. Any other task, and every exec, is
// started by runc unchanged. Once a task's Start has answered, the heap left unused is handed
// back to the kernel (releaseMemory).
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	if r.ExecID != "" {
		return s.TTRPCTaskService.Start(ctx, r)
	}
	defer s.releaseMemory()
	t := s.takeForStart(r.ID)
	if t == nil {
		return s.TTRPCTaskService.Start(ctx, r)
	}
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", r.ID))
	resp, err := s.startRestored(ctx, r, t)
	if err != nil {
		return nil, wireError(err)
	}
	return resp, nil
}

// releaseMemory returns the heap that starting a task left unused to the kernel, releaseDelay
// after the Start call has answered: a shim then idles for its container's life, and Go's
// scavenger would keep up to the next GC goal resident. It runs in the background (a GC of a few
// MiB), late enough not to take a CPU from the start's answer on its way to containerd and the
// client, which a GC started at once did on two vCPUs.
func (s *Service) releaseMemory() { time.AfterFunc(releaseDelay, debug.FreeOSMemory) }

// releaseDelay is how long after a task's Start the shim returns its unused heap to the kernel.
const releaseDelay = 250 * time.Millisecond

// takeForStart moves id's record from created to started and returns what Start needs from it (a
// copy, with the plan Start now owns); nil when id has no record waiting for Start.
func (s *Service) takeForStart(id string) *restoredTask {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.tasks[id]
	if t == nil || t.status != restoreCreated {
		return nil
	}
	started := *t
	t.status, t.plan = restoreStarted, nil
	return &started
}

// startRestored is Start for a task created from a checkpoint, with native errors.
func (s *Service) startRestored(ctx context.Context, r *taskAPI.StartRequest, t *restoredTask) (*taskAPI.StartResponse, error) {
	if t.plan != nil {
		defer t.plan.cleanup()
		// runc reads the images Create verified (held open); none of them may have changed since
		if err := t.plan.unchanged(); err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
	}
	ph := checkpoint.NewPhases(s.deps.Now)
	start := s.deps.Now()
	var lazyDone func(pid int)
	if t.plan != nil && t.plan.manifest != nil && t.plan.manifest.PostCopy {
		guard, err := lockLazyRestore(t.plan.dir)
		if err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
		defer guard() // not before the task record is written (a failed restore has none)
		undo, err := useLazyRestore(ctx, t.bundle, t.plan.dir)
		if err != nil {
			return nil, fmt.Errorf("restore %s: %w", r.ID, err)
		}
		defer undo()
		lazyDone = func(pid int) {
			s.recordLazyTask(ctx, r.ID, t.bundle, t.plan.dir, pid)
			guard()
		}
	}
	var resp *taskAPI.StartResponse
	if err := ph.Time("criu-restore", func() (err error) {
		resp, err = s.TTRPCTaskService.Start(ctx, r)
		return errgrpc.ToNative(err)
	}); err != nil {
		return nil, s.explainRestore(ctx, r.ID, t, err)
	}
	if lazyDone != nil {
		lazyDone(int(resp.Pid))
	}
	if t.uts != nil {
		// CRIU wrote the checkpoint's hostname into the pod's UTS namespace: give the pod its own back
		if was, err := t.uts.restore(); err != nil {
			log.G(ctx).WithError(err).Error("the pod's hostname stays the checkpoint's")
		} else if was != t.uts.hostname {
			log.G(ctx).WithFields(log.Fields{"hostname": t.uts.hostname, "checkpoint_hostname": was}).Info("the pod's hostname, which CRIU restored from the checkpoint, is set back")
		}
	}
	if t.ownNetns {
		if err := loopbackUp(int(resp.Pid)); err != nil {
			log.G(ctx).WithError(err).Warn("restored task's loopback stays down")
		}
	}
	var gpuErr error
	if t.plan != nil && len(t.plan.gpuPairs) > 0 {
		var recorded []int
		var deviceBytes uint64
		if m := t.plan.manifest; m != nil && m.GPU != nil {
			recorded = m.GPU.NSPIDs
			for _, d := range m.GPU.Devices {
				deviceBytes += d.MemoryUsed
			}
		}
		gpuErr = s.restoreGPUs(ctx, r.ID, t.plan.gpuPairs, recorded, deviceBytes, ph)
	}
	report := RestoreReport{Phases: ph.List(), TotalMs: checkpoint.Millis(s.deps.Now().Sub(start))}
	if t.plan != nil {
		report.DeviceMap, report.DeviceMapReason = t.plan.gpuPairs, t.plan.gpuReason
	}
	report.LazyFailure = lazyFailure(t.bundle)
	s.writeRestoreReport(ctx, t.bundle, report)
	if gpuErr != nil {
		// do not leave a task without its device memory running
		if _, kerr := s.TTRPCTaskService.Kill(ctx, &taskAPI.KillRequest{ID: r.ID, Signal: 9, All: true}); kerr != nil {
			log.G(ctx).WithError(kerr).Error("kill task after failed GPU restore")
		} else {
			// wait for the exit: the caller deletes the task next, which needs it stopped
			_, _ = s.TTRPCTaskService.Wait(ctx, &taskAPI.WaitRequest{ID: r.ID})
		}
		return nil, fmt.Errorf("restore %s: %w; the task was killed, the checkpoint %s is intact", r.ID, gpuErr, t.plan.name())
	}
	log.G(ctx).WithFields(restoreFields(report)).Info("restored with CRIU")
	return resp, nil
}

// restoreFields are a RestoreReport as log fields: restore_ms (the total) and ms.<phase>.
func restoreFields(rep RestoreReport) log.Fields {
	f := log.Fields{"restore_ms": rep.TotalMs}
	for _, p := range rep.Phases {
		f["ms."+p.Name] = p.Ms
	}
	return f
}

// writeRestoreReport writes rep into bundle as RestoreReportFile; a failure is logged, not
// returned (the task is restored either way).
func (s *Service) writeRestoreReport(ctx context.Context, bundle string, rep RestoreReport) {
	b, err := json.Marshal(rep)
	if err == nil {
		// whole or not at all: the lazy watch may read it meanwhile (lazyVerdict.report)
		err = replaceFile(filepath.Join(bundle, RestoreReportFile), append(b, '\n'))
	}
	if err != nil {
		log.G(ctx).WithError(err).WithFields(restoreFields(rep)).Warn("restore report not written")
	}
}

// replaceFile replaces path with data (mode 0600) through a temporary file in the same directory
// renamed over it, so that a reader sees the old content or the new, never a part. Not synced:
// the bundle lives as long as the task, and the file is a report.
func replaceFile(path string, data []byte) (retErr error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			os.Remove(tmp.Name())
		}
	}()
	_, err = tmp.Write(data)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
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

// Delete deletes the task or exec. For a task created from a checkpoint it forgets the record:
// a restore that never started is cleaned up, the stdin FIFO held for it is closed once runc
// deleted the task, and for a task restored lazily the lazy guard's reason for killing it, if the
// shim's watch has not reported it yet, is reported now. Errors are runc's.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	if r.ExecID == "" {
		s.mu.Lock()
		t := s.tasks[r.ID]
		delete(s.tasks, r.ID)
		delete(s.rootfs, r.ID)
		s.mu.Unlock()
		s.dropLease(r.ID)
		if t != nil {
			if t.lazy != nil {
				t.lazy.report(ctx, s, 1)
			}
			if t.plan != nil {
				t.plan.cleanup()
			}
			if t.stdin != nil {
				defer t.stdin.Close()
			}
		}
	}
	return s.TTRPCTaskService.Delete(ctx, r)
}

// Checkpoint dumps the task with runc/CRIU into r.Path and writes the berth manifest there. The
// task must be running or paused (containerd pauses it first); otherwise the error is of class
// errdefs.ErrFailedPrecondition and names the status. For a container with GPUs the GPU session
// (gpuSession) checkpoints their device memory first and, unless the task is to exit, gives the
// GPUs back after the dump; a failure at any step undoes what was done, so the workload keeps
// running as before, and the error names the process and step. When the caller gives no CRIU work
// directory, the shim uses its own beside the bundle and removes it afterwards. The manifest's
// phases are the GPU steps, criu-dump and fingerprint, each in ms. Errors are classified by
// errorClass.
func (s *Service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", r.ID))
	if err := s.checkpoint(ctx, r); err != nil {
		return nil, wireError(err)
	}
	return &ptypes.Empty{}, nil
}

// setCRIUConfig writes the bundle's CRIU configuration file and points runc at it through the
// org.criu.config annotation, unless the spec already names another file. It reports whether
// spec changed (the caller writes config.json).
func (s *Service) setCRIUConfig(bundle string, spec *specs.Spec) (bool, error) {
	path, set, err := s.writeCRIUConfig(bundle, spec.Annotations)
	if err != nil || !set {
		return false, err
	}
	if spec.Annotations == nil {
		spec.Annotations = map[string]string{}
	}
	spec.Annotations[oci.AnnotationCRIUConfig] = path
	return true, nil
}

// criuLibdirName is the empty directory in each bundle that the shim's CRIU configuration names
// as CRIU's plugin directory (libdir).
const criuLibdirName = "berth-criu-plugins"

// writeCRIUConfig writes the bundle's CRIU configuration file (cfg.CRIUOptions, one per line)
// unless the annotations ann of its spec name another file. It returns the file's path and
// whether the spec's org.criu.config annotation must be set to it (it names no file yet).
//
// Unless cfg.CRIUOptions names a libdir of its own, the file points CRIU's plugin directory at
// an empty directory of the bundle (criuLibdirName): CRIU's CUDA plugin, which its build
// installs into the default libdir and which acts whenever cuda-checkpoint is on PATH, would
// otherwise restore and unlock the CUDA state at restore without berth's device map, racing
// berth's own GPU steps (NVIDIA's checkpoint agent runs CRIU with an empty libdir too).
func (s *Service) writeCRIUConfig(bundle string, ann map[string]string) (path string, set bool, err error) {
	path = filepath.Join(bundle, criuConfigName)
	cur, ok := ann[oci.AnnotationCRIUConfig]
	if ok && filepath.Base(cur) != criuConfigName {
		return "", false, nil // the user chose their own CRIU configuration
	}
	opts := slices.Clone(s.cfg.CRIUOptions)
	if !slices.ContainsFunc(opts, func(o string) bool { return o == "libdir" || strings.HasPrefix(o, "libdir ") }) {
		libdir := filepath.Join(bundle, criuLibdirName)
		if err := os.Mkdir(libdir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return "", false, fmt.Errorf("CRIU plugin directory: %w", err)
		}
		opts = append(opts, "libdir "+libdir)
	}
	body := strings.Join(opts, "\n") + "\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		return "", false, fmt.Errorf("write CRIU config: %w", err)
	}
	return path, cur != path, nil
}

// setCRIUConfigRaw is setCRIUConfig for a task created fresh, on the bundle's config.json as
// read (raw) and its annotations (ann): when the annotation must be set, only the spec's
// top-level "annotations" member is replaced and config.json rewritten; every other member is
// written back as it was read, fields the runtime-spec module does not know included.
func (s *Service) setCRIUConfigRaw(bundle string, raw []byte, ann map[string]string) error {
	path, set, err := s.writeCRIUConfig(bundle, ann)
	if err != nil || !set {
		return err
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil {
		return fmt.Errorf("parse bundle spec %s: %w", filepath.Join(bundle, "config.json"), mark(err, ErrInvalidSpec))
	}
	withConfig := make(map[string]string, len(ann)+1)
	for k, v := range ann {
		withConfig[k] = v
	}
	withConfig[oci.AnnotationCRIUConfig] = path
	b, err := json.Marshal(withConfig)
	if err != nil {
		return err
	}
	top["annotations"] = b
	if b, err = json.Marshal(top); err != nil {
		return err
	}
	return writeSpecBytes(bundle, b)
}

// restoreAsked reports whether Create restores the task from a checkpoint, as prepareRestore
// decides it: containerd passes a checkpoint, or the spec's restore-from annotation names one
// (ignored on a pod's sandbox container).
func restoreAsked(ann map[string]string, r *taskAPI.CreateTaskRequest) bool {
	return r.Checkpoint != "" || (ann[oci.AnnotationRestoreFrom] != "" && ann[oci.AnnotationCRIContainerType] != "sandbox")
}

// readSpecAnnotations reads the bundle's config.json and decodes its annotations only. It
// returns the file's bytes and the annotations (nil when it has none); an error wraps
// ErrInvalidSpec when config.json is not a JSON object or its annotations not strings.
func readSpecAnnotations(bundle string) ([]byte, map[string]string, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, nil, fmt.Errorf("read bundle spec: %w", err)
	}
	var head struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, nil, fmt.Errorf("parse bundle spec %s: %w", filepath.Join(bundle, "config.json"), mark(err, ErrInvalidSpec))
	}
	return b, head.Annotations, nil
}

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	return parseSpec(bundle, b)
}

// parseSpec decodes b, the bundle's config.json, whole.
func parseSpec(bundle string, b []byte) (*specs.Spec, error) {
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("parse bundle spec %s: %w", filepath.Join(bundle, "config.json"), mark(err, ErrInvalidSpec))
	}
	return &spec, nil
}

func writeSpec(bundle string, spec *specs.Spec) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return writeSpecBytes(bundle, b)
}

// writeSpecBytes replaces the bundle's config.json with b (written beside it, then renamed).
func writeSpecBytes(bundle string, b []byte) error {
	p := filepath.Join(bundle, "config.json")
	tmp := p + ".berth"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	return os.Rename(tmp, p)
}
