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
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// gpuSession is the GPU side of one checkpoint: the CUDA processes found and what was done to
// them, so that every process touched can be restored and unlocked on any failure.
type gpuSession struct {
	s       *Service
	id      string
	drv     gpu.Driver
	pids    []int // host PIDs of CUDA processes, in the order they were found
	locked  []int // PIDs locked so far
	ckpted  []int // PIDs checkpointed so far
	steps   []checkpoint.Phase
	frozen  bool // the task was paused (containerd freezes it before Checkpoint)
	thawed  bool // this session thawed it and has not frozen it again
	state   *checkpoint.GPUState
	spec    *specs.Spec
	timeout time.Duration
}

func (g *gpuSession) step(name string, start time.Time) {
	g.steps = append(g.steps, checkpoint.Phase{Name: name, Ms: ms(time.Since(start))})
}

// beginGPUCheckpoint finds the container's CUDA processes, locks them (thawing a frozen task
// first: a lock needs running threads), checkpoints their device memory into host memory, and
// freezes the task again if it was frozen. It returns nil when the container has no GPUs. On
// error every process touched is restored and unlocked again; the error names the PID and step.
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
	g := &gpuSession{s: s, id: id, drv: s.deps.GPU.Driver(), spec: spec, timeout: s.cfg.GPULockTimeout(),
		frozen: st.Status == task.Status_PAUSED}
	vers, err := g.drv.Versions()
	if err != nil {
		return nil, fmt.Errorf("GPU driver: %w", err)
	}
	if err := gpu.CheckDriver(vers, false); err != nil {
		return nil, err
	}
	g.state = &checkpoint.GPUState{Driver: vers.Driver, CUDA: vers.CUDA}
	devs, err := s.deps.GPU.Inventory().Devices()
	if err != nil {
		return nil, fmt.Errorf("GPU inventory: %w", err)
	}
	for _, u := range uuids {
		d, ok := findDevice(devs, u)
		if !ok {
			return nil, fmt.Errorf("container GPU %s is not on this node: %w", u, errdefs.ErrFailedPrecondition)
		}
		g.state.Devices = append(g.state.Devices, checkpoint.GPUDevice{UUID: d.UUID, Name: d.Name, MemoryTotal: d.MemoryTotal, DevicePaths: d.DevicePaths})
	}
	defer func() {
		if retErr != nil {
			g.abort(context.WithoutCancel(ctx))
		}
	}()
	if g.frozen {
		t := time.Now()
		if _, err := s.TTRPCTaskService.Resume(ctx, &taskAPI.ResumeRequest{ID: id}); err != nil {
			return nil, fmt.Errorf("thaw task for the GPU lock: %w", err)
		}
		g.thawed = true
		g.step("gpu-thaw", t)
	}
	pids, err := s.TTRPCTaskService.Pids(ctx, &taskAPI.PidsRequest{ID: id})
	if err != nil {
		return nil, err
	}
	for _, p := range pids.Processes {
		pid := int(p.Pid)
		state, err := g.drv.State(pid)
		if errors.Is(err, gpu.ErrNotCUDA) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("GPU state of pid %d: %w", pid, err)
		}
		if state != gpu.StateRunning {
			return nil, fmt.Errorf("pid %d is %s, not running: %w", pid, state, gpu.ErrIllegalState)
		}
		g.pids = append(g.pids, pid)
		g.state.PIDs = append(g.state.PIDs, pid)
		g.state.NSPIDs = append(g.state.NSPIDs, nsPID(pid))
	}
	for _, pid := range g.pids {
		use, err := s.deps.GPU.Inventory().ProcessMemory(pid)
		if errors.Is(err, gpu.ErrUnsupported) {
			log.G(ctx).WithError(err).Warn("device memory of the CUDA processes unknown: a restore cannot check the destination's free memory")
			break
		}
		if err != nil {
			return nil, fmt.Errorf("GPU memory of pid %d: %w", pid, err)
		}
		for i := range g.state.Devices {
			g.state.Devices[i].MemoryUsed += use[g.state.Devices[i].UUID]
		}
	}
	t := time.Now()
	for _, pid := range g.pids {
		if err := g.drv.Lock(pid, g.timeout); err != nil {
			return nil, fmt.Errorf("GPU lock of pid %d (timeout %v): %w", pid, g.timeout, err)
		}
		g.locked = append(g.locked, pid)
	}
	g.step("gpu-lock", t)
	t = time.Now()
	for _, pid := range g.pids {
		if err := g.drv.Checkpoint(pid); err != nil {
			return nil, fmt.Errorf("GPU checkpoint of pid %d: %w", pid, err)
		}
		g.ckpted = append(g.ckpted, pid)
	}
	g.step("gpu-checkpoint", t)
	if g.frozen {
		t := time.Now()
		if _, err := s.TTRPCTaskService.Pause(ctx, &taskAPI.PauseRequest{ID: id}); err != nil {
			return nil, fmt.Errorf("freeze task again after the GPU checkpoint: %w", err)
		}
		g.thawed = false
		g.step("gpu-refreeze", t)
	}
	log.G(ctx).WithFields(log.Fields{"gpu_pids": g.pids, "gpus": uuids}).Info("GPU state checkpointed")
	return g, nil
}

