package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/devicemap"
	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// gpuStep is where a GPU checkpoint session stands. Before CRIU dumps the task the session moves
// forward
//
//	found -> thawed -> locked -> checkpointed -> refrozen
//
// and afterwards, to give the GPUs back, or at any point to roll a failure back, it moves back the
// same way from wherever it stands: refrozen -> checkpointed thaws the task, checkpointed ->
// locked brings the device memory back (driver Restore), locked -> thawed unlocks, thawed ->
// found freezes the task again. The thaw and freeze steps act on the task only when containerd had
// frozen it before Checkpoint (the CUDA lock needs running threads); for a running task they change
// nothing. This is containerd's createdCheckpointState and runc's restoredState for the GPU side.
type gpuStep int

const (
	gpuFound        gpuStep = iota // the container's GPUs and driver are known; nothing changed yet
	gpuThawed                      // the task's threads run (thawed by the session if it was frozen)
	gpuLocked                      // CUDA work locked: every process, or those before a failed lock
	gpuCheckpointed                // device memory in host memory: every process, or those before a failure
	gpuRefrozen                    // the task frozen again if it was: ready for CRIU
)

func (s gpuStep) String() string {
	switch s {
	case gpuFound:
		return "found"
	case gpuThawed:
		return "thawed"
	case gpuLocked:
		return "locked"
	case gpuCheckpointed:
		return "checkpointed"
	case gpuRefrozen:
		return "refrozen"
	}
	return fmt.Sprintf("gpuStep(%d)", int(s))
}

// gpuProc is one CUDA process of the container and the driver state this session brought it to
// (running, locked or checkpointed): undo acts on exactly the processes a step reached.
type gpuProc struct {
	pid   int
	state gpu.ProcessState
}

// gpuSession is the GPU side of one checkpoint: the container's CUDA processes and the step the
// session has reached, so that whatever happens, undo gives every process back its GPUs and
// leaves the task running or frozen as containerd left it.
type gpuSession struct {
	tasks   taskAPI.TTRPCTaskService // runc's: Pause, Resume, Pids
	id      string
	drv     gpu.Driver
	timeout time.Duration // the CUDA lock's bound per process
	frozen  bool          // containerd froze the task before Checkpoint
	step    gpuStep
	procs   []gpuProc          // in the order runc lists them
	phases  *checkpoint.Phases // the GPU steps' wall times, forward and back
	record  *checkpoint.GPUState
}

// beginGPUCheckpoint finds the container's CUDA processes and takes the session forward to
// refrozen: thaw a frozen task (a lock needs running threads), lock every process, checkpoint
// their device memory into host memory, freeze the task again. It returns nil when there is no
// GPU backend or the container has no GPUs. The device memory each process holds comes from the
// backend's inventory (gpu.Inventory.ProcessMemory); where the backend cannot tell, it is
// recorded as 0 and a warning logged. On error the session is undone from the step it reached;
// the error names the PID and step.
func (s *Service) beginGPUCheckpoint(ctx context.Context, id string, st *taskAPI.StateResponse) (_ *gpuSession, retErr error) {
	if s.deps.GPU == nil {
		return nil, nil
	}
	spec, err := readSpec(st.Bundle)
	if err != nil {
		return nil, err
	}
	uuids, err := s.deps.GPU.ContainerGPUs(spec)
	if err != nil || len(uuids) == 0 {
		return nil, err
	}
	g := &gpuSession{tasks: s.TTRPCTaskService, id: id, drv: s.deps.GPU.Driver(), timeout: s.cfg.GPULockTimeout(),
		frozen: st.Status == task.Status_PAUSED, phases: checkpoint.NewPhases(s.deps.Now)}
	vers, err := g.drv.Versions()
	if err != nil {
		return nil, fmt.Errorf("GPU driver: %w", err)
	}
	if err := gpu.CheckDriver(vers, false); err != nil {
		return nil, err
	}
	g.record = &checkpoint.GPUState{Driver: vers.Driver, CUDA: vers.CUDA}
	devs, err := s.deps.GPU.Inventory().Devices()
	if err != nil {
		return nil, fmt.Errorf("GPU inventory: %w", err)
	}
	for _, u := range uuids {
		d, ok := findDevice(devs, u)
		if !ok {
			return nil, fmt.Errorf("container GPU %s is not on this node: %w", u, errdefs.ErrFailedPrecondition)
		}
		if err := gpu.CheckDevice(d); err != nil { // before anything is thawed or locked
			return nil, err
		}
		g.record.Devices = append(g.record.Devices, checkpoint.GPUDevice{UUID: d.UUID, Name: d.Name, MemoryTotal: d.MemoryTotal, DevicePaths: d.DevicePaths})
	}
	g.record.Links = s.containerLinks(ctx, devs, uuids)
	defer func() {
		if retErr != nil {
			g.abort(ctx)
		}
	}()
	if err := g.forward(ctx); err != nil { // thawed: the processes answer only while they run
		return nil, err
	}
	if err := s.findCUDAProcesses(ctx, g); err != nil {
		return nil, err
	}
	for g.step < gpuRefrozen {
		if err := g.forward(ctx); err != nil {
			return nil, err
		}
	}
	log.G(ctx).WithFields(log.Fields{"gpu_pids": g.record.PIDs, "gpus": uuids}).Info("GPU state checkpointed")
	return g, nil
}

