package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// scriptDriver is a gpu.Driver over a table of process states, recording every call, with
// failures injected per step and PID. It enforces the driver's state machine.
type scriptDriver struct {
	vers  gpu.Versions
	state map[int]gpu.ProcessState
	fail  map[string]int // step -> pid that fails it
	calls []string
}

func (d *scriptDriver) Versions() (gpu.Versions, error) { return d.vers, nil }
func (d *scriptDriver) State(pid int) (gpu.ProcessState, error) {
	st, ok := d.state[pid]
	if !ok {
		return 0, gpu.ErrNotCUDA
	}
	return st, nil
}
func (d *scriptDriver) RestoreThreadID(pid int) (int, error) { return pid, nil }
func (d *scriptDriver) move(step string, pid int, from, to gpu.ProcessState) error {
	d.calls = append(d.calls, fmt.Sprintf("%s %d", step, pid))
	if d.fail[step] == pid {
		if step == "lock" {
			return gpu.ErrTimeout
		}
		return errors.New("injected failure")
	}
	if d.state[pid] != from {
		return fmt.Errorf("%s of pid %d in state %s: %w", step, pid, d.state[pid], gpu.ErrIllegalState)
	}
	d.state[pid] = to
	return nil
}
func (d *scriptDriver) Lock(pid int, _ time.Duration) error {
	return d.move("lock", pid, gpu.StateRunning, gpu.StateLocked)
}
func (d *scriptDriver) Checkpoint(pid int) error {
	return d.move("checkpoint", pid, gpu.StateLocked, gpu.StateCheckpointed)
}
func (d *scriptDriver) Restore(pid int, _ []gpu.UUIDPair) error {
	return d.move("restore", pid, gpu.StateCheckpointed, gpu.StateLocked)
}
func (d *scriptDriver) Unlock(pid int) error {
	return d.move("unlock", pid, gpu.StateLocked, gpu.StateRunning)
}

type scriptBackend struct {
	drv      *scriptDriver
	devs     []gpu.Device
	usage    map[int]map[string]uint64 // pid -> device memory per GPU UUID
	usageErr error
}

func (b *scriptBackend) Driver() gpu.Driver       { return b.drv }
func (b *scriptBackend) Inventory() gpu.Inventory { return b }
func (b *scriptBackend) Devices() ([]gpu.Device, error) {
	return b.devs, nil
}
func (b *scriptBackend) Versions() (gpu.Versions, error) { return b.drv.vers, nil }
func (b *scriptBackend) ProcessMemory(pid int) (map[string]uint64, error) {
	return b.usage[pid], b.usageErr
}
func (b *scriptBackend) ContainerGPUs(spec *specs.Spec) ([]string, error) {
	for _, e := range spec.Process.Env {
		if v, ok := strings.CutPrefix(e, "GPUS="); ok {
			return strings.Split(v, ","), nil
		}
	}
	return nil, nil
}
func (b *scriptBackend) AdaptSpec(spec *specs.Spec, pairs []gpu.UUIDPair) error {
	var uuids []string
	for _, p := range pairs {
		uuids = append(uuids, p.New)
	}
	spec.Process.Env = []string{"GPUS=" + strings.Join(uuids, ",")}
	return nil
}

// runcStub is the inner task service: a task in a given status with PIDs; its Checkpoint
// can fail; Pause and Resume flip the status.
type runcStub struct {
	taskAPI.TTRPCTaskService
	bundle    string
	status    task.Status
	pids      []uint32
	dumpErr   error
	pauseErr  error // Pause fails with it, leaving the task running
	dumped    bool
	statusLog []string
}

func (r *runcStub) State(context.Context, *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	return &taskAPI.StateResponse{Bundle: r.bundle, Status: r.status}, nil
}
func (r *runcStub) Pids(context.Context, *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	resp := &taskAPI.PidsResponse{}
	for _, p := range r.pids {
		resp.Processes = append(resp.Processes, &task.ProcessInfo{Pid: p})
	}
	return resp, nil
}
func (r *runcStub) Pause(context.Context, *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	if r.pauseErr != nil {
		r.statusLog = append(r.statusLog, "pause failed")
		return nil, r.pauseErr
	}
	r.status = task.Status_PAUSED
	r.statusLog = append(r.statusLog, "pause")
	return &ptypes.Empty{}, nil
}
func (r *runcStub) Resume(context.Context, *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	r.status = task.Status_RUNNING
	r.statusLog = append(r.statusLog, "resume")
	return &ptypes.Empty{}, nil
}
func (r *runcStub) Checkpoint(_ context.Context, req *taskAPI.CheckpointTaskRequest) (*ptypes.Empty, error) {
	r.statusLog = append(r.statusLog, "dump:"+r.status.String())
	if r.dumpErr != nil {
		return nil, r.dumpErr
	}
	r.dumped = true
	return &ptypes.Empty{}, os.WriteFile(filepath.Join(req.Path, "pages-1.img"), []byte("pages"), 0o600)
}

