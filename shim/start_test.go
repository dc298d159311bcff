package shim

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"

	"github.com/berth-dev/berth/gpu"
)

// startStub is runc's task service for Start: it starts (restores) the task as pid 4242 and
// records kills.
type startStub struct {
	*runcStub
	started, killed int
}

func (r *startStub) Start(context.Context, *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	r.started++
	return &taskAPI.StartResponse{Pid: 4242}, nil
}
func (r *startStub) Kill(context.Context, *taskAPI.KillRequest) (*ptypes.Empty, error) {
	r.killed++
	return &ptypes.Empty{}, nil
}
func (r *startStub) Wait(context.Context, *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	return &taskAPI.WaitResponse{}, nil
}

// tick returns a clock that advances by 2 ms on every reading.
func tick() func() time.Time {
	t := time.Unix(1700000000, 0)
	return func() time.Time {
		t = t.Add(2 * time.Millisecond)
		return t
	}
}

// TestStartRestoreReport restores a task created from a checkpoint and reads the phases Start
// reports in the bundle's berth-restore.json.
func TestStartRestoreReport(t *testing.T) {
	pairs := []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-b"}}
	tests := []struct {
		name       string
		pairs      []gpu.UUIDPair
		fail       map[string]int
		wantPhases []string
		wantErr    []string
		wantCalls  string
	}{
		{name: "without GPUs", wantPhases: []string{"criu-restore"}},
		{name: "GPU checkpoint", pairs: pairs, wantPhases: []string{"criu-restore", "gpu-restore", "gpu-unlock"},
			wantCalls: "restore 101,unlock 101"},
		{name: "GPU restore fails: reported, task killed", pairs: pairs, fail: map[string]int{"restore": 101},
			wantPhases: []string{"criu-restore", "gpu-restore"}, wantCalls: "restore 101",
			wantErr: []string{"restore c: GPU restore of pid 101", "the task was killed", "is intact"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, inner, drv := gpuFixture(t, task.Status_CREATED)
			drv.state = map[int]gpu.ProcessState{101: gpu.StateCheckpointed}
			if tc.fail != nil {
				drv.fail = tc.fail
			}
			stub := &startStub{runcStub: inner}
			s := NewService(stub, DefaultConfig(), Deps{Now: tick(), GPU: &scriptBackend{drv: drv}})
			bundle := t.TempDir()
			extracted := t.TempDir()
			s.tasks["c"] = &restoredTask{status: restoreCreated, bundle: bundle,
				plan: heldPlan(t, &restorePlan{dir: extracted, extracted: extracted, gpuPairs: tc.pairs})}

			resp, err := s.Start(context.Background(), &taskAPI.StartRequest{ID: "c"})
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatal("no error")
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not name %q", err, w)
					}
				}
				if stub.killed != 1 {
					t.Errorf("task killed %d times, want once", stub.killed)
				}
			} else if err != nil || resp.Pid != 4242 {
				t.Fatalf("Start = %+v, %v", resp, err)
			}
			if got := strings.Join(drv.calls, ","); got != tc.wantCalls {
				t.Errorf("driver calls %q, want %q", got, tc.wantCalls)
			}
			b, err := os.ReadFile(filepath.Join(bundle, RestoreReportFile))
			if err != nil {
				t.Fatal(err)
			}
			var rep RestoreReport
			if err := json.Unmarshal(b, &rep); err != nil {
				t.Fatalf("%s: %v", b, err)
			}
			var names []string
			for _, p := range rep.Phases {
				names = append(names, p.Name)
				if p.Ms != 2 { // one tick of the clock
					t.Errorf("phase %s: %v ms, want 2", p.Name, p.Ms)
				}
			}
			if !reflect.DeepEqual(names, tc.wantPhases) {
				t.Errorf("phases %v, want %v", names, tc.wantPhases)
			}
			if rep.TotalMs < float64(2*len(rep.Phases)) {
				t.Errorf("total %v ms is less than its phases %+v", rep.TotalMs, rep.Phases)
			}
			if _, err := os.Stat(extracted); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("extracted checkpoint %s left after Start: %v", extracted, err)
			}
			// the record's restore ran once: a second Start is runc's alone
			calls := len(drv.calls)
			if _, err := s.Start(context.Background(), &taskAPI.StartRequest{ID: "c"}); err != nil || stub.started != 2 || len(drv.calls) != calls {
				t.Errorf("second Start: %v, runc starts %d, driver calls %v", err, stub.started, drv.calls)
			}
		})
	}
}

// TestStartFreshTask: a task not created from a checkpoint is runc's: no restore, no report.
func TestStartFreshTask(t *testing.T) {
	_, inner, _ := gpuFixture(t, task.Status_CREATED)
	stub := &startStub{runcStub: inner}
	s := NewService(stub, DefaultConfig(), Deps{Now: tick()})
	if resp, err := s.Start(context.Background(), &taskAPI.StartRequest{ID: "c"}); err != nil || resp.Pid != 4242 {
		t.Fatalf("Start = %+v, %v", resp, err)
	}
	if _, err := os.Stat(filepath.Join(inner.bundle, RestoreReportFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("report written for a fresh task: %v", err)
	}
}

// TestRestoredTaskRecord: Delete forgets the record and releases what it holds.
func TestRestoredTaskRecord(t *testing.T) {
	extracted := t.TempDir()
	fifo, err := os.CreateTemp(t.TempDir(), "stdin")
	if err != nil {
		t.Fatal(err)
	}
	s := NewService(&deleteStub{}, DefaultConfig(), Deps{})
	s.tasks["c"] = &restoredTask{status: restoreCreated, plan: &restorePlan{extracted: extracted}, stdin: fifo}
	if _, err := s.Delete(context.Background(), &taskAPI.DeleteRequest{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if len(s.tasks) != 0 {
		t.Errorf("record kept: %+v", s.tasks)
	}
	if _, err := os.Stat(extracted); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a restore that never started was not cleaned up: %v", err)
	}
	if _, err := fifo.Write([]byte("x")); err == nil {
		t.Error("the stdin FIFO is still open")
	}
}

type deleteStub struct{ taskAPI.TTRPCTaskService }

func (deleteStub) Delete(context.Context, *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	return &taskAPI.DeleteResponse{}, nil
}