// findCUDAProcesses fills g with the task's CUDA processes (every PID the driver does not answer
// gpu.ErrNotCUDA for), which must all be running, and records their PIDs and device memory.
func (s *Service) findCUDAProcesses(ctx context.Context, g *gpuSession) error {
	pids, err := g.tasks.Pids(ctx, &taskAPI.PidsRequest{ID: g.id})
	if err != nil {
		return errgrpc.ToNative(err)
	}
	for _, p := range pids.Processes {
		pid := int(p.Pid)
		state, err := g.drv.State(pid)
		if errors.Is(err, gpu.ErrNotCUDA) {
			continue
		}
		if err != nil {
			return fmt.Errorf("GPU state of pid %d: %w", pid, err)
		}
		if state != gpu.StateRunning {
			return fmt.Errorf("pid %d is %s, not running: %w", pid, state, gpu.ErrIllegalState)
		}
		g.procs = append(g.procs, gpuProc{pid: pid, state: gpu.StateRunning})
		g.record.PIDs = append(g.record.PIDs, pid)
		g.record.NSPIDs = append(g.record.NSPIDs, nsPID(pid))
	}
	for _, p := range g.procs {
		use, err := s.deps.GPU.Inventory().ProcessMemory(p.pid)
		if errors.Is(err, gpu.ErrUnsupported) {
			log.G(ctx).WithError(err).Warn("device memory of the CUDA processes unknown: a restore cannot check the destination's free memory")
			break
		}
		if err != nil {
			return fmt.Errorf("GPU memory of pid %d: %w", p.pid, err)
		}
		for i := range g.record.Devices {
			g.record.Devices[i].MemoryUsed += use[g.record.Devices[i].UUID]
		}
	}
	return nil
}

// forward takes the session one step forward (phases gpu-thaw, gpu-lock, gpu-checkpoint,
// gpu-refreeze; thaw and refreeze only for a frozen task). A thaw or freeze that fails leaves the
// step where it was; a lock or checkpoint that fails for one process leaves the session at the
// new step with the processes before it moved (undo takes exactly those back).
func (g *gpuSession) forward(ctx context.Context) error {
	switch g.step {
	case gpuFound:
		if g.frozen {
			if err := g.phases.Time("gpu-thaw", func() error { return g.resume(ctx) }); err != nil {
				return fmt.Errorf("thaw task for the GPU lock: %w", err)
			}
		}
		g.step = gpuThawed
	case gpuThawed:
		g.step = gpuLocked
		return g.phases.Time("gpu-lock", func() error {
			return g.each(gpu.StateRunning, gpu.StateLocked, func(pid int) error {
				if err := g.drv.Lock(pid, g.timeout); err != nil {
					return fmt.Errorf("GPU lock of pid %d (timeout %v): %w", pid, g.timeout, err)
				}
				return nil
			}, true)
		})
	case gpuLocked:
		g.step = gpuCheckpointed
		return g.phases.Time("gpu-checkpoint", func() error {
			return g.each(gpu.StateLocked, gpu.StateCheckpointed, func(pid int) error {
				if err := g.drv.Checkpoint(pid); err != nil {
					return fmt.Errorf("GPU checkpoint of pid %d: %w", pid, err)
				}
				return nil
			}, true)
		})
	case gpuCheckpointed:
		if g.frozen {
			if err := g.phases.Time("gpu-refreeze", func() error { return g.pause(ctx) }); err != nil {
				return fmt.Errorf("freeze task again after the GPU checkpoint: %w", err)
			}
		}
		g.step = gpuRefrozen
	}
	return nil
}