func gpuFixture(t *testing.T, status task.Status) (*Service, *runcStub, *scriptDriver) {
	t.Helper()
	bundle := t.TempDir()
	spec := specs.Spec{Process: &specs.Process{Env: []string{"GPUS=GPU-a"}}}
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	drv := &scriptDriver{
		vers:  gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"},
		state: map[int]gpu.ProcessState{101: gpu.StateRunning, 102: gpu.StateRunning}, // 100 is not CUDA
		fail:  map[string]int{},
	}
	inner := &runcStub{bundle: bundle, status: status, pids: []uint32{100, 101, 102}}
	s := NewService(inner, DefaultConfig(), Deps{
		Fingerprint: func(context.Context) (fingerprint.Fingerprint, error) { return nodeFP, nil },
		DumpStats:   func(string) (checkpoint.CRIUStats, error) { return checkpoint.CRIUStats{}, nil },
		GPU: &scriptBackend{drv: drv, devs: []gpu.Device{{UUID: "GPU-a", Name: "H200", MemoryTotal: 1 << 30}},
			usage: map[int]map[string]uint64{101: {"GPU-a": 1 << 20}, 102: {"GPU-a": 2 << 20, "GPU-other": 1 << 20}}},
	})
	return s, inner, drv
}

// TestGPUCheckpointRefusesMIG: a container on a GPU in MIG mode is refused before anything is
// thawed or locked, naming the GPU (issue 21: the driver would fail the checkpoint with an
// out-of-memory error that names nothing).
func TestGPUCheckpointRefusesMIG(t *testing.T) {
	s, inner, drv := gpuFixture(t, task.Status_PAUSED)
	s.deps.GPU.(*scriptBackend).devs[0].MIG = true
	_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
	if !errors.Is(err, gpu.ErrUnsupported) && (err == nil || !strings.Contains(err.Error(), "MIG mode")) {
		t.Fatalf("checkpoint on a MIG GPU: %v", err)
	}
	if len(drv.calls) != 0 || len(inner.statusLog) != 0 {
		t.Errorf("driver calls %v, task status changes %v: want none", drv.calls, inner.statusLog)
	}
}

func TestGPUCheckpoint(t *testing.T) {
	tests := []struct {
		name      string
		status    task.Status
		fail      map[string]int
		dumpErr   error
		wantErr   []string
		wantCalls string
		wantLog   string
	}{
		{name: "leave-running from a frozen task", status: task.Status_PAUSED,
			wantCalls: "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102",
			wantLog:   "resume,pause,dump:PAUSED,resume,pause"},
		{name: "running task", status: task.Status_RUNNING,
			wantCalls: "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102",
			wantLog:   "dump:RUNNING"},
		{name: "second lock times out: the first is unlocked", status: task.Status_PAUSED, fail: map[string]int{"lock": 102},
			wantErr:   []string{"GPU lock of pid 102", "timed out"},
			wantCalls: "lock 101,lock 102,unlock 101", wantLog: "resume,pause"},
		{name: "checkpoint fails: both restored and unlocked", status: task.Status_RUNNING, fail: map[string]int{"checkpoint": 102},
			wantErr:   []string{"GPU checkpoint of pid 102"},
			wantCalls: "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,unlock 101,unlock 102"},
		{name: "CRIU fails after the GPU checkpoint: everything given back", status: task.Status_PAUSED, dumpErr: errors.New("criu failed"),
			wantErr:   []string{"criu failed"},
			wantCalls: "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102",
			wantLog:   "resume,pause,dump:PAUSED,resume,pause"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, inner, drv := gpuFixture(t, tc.status)
			if tc.fail != nil {
				drv.fail = tc.fail
			}
			inner.dumpErr = tc.dumpErr
			path := t.TempDir()
			_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: path})
			if got := strings.Join(drv.calls, ","); got != tc.wantCalls {
				t.Errorf("driver calls\n got %s\nwant %s", got, tc.wantCalls)
			}
			if tc.wantLog != "" && strings.Join(inner.statusLog, ",") != tc.wantLog {
				t.Errorf("task status changes %v, want %s", inner.statusLog, tc.wantLog)
			}
			if inner.status != tc.status {
				t.Errorf("task left %s, was %s", inner.status, tc.status)
			}
			for pid, st := range drv.state {
				if st != gpu.StateRunning {
					t.Errorf("pid %d left %s: the workload must keep running with its GPUs unlocked", pid, st)
				}
			}
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatal("no error")
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not name %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			m, err := checkpoint.ReadManifest(path)
			if err != nil {
				t.Fatal(err)
			}
			if m.GPU == nil || len(m.GPU.Devices) != 1 || m.GPU.Devices[0].UUID != "GPU-a" || fmt.Sprint(m.GPU.PIDs) != "[101 102]" ||
				m.GPU.Driver != "580.65.06" || len(m.Fingerprint.GPUs) != 1 {
				t.Errorf("manifest GPU state %+v, fingerprint GPUs %+v", m.GPU, m.Fingerprint.GPUs)
			}
			if m.GPU != nil && len(m.GPU.Devices) == 1 && m.GPU.Devices[0].MemoryUsed != 3<<20 {
				t.Errorf("GPU-a memory used %d, want %d (the inventory's per-process memory of pids 101 and 102)", m.GPU.Devices[0].MemoryUsed, 3<<20)
			}
		})
	}
}