// abort restores and unlocks every process this session touched, thawing the task for it and
// freezing it again if it was frozen. Failures are logged: the caller's error is what matters.
func (g *gpuSession) abort(ctx context.Context) {
	if len(g.locked) == 0 {
		if g.thawed {
			_, _ = g.s.TTRPCTaskService.Pause(ctx, &taskAPI.PauseRequest{ID: g.id})
			g.thawed = false
		}
		return
	}
	if err := g.release(ctx); err != nil {
		log.G(ctx).WithError(err).Error("GPU rollback")
	}
}

// release brings every checkpointed process back onto its GPUs and unlocks every locked one,
// in the driver's order (restore, then unlock). The task's threads must run: a frozen task is
// thawed for it and frozen again.
func (g *gpuSession) release(ctx context.Context) error {
	if g.frozen && !g.thawed {
		if _, err := g.s.TTRPCTaskService.Resume(ctx, &taskAPI.ResumeRequest{ID: g.id}); err != nil {
			return fmt.Errorf("thaw task for the GPU restore: %w", err)
		}
		g.thawed = true
	}
	var errs []error
	t := time.Now()
	for _, pid := range g.ckpted {
		if err := g.drv.Restore(pid, nil); err != nil {
			errs = append(errs, fmt.Errorf("GPU restore of pid %d: %w", pid, err))
		}
	}
	g.step("gpu-restore", t)
	t = time.Now()
	for _, pid := range g.locked {
		if err := g.drv.Unlock(pid); err != nil {
			errs = append(errs, fmt.Errorf("GPU unlock of pid %d: %w", pid, err))
		}
	}
	g.step("gpu-unlock", t)
	g.ckpted, g.locked = nil, nil
	if g.frozen {
		if _, err := g.s.TTRPCTaskService.Pause(ctx, &taskAPI.PauseRequest{ID: g.id}); err != nil {
			errs = append(errs, fmt.Errorf("freeze task again: %w", err))
		}
		g.thawed = false
	}
	return errors.Join(errs...)
}

// gpuFingerprint returns the fingerprint's GPU list for the container's GPUs (container order).
func (g *gpuSession) fingerprintGPUs() []fingerprint.GPU {
	var out []fingerprint.GPU
	for i, d := range g.state.Devices {
		out = append(out, fingerprint.GPU{Index: i, UUID: d.UUID, Name: d.Name, MemoryBytes: d.MemoryTotal,
			Driver: g.state.Driver, CUDA: g.state.CUDA})
	}
	return out
}