// back takes the session one step back (phases gpu-restore and gpu-unlock). A thaw that fails
// leaves the step where it was (with frozen threads nothing else can be undone); restore and
// unlock try every process the step reached and move on, returning the failures (a process that
// failed keeps its state); a freeze that fails leaves the session thawed.
func (g *gpuSession) back(ctx context.Context) error {
	switch g.step {
	case gpuRefrozen:
		if g.frozen {
			if err := g.resume(ctx); err != nil {
				return fmt.Errorf("thaw task for the GPU restore: %w", err)
			}
		}
		g.step = gpuCheckpointed
	case gpuCheckpointed:
		g.step = gpuLocked
		return g.phases.Time("gpu-restore", func() error {
			return g.each(gpu.StateCheckpointed, gpu.StateLocked, func(pid int) error {
				if err := g.drv.Restore(pid, nil); err != nil {
					return fmt.Errorf("GPU restore of pid %d: %w", pid, err)
				}
				return nil
			}, false)
		})
	case gpuLocked:
		g.step = gpuThawed
		return g.phases.Time("gpu-unlock", func() error {
			return g.each(gpu.StateLocked, gpu.StateRunning, func(pid int) error {
				if err := g.drv.Unlock(pid); err != nil {
					return fmt.Errorf("GPU unlock of pid %d: %w", pid, err)
				}
				return nil
			}, false)
		})
	case gpuThawed:
		if g.frozen {
			if err := g.pause(ctx); err != nil {
				return fmt.Errorf("freeze task again: %w", err)
			}
		}
		g.step = gpuFound
	}
	return nil
}

// each calls do for every process in state from and moves those it succeeds for to state to.
// With stopFirst it stops at the first failure and returns it; otherwise it tries them all and
// returns every failure.
func (g *gpuSession) each(from, to gpu.ProcessState, do func(pid int) error, stopFirst bool) error {
	var errs []error
	for i := range g.procs {
		p := &g.procs[i]
		if p.state != from {
			continue
		}
		if err := do(p.pid); err != nil {
			if stopFirst {
				return err
			}
			errs = append(errs, err)
			continue
		}
		p.state = to
	}
	return errors.Join(errs...)
}

// undo takes the session back to found from the step it reached and returns every failure; it
// stops early only at a step that cannot be taken.
func (g *gpuSession) undo(ctx context.Context) error {
	var errs []error
	for g.step > gpuFound {
		from := g.step
		if err := g.back(ctx); err != nil {
			errs = append(errs, err)
		}
		if g.step == from {
			break
		}
	}
	return errors.Join(errs...)
}

// release gives the GPUs back after a dump that leaves the task running: undo from refrozen.
func (g *gpuSession) release(ctx context.Context) error { return g.undo(ctx) }

// abort rolls a failed checkpoint back (undo, not cancelled with ctx). Failures are logged: the
// caller's error is what matters.
func (g *gpuSession) abort(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	if err := g.undo(ctx); err != nil {
		log.G(ctx).WithError(err).WithField("gpu_step", g.step).Error("GPU rollback")
	}
}

func (g *gpuSession) resume(ctx context.Context) error {
	_, err := g.tasks.Resume(ctx, &taskAPI.ResumeRequest{ID: g.id})
	return errgrpc.ToNative(err)
}

func (g *gpuSession) pause(ctx context.Context) error {
	_, err := g.tasks.Pause(ctx, &taskAPI.PauseRequest{ID: g.id})
	return errgrpc.ToNative(err)
}

// fingerprintGPUs returns the fingerprint's GPU list for the container's GPUs (container order).
func (g *gpuSession) fingerprintGPUs() []fingerprint.GPU {
	var out []fingerprint.GPU
	for i, d := range g.record.Devices {
		out = append(out, fingerprint.GPU{Index: i, UUID: d.UUID, Name: d.Name, MemoryBytes: d.MemoryTotal,
			Driver: g.record.Driver, CUDA: g.record.CUDA})
	}
	return out
}