func TestPlanGPURestore(t *testing.T) {
	ckpt := &checkpoint.GPUState{Driver: "580.65.06", CUDA: "12.8", Devices: []checkpoint.GPUDevice{{UUID: "GPU-a", Name: "H200", MemoryTotal: 1 << 30, MemoryUsed: 1 << 20}}}
	dev := func(uuid, name string, used uint64) gpu.Device {
		return gpu.Device{UUID: uuid, Name: name, MemoryTotal: 1 << 30, MemoryUsed: used}
	}
	tests := []struct {
		name    string
		vers    gpu.Versions
		devs    []gpu.Device
		want    string
		wantErr []string
		grant   string // GPUs the destination spec already names (GPUS=); "" none
		pod     bool   // the destination is a Kubernetes pod (CRI sandbox namespace annotation)
	}{
		{"same GPU", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-x", "H200", 0), dev("GPU-a", "H200", 0)}, "GPU-a", nil, "", false},
		{"mapped to the same model", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-x", "A100", 0), dev("GPU-b", "H200", 0)}, "GPU-b", nil, "", false},
		{"idle before busy of the same model", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-x", "H200", 5<<20), dev("GPU-y", "H200", 0)}, "GPU-y", nil, "", false},
		{"own GPU full: an idle one of the model", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 1<<30), dev("GPU-y", "H200", 0)}, "GPU-y", nil, "", false},
		{"other model", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-x", "A100", 0)}, "", []string{"gpu[0]", "H200", "A100"}, "", false},
		{"fewer GPUs", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, nil, "", []string{"gpus", `"1"`, `"0"`}, "", false},
		{"other driver", gpu.Versions{Driver: "575.51.03", DriverMajor: 575, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0)}, "", []string{"gpu.driver", "580.65.06", "575.51.03"}, "", false},
		{"other CUDA", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.9"}, []gpu.Device{dev("GPU-a", "H200", 0)}, "", []string{"gpu.cuda", "12.8", "12.9"}, "", false},
		{"too little free memory", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 1<<30)}, "", []string{"gpu[0].memoryFree", "1048576 bytes needed", "0 bytes free"}, "", false},
		// a restore never gives more than the spec grants: the pod's own GPUs, or none
		{"pod granted another GPU than its own", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0), dev("GPU-b", "H200", 0)}, "GPU-b", nil, "GPU-b", true},
		{"pod granted a GPU of another model", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0), dev("GPU-x", "A100", 0)}, "", []string{"gpu[0]", "H200", "A100"}, "GPU-x", true},
		{"pod granted its own GPU", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0), dev("GPU-b", "H200", 0)}, "GPU-a", nil, "GPU-a", true},
		{"pod granted no GPUs", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0)}, "", []string{"gpus", "0 granted to the pod"}, "", true},
		{"pod granted two GPUs for one", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0), dev("GPU-b", "H200", 0)}, "", []string{"gpus", "2 granted to the pod"}, "GPU-a,GPU-b", true},
		{"outside Kubernetes the spec names the source's GPU", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-b", "H200", 0)}, "GPU-b", nil, "GPU-a", false},
		{"onto a GPU in MIG mode (issue 21)", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{{UUID: "GPU-a", Name: "H200", MemoryTotal: 1 << 30, MIG: true}}, "", []string{"GPU-a", "MIG mode", "does not support"}, "", false},
		{"pod granted a GPU the node lacks", gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "12.8"}, []gpu.Device{dev("GPU-a", "H200", 0)}, "", []string{"GPU-q", "not on this node"}, "GPU-q", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			drv := &scriptDriver{vers: tc.vers}
			s := NewService(nil, DefaultConfig(), Deps{GPU: &scriptBackend{drv: drv, devs: tc.devs}})
			env := "X=1"
			if tc.grant != "" {
				env = "GPUS=" + tc.grant
			}
			spec := &specs.Spec{Process: &specs.Process{Env: []string{env}}}
			if tc.pod {
				spec.Annotations = map[string]string{oci.AnnotationCRISandboxNamespace: "team-a"}
			}
			choice, err := s.planGPURestore(spec, ckpt)
			pairs := choice.Pairs
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatalf("no error; pairs %v", pairs)
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not name %q", err, w)
					}
				}
				if spec.Process.Env[0] != env {
					t.Errorf("spec changed by a refused restore: %v", spec.Process.Env)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(pairs) != 1 || pairs[0].New != tc.want || spec.Process.Env[0] != "GPUS="+tc.want {
				t.Errorf("pairs %v, spec env %v; want GPU-a -> %s", pairs, spec.Process.Env, tc.want)
			}
		})
	}
}