// planGPURestore checks, before anything is created, that this node can take the checkpoint's
// GPUs: driver and CUDA versions, the same model and count, enough free memory per GPU; builds
// the device map (identical UUIDs first, then the same model, lowest index first, skipping GPUs
// already used by the map) and rewrites spec to give the container the mapped GPUs. The error
// names the field that differs and both values.
func (s *Service) planGPURestore(spec *specs.Spec, st *checkpoint.GPUState) ([]gpu.UUIDPair, error) {
	if st == nil || len(st.Devices) == 0 {
		return nil, nil
	}
	if s.deps.GPU == nil {
		return nil, mismatch("gpus", strconv.Itoa(len(st.Devices)), "0 (no GPU driver configured)")
	}
	vers, err := s.deps.GPU.Driver().Versions()
	if err != nil {
		return nil, fmt.Errorf("GPU driver: %w", err)
	}
	if vers.Driver != st.Driver {
		return nil, mismatch("gpu.driver", st.Driver, vers.Driver)
	}
	if vers.CUDA != st.CUDA {
		return nil, mismatch("gpu.cuda", st.CUDA, vers.CUDA)
	}
	devs, err := s.deps.GPU.Inventory().Devices()
	if err != nil {
		return nil, fmt.Errorf("GPU inventory: %w", err)
	}
	if len(devs) < len(st.Devices) {
		return nil, mismatch("gpus", strconv.Itoa(len(st.Devices)), strconv.Itoa(len(devs)))
	}
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
				return nil, mismatch(fmt.Sprintf("gpu[%d].name", i), src.Name, "no unused GPU of that model: "+describe(devs))
			}
			return nil, mismatch(fmt.Sprintf("gpu[%d].memoryFree", i), fmt.Sprintf("%d bytes needed", src.MemoryUsed),
				"no unused "+src.Name+" with that much free memory: "+describe(devs))
		}
	}
	for i, src := range st.Devices {
		d, _ := findDevice(devs, pairs[i].New)
		if d.Name != src.Name {
			return nil, mismatch(fmt.Sprintf("gpu[%d].name", i), src.Name, d.Name)
		}
		if d.MemoryFree() < src.MemoryUsed {
			return nil, mismatch(fmt.Sprintf("gpu[%d].memoryFree", i), fmt.Sprintf("%d bytes needed", src.MemoryUsed),
				fmt.Sprintf("%d bytes free on %s", d.MemoryFree(), d.UUID))
		}
	}
	remap := false
	for _, p := range pairs {
		remap = remap || p.Old != p.New
	}
	if err := gpu.CheckDriver(vers, remap); err != nil {
		return nil, withClass(err, errdefs.ErrFailedPrecondition)
	}
	if err := s.deps.GPU.AdaptSpec(spec, pairs); err != nil {
		return nil, fmt.Errorf("give the container its GPUs: %w", err)
	}
	return pairs, nil
}

// restoreGPUs brings the restored task's checkpointed CUDA processes back onto the mapped GPUs
// and unlocks them. Identity pairs are passed as nil (no remapping needed).
func (s *Service) restoreGPUs(ctx context.Context, id string, pairs []gpu.UUIDPair) ([]checkpoint.Phase, error) {
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
		return nil, err
	}
	var phases []checkpoint.Phase
	var todo []int
	for _, p := range pids.Processes {
		if st, err := drv.State(int(p.Pid)); err == nil && st == gpu.StateCheckpointed {
			todo = append(todo, int(p.Pid))
		}
	}
	t := time.Now()
	for _, pid := range todo {
		if err := drv.Restore(pid, remap); err != nil {
			return phases, fmt.Errorf("GPU restore of pid %d: %w", pid, err)
		}
	}
	phases = append(phases, checkpoint.Phase{Name: "gpu-restore", Ms: ms(time.Since(t))})
	t = time.Now()
	for _, pid := range todo {
		if err := drv.Unlock(pid); err != nil {
			return phases, fmt.Errorf("GPU unlock of pid %d: %w", pid, err)
		}
	}
	phases = append(phases, checkpoint.Phase{Name: "gpu-unlock", Ms: ms(time.Since(t))})
	log.G(ctx).WithFields(log.Fields{"gpu_pids": todo, "pairs": pairs}).Info("GPU state restored")
	return phases, nil
}

func mismatch(field, ckpt, node string) error {
	return withClass(&fingerprint.MismatchError{Field: field, Checkpoint: ckpt, Node: node, Rule: fingerprint.RuleExact}, errdefs.ErrFailedPrecondition)
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