// manifestState returns the GPU state for the manifest, with every GPU step's phase.
func (g *gpuSession) manifestState() *checkpoint.GPUState {
	g.record.Steps = g.phases.List()
	return g.record
}

// planGPURestore checks, before anything is created, that this node can take the checkpoint's
// GPUs: driver and CUDA versions, the same model and count, enough free memory per GPU; chooses
// the device map (gpu/devicemap: the checkpoint's own GPUs when they are all here, else GPUs of
// the same model that keep the links the checkpoint recorded, idle ones before those in use) and
// rewrites spec to give the container the mapped GPUs. It returns the map and why it was chosen.
// The error names the field that differs and both values.
func (s *Service) planGPURestore(spec *specs.Spec, st *checkpoint.GPUState) (devicemap.Choice, error) {
	if st == nil || len(st.Devices) == 0 {
		return devicemap.Choice{}, nil
	}
	if s.deps.GPU == nil {
		return devicemap.Choice{}, mismatch("gpus", strconv.Itoa(len(st.Devices)), "0 (no GPU driver configured)")
	}
	vers, err := s.deps.GPU.Driver().Versions()
	if err != nil {
		return devicemap.Choice{}, fmt.Errorf("GPU driver: %w", err)
	}
	if vers.Driver != st.Driver {
		return devicemap.Choice{}, mismatch("gpu.driver", st.Driver, vers.Driver)
	}
	if vers.CUDA != st.CUDA {
		return devicemap.Choice{}, mismatch("gpu.cuda", st.CUDA, vers.CUDA)
	}
	devs, err := s.deps.GPU.Inventory().Devices()
	if err != nil {
		return devicemap.Choice{}, fmt.Errorf("GPU inventory: %w", err)
	}
	if len(devs) < len(st.Devices) {
		return devicemap.Choice{}, mismatch("gpus", strconv.Itoa(len(st.Devices)), strconv.Itoa(len(devs)))
	}
	// A restore never gives a pod more than its spec grants: the GPUs a pod's spec names (the
	// device plugin's, CDI's or berth-nri's allocation) are the only ones the map may use, and a
	// pod whose spec names none gets none. Outside Kubernetes (ctr, berthctl restore: the node's
	// operator), the spec is the source's, naming the source's GPUs, and the map chooses.
	if spec.Annotations[oci.AnnotationCRISandboxNamespace] != "" {
		granted, err := s.deps.GPU.ContainerGPUs(spec)
		if err != nil {
			return devicemap.Choice{}, fmt.Errorf("the GPUs the pod's spec grants: %w", err)
		}
		if len(granted) == 0 {
			return devicemap.Choice{}, mismatch("gpus", strconv.Itoa(len(st.Devices)),
				"0 granted to the pod (request them from the device plugin, CDI or berth.dev/gpus)")
		}
		if len(granted) != len(st.Devices) {
			return devicemap.Choice{}, mismatch("gpus", strconv.Itoa(len(st.Devices)),
				fmt.Sprintf("%d granted to the pod (%s)", len(granted), strings.Join(granted, ", ")))
		}
		var only []gpu.Device
		for _, u := range granted {
			d, ok := findDevice(devs, u)
			if !ok {
				return devicemap.Choice{}, fmt.Errorf("the pod's spec grants GPU %s, which is not on this node: %w", quote(u), gpu.ErrIllegalState)
			}
			only = append(only, d)
		}
		devs = only
	}
	choice, err := devicemap.Choose(s.deviceMapRequest(st, devs))
	if err != nil {
		return devicemap.Choice{}, noFit(st, devs)
	}
	pairs := choice.Pairs
	for i, src := range st.Devices {
		d, _ := findDevice(devs, pairs[i].New)
		if err := gpu.CheckDevice(d); err != nil {
			return devicemap.Choice{}, err
		}
		if d.Name != src.Name {
			return devicemap.Choice{}, mismatch(fmt.Sprintf("gpu[%d].name", i), src.Name, d.Name)
		}
		if d.MemoryFree() < src.MemoryUsed {
			return devicemap.Choice{}, mismatch(fmt.Sprintf("gpu[%d].memoryFree", i), fmt.Sprintf("%d bytes needed", src.MemoryUsed),
				fmt.Sprintf("%d bytes free on %s", d.MemoryFree(), d.UUID))
		}
	}
	remap := false
	for _, p := range pairs {
		remap = remap || p.Old != p.New
	}
	if err := gpu.CheckDriver(vers, remap); err != nil {
		return devicemap.Choice{}, err
	}
	if err := s.deps.GPU.AdaptSpec(spec, pairs); err != nil {
		return devicemap.Choice{}, fmt.Errorf("give the container its GPUs: %w", err)
	}
	return choice, nil
}