// TestGPUSessionUndo takes a session of a frozen task forward to each step and back: undo starts
// from the step reached and gives every process back its GPUs and the task its freeze.
func TestGPUSessionUndo(t *testing.T) {
	tests := []struct {
		to        gpuStep
		wantCalls string
		wantLog   string
	}{
		{gpuFound, "", ""},
		{gpuThawed, "", "resume,pause"},
		{gpuLocked, "lock 101,lock 102,unlock 101,unlock 102", "resume,pause"},
		{gpuCheckpointed, "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102", "resume,pause"},
		{gpuRefrozen, "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102", "resume,pause,resume,pause"},
	}
	for _, tc := range tests {
		t.Run(tc.to.String(), func(t *testing.T) {
			_, inner, drv := gpuFixture(t, task.Status_PAUSED)
			g := &gpuSession{tasks: inner, id: "c", drv: drv, frozen: true, phases: checkpoint.NewPhases(nil),
				procs: []gpuProc{{pid: 101, state: gpu.StateRunning}, {pid: 102, state: gpu.StateRunning}}}
			for g.step < tc.to {
				if err := g.forward(context.Background()); err != nil {
					t.Fatal(err)
				}
			}
			if err := g.undo(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(drv.calls, ","); got != tc.wantCalls {
				t.Errorf("driver calls\n got %s\nwant %s", got, tc.wantCalls)
			}
			if got := strings.Join(inner.statusLog, ","); got != tc.wantLog {
				t.Errorf("task status changes %q, want %q", got, tc.wantLog)
			}
			if g.step != gpuFound || inner.status != task.Status_PAUSED {
				t.Errorf("after undo: step %s, task %s", g.step, inner.status)
			}
			for pid, st := range drv.state {
				if st != gpu.StateRunning {
					t.Errorf("pid %d left %s", pid, st)
				}
			}
		})
	}
}

// TestGPUCheckpointRefreezeFails: the task does not freeze again after the GPU checkpoint, so the
// session is undone from checkpointed (not refrozen): the GPUs are given back, and the error says
// which step failed.
func TestGPUCheckpointRefreezeFails(t *testing.T) {
	s, inner, drv := gpuFixture(t, task.Status_PAUSED)
	inner.pauseErr = errors.New("cgroup freeze failed")
	_, err := s.Checkpoint(context.Background(), &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
	if err == nil || !strings.Contains(err.Error(), "freeze task again after the GPU checkpoint") || !strings.Contains(err.Error(), "cgroup freeze failed") {
		t.Fatalf("error %v", err)
	}
	want := "lock 101,lock 102,checkpoint 101,checkpoint 102,restore 101,restore 102,unlock 101,unlock 102"
	if got := strings.Join(drv.calls, ","); got != want {
		t.Errorf("driver calls\n got %s\nwant %s", got, want)
	}
	if inner.dumped {
		t.Error("CRIU dumped a task that was not frozen again")
	}
	for pid, st := range drv.state {
		if st != gpu.StateRunning {
			t.Errorf("pid %d left %s", pid, st)
		}
	}
}