// restoreGPUs brings the restored task's checkpointed CUDA processes (those the driver reports
// CHECKPOINTED) back onto the mapped GPUs and unlocks them, timed as the phases gpu-restore and
// gpu-unlock in ph. Identity pairs are passed to the driver as nil (no remapping needed). Each
// process's restore is bounded by gpu_restore_timeout_ms (restoreBounded). It stops at the first
// failure; the error names the PID and step.
//
// recorded are the container PIDs (checkpoint.GPUState.NSPIDs) of the processes the checkpoint
// recorded as CUDA processes: each must be a process of the restored task (matched by its PID
// in the container) that the driver reports CHECKPOINTED, else the restore fails naming it,
// rather than leave it locked without its device memory. nil (a checkpoint that recorded none)
// restores whatever the driver reports CHECKPOINTED.
//
// deviceBytes is the device memory the checkpoint records on its GPUs: each process's restore is
// bounded by Config.GPURestoreBound of it.
func (s *Service) restoreGPUs(ctx context.Context, id string, pairs []gpu.UUIDPair, recorded []int, deviceBytes uint64, ph *checkpoint.Phases) error {
	drv := s.deps.GPU.Driver()
	remap := pairs
	identity := true
	for _, p := range pairs {
		identity = identity && p.Old == p.New
	}
	if identity {
		remap = nil
	}
	pids, err := s.TTRPCTaskService.Pids(ctx, &taskAPI.PidsRequest{ID: id})
	if err != nil {
		return errgrpc.ToNative(err)
	}
	var todo []int
	byNS := map[int]int{} // PID in the container -> host PID
	for _, p := range pids.Processes {
		host := int(p.Pid)
		byNS[nsPID(host)] = host
		if st, err := drv.State(host); err == nil && st == gpu.StateCheckpointed {
			todo = append(todo, host)
		}
	}
	for _, ns := range recorded {
		host, ok := byNS[ns]
		if !ok {
			return fmt.Errorf("CUDA process %d (its PID in the container) that the checkpoint recorded is not a process of the restored task: %w", ns, gpu.ErrIllegalState)
		}
		if st, err := drv.State(host); err != nil || st != gpu.StateCheckpointed {
			return fmt.Errorf("CUDA process %d (pid %d here) that the checkpoint recorded is %s on this node, not checkpointed (%v): its device memory cannot be restored: %w",
				ns, host, st, err, gpu.ErrIllegalState)
		}
	}
	bound := s.cfg.GPURestoreBound(deviceBytes)
	if err := ph.Time("gpu-restore", func() error {
		for _, pid := range todo {
			if err := s.restoreBounded(drv, pid, remap, pairs, bound); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return err
	}
	if err := ph.Time("gpu-unlock", func() error {
		for _, pid := range todo {
			if err := drv.Unlock(pid); err != nil {
				return fmt.Errorf("GPU unlock of pid %d: %w", pid, err)
			}
		}
		return nil
	}); err != nil {
		return err
	}
	log.G(ctx).WithFields(log.Fields{"gpu_pids": todo, "pairs": pairs}).Info("GPU state restored")
	return nil
}

// noFit is the refusal when no device map fits (devicemap.ErrNoFit): the checkpoint's own GPUs
// (identical UUIDs) first, then unused GPUs of the same model with enough free memory in index
// order, as far as that goes; the error names the first GPU that cannot be placed, the field and
// both values, and lists this node's GPUs.
func noFit(st *checkpoint.GPUState, devs []gpu.Device) error {
	used := map[string]bool{}
	pairs := make([]gpu.UUIDPair, len(st.Devices))
	for i, src := range st.Devices { // identical UUIDs first
		if d, ok := findDevice(devs, src.UUID); ok {
			pairs[i] = gpu.UUIDPair{Old: src.UUID, New: d.UUID}
			used[d.UUID] = true
		}
	}
	for i, src := range st.Devices {
		if pairs[i].New != "" {
			continue
		}
		for _, d := range devs {
			if !used[d.UUID] && d.Name == src.Name && d.MemoryFree() >= src.MemoryUsed {
				pairs[i] = gpu.UUIDPair{Old: src.UUID, New: d.UUID}
				used[d.UUID] = true
				break
			}
		}
		if pairs[i].New == "" {
			sameModel := false
			for _, d := range devs {
				sameModel = sameModel || (!used[d.UUID] && d.Name == src.Name)
			}
			if !sameModel {
				return mismatch(fmt.Sprintf("gpu[%d].name", i), src.Name, "no unused GPU of that model: "+describe(devs))
			}
			return mismatch(fmt.Sprintf("gpu[%d].memoryFree", i), fmt.Sprintf("%d bytes needed", src.MemoryUsed),
				"no unused "+src.Name+" with that much free memory: "+describe(devs))
		}
	}
	for i, src := range st.Devices {
		d, _ := findDevice(devs, pairs[i].New)
		if d.Name != src.Name {
			return mismatch(fmt.Sprintf("gpu[%d].name", i), src.Name, d.Name)
		}
		if d.MemoryFree() < src.MemoryUsed {
			return mismatch(fmt.Sprintf("gpu[%d].memoryFree", i), fmt.Sprintf("%d bytes needed", src.MemoryUsed),
				fmt.Sprintf("%d bytes free on %s", d.MemoryFree(), d.UUID))
		}
	}
	return mismatch("gpus", strconv.Itoa(len(st.Devices))+" GPUs of their models with enough free memory", describe(devs))
}

// mismatch is the fingerprint mismatch of one GPU field (class FailedPrecondition, errorClass).
func mismatch(field, ckpt, node string) error {
	return &fingerprint.MismatchError{Field: field, Checkpoint: ckpt, Node: node, Rule: fingerprint.RuleExact}
}

func findDevice(devs []gpu.Device, uuid string) (gpu.Device, bool) {
	for _, d := range devs {
		if d.UUID == uuid {
			return d, true
		}
	}
	return gpu.Device{}, false
}

func describe(devs []gpu.Device) string {
	var parts []string
	for _, d := range devs {
		parts = append(parts, fmt.Sprintf("%s %s %d bytes free", d.UUID, d.Name, d.MemoryFree()))
	}
	return strings.Join(parts, "; ")
}

// nsPID returns pid's PID in its innermost PID namespace (last field of NSpid in
// /proc/PID/status), or pid when unknown.
func nsPID(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return pid
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" {
			if n, err := strconv.Atoi(f[len(f)-1]); err == nil {
				return n
			}
		}
	}
	return pid
}

// deviceMapRequest is the device map request of checkpoint GPU state st onto this node's GPUs
// devs (devicemap.ForCheckpoint), with this node's links when the inventory knows them.
func (s *Service) deviceMapRequest(st *checkpoint.GPUState, devs []gpu.Device) devicemap.Request {
	var topo *topology.Topology
	if t, ok := s.deps.GPU.Inventory().(gpu.Topologist); ok {
		topo, _ = t.Topology() // unknown: mapped by model and memory alone
	}
	return devicemap.ForCheckpoint(st, devs, topo)
}

// containerLinks returns the links between the container's GPUs (uuids, container order) on this
// node, as nvidia-smi names them, for the manifest; nil when the inventory does not know them.
func (s *Service) containerLinks(ctx context.Context, devs []gpu.Device, uuids []string) [][]string {
	tl, ok := s.deps.GPU.Inventory().(gpu.Topologist)
	if !ok || len(uuids) < 2 {
		return nil
	}
	t, err := tl.Topology()
	if err != nil || t == nil || len(t.GPUs) != len(devs) {
		if err != nil {
			log.G(ctx).WithError(err).Warn("GPU links unknown: a restore maps the GPUs by model and memory alone")
		}
		return nil
	}
	idx := make([]int, len(uuids))
	for i, u := range uuids {
		idx[i] = -1
		for j, d := range devs {
			if d.UUID == u {
				idx[i] = j
			}
		}
		if idx[i] < 0 {
			return nil
		}
	}
	out := make([][]string, len(uuids))
	for i := range uuids {
		out[i] = make([]string, len(uuids))
		for j := range uuids {
			out[i][j] = t.Link(idx[i], idx[j]).String()
		}
	}
	return out
}
