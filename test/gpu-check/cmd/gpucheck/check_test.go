package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/cuda"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/nvml"
	"github.com/berth-dev/berth/gpu/topology"
)

// stubDriver is a minimal in-memory gpu.Driver for the program's plumbing (the real contract is
// tested in gpu/cuda against a fake libcuda).
type stubDriver struct {
	state    gpu.ProcessState
	v        gpu.Versions
	lockErr  error
	gotPairs []gpu.UUIDPair
}

func (s *stubDriver) Versions() (gpu.Versions, error)      { return s.v, nil }
func (s *stubDriver) State(int) (gpu.ProcessState, error)  { return s.state, nil }
func (s *stubDriver) RestoreThreadID(pid int) (int, error) { return pid + 1, nil }
func (s *stubDriver) Lock(int, time.Duration) error        { s.state = gpu.StateLocked; return s.lockErr }
func (s *stubDriver) Checkpoint(int) error                 { s.state = gpu.StateCheckpointed; return nil }
func (s *stubDriver) Unlock(int) error                     { s.state = gpu.StateRunning; return nil }
func (s *stubDriver) Restore(_ int, p []gpu.UUIDPair) error {
	s.gotPairs = p
	s.state = gpu.StateLocked
	return nil
}

type stubInventory struct{ snap nvml.Snapshot }

func (s stubInventory) Snapshot() (nvml.Snapshot, error) { return s.snap, nil }
func (s stubInventory) Close() error                     { return nil }

func testDeps(drv *stubDriver, loadErr, invErr error) deps {
	return deps{
		loadDriver: func(string) (gpu.Driver, error) {
			if loadErr != nil {
				return nil, loadErr
			}
			return drv, nil
		},
		openInventory: func(string) (inventory, error) {
			if invErr != nil {
				return nil, invErr
			}
			t := &topology.Topology{GPUs: []topology.GPU{{Index: 0, CPUs: []int{0, 1, 2, 3}, NUMA: []int{0}, GPUNUMA: -1}},
				Links: [][]topology.Link{{topology.Self}}}
			return stubInventory{nvml.Snapshot{
				Versions: gpu.Versions{Driver: "575.51.03", DriverMajor: 575, CUDA: "12.9"},
				Devices:  []gpu.Device{{Index: 0, UUID: "GPU-1", Name: "NVIDIA H200", Arch: "hopper", MemoryTotal: 100, MemoryUsed: 40}},
				Topology: t,
			}}, nil
		},
	}
}

func TestSteps(t *testing.T) {
	drv := &stubDriver{v: gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "13.0"}}
	var out, errb bytes.Buffer
	rc := run([]string{"steps", "--pid", "42", "--steps", "lock,checkpoint,restore,unlock", "--bytes", "4000000000",
		"--pairs", "GPU-a=GPU-b"}, &out, &errb, testDeps(drv, nil, nil))
	if rc != exitOK {
		t.Fatalf("rc %d, stderr %s", rc, errb.String())
	}
	var rep ProcessReport
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	wantStates := []string{"locked", "checkpointed", "locked", "running"}
	if len(rep.Steps) != 4 {
		t.Fatalf("steps %+v", rep.Steps)
	}
	for i, s := range rep.Steps {
		if s.State != wantStates[i] || s.GBps <= 0 {
			t.Errorf("step %d = %+v, want state %s and a GB/s", i, s, wantStates[i])
		}
	}
	if rep.Versions == nil || rep.Versions.Driver != "580.65.06" || len(drv.gotPairs) != 1 || drv.gotPairs[0] != (gpu.UUIDPair{Old: "GPU-a", New: "GPU-b"}) {
		t.Errorf("report %+v, pairs %+v", rep, drv.gotPairs)
	}
}

func TestStepFailureAndUnsupported(t *testing.T) {
	drv := &stubDriver{lockErr: fmt.Errorf("lock CUDA process 42: %w", gpu.ErrTimeout)}
	var out, errb bytes.Buffer
	if rc := run([]string{"steps", "--pid", "42", "--steps", "lock,checkpoint"}, &out, &errb, testDeps(drv, nil, nil)); rc != exitFailed {
		t.Errorf("rc %d, want %d", rc, exitFailed)
	}
	var rep ProcessReport
	_ = json.Unmarshal(out.Bytes(), &rep)
	if len(rep.Steps) != 1 || !strings.Contains(rep.Error, "step lock") || !strings.Contains(rep.Error, "timed out") {
		t.Errorf("report %+v", rep)
	}
	out.Reset()
	unsup := fmt.Errorf("load CUDA driver library libcuda.so.1: %w", gpu.ErrUnsupported)
	if rc := run([]string{"lock", "--pid", "42"}, &out, &errb, testDeps(nil, unsup, nil)); rc != exitUnsupported {
		t.Errorf("rc %d, want %d", rc, exitUnsupported)
	}
	if !strings.Contains(out.String(), "libcuda.so.1") {
		t.Errorf("output %s", out.String())
	}
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{
		nil,
		{"bogus"},
		{"lock"},
		{"steps", "--pid", "1", "--steps", "lock,dance"},
		{"restore", "--pid", "1", "--pairs", "GPU-a"},
		{"lock", "--pid", "x"},
	} {
		var out, errb bytes.Buffer
		if rc := run(args, &out, &errb, testDeps(&stubDriver{}, nil, nil)); rc != exitUsage {
			t.Errorf("run(%q) = %d, want %d", args, rc, exitUsage)
		}
	}
}

func TestInventoryTopologyFingerprint(t *testing.T) {
	drv := &stubDriver{v: gpu.Versions{Driver: "575.51.03", DriverMajor: 575, CUDA: "12.9"}}
	var out, errb bytes.Buffer
	if rc := run([]string{"inventory"}, &out, &errb, testDeps(drv, nil, nil)); rc != exitOK {
		t.Fatalf("inventory rc %d", rc)
	}
	var inv InventoryReport
	if err := json.Unmarshal(out.Bytes(), &inv); err != nil || len(inv.Devices) != 1 || inv.Versions.CUDA != "12.9" {
		t.Errorf("inventory %s (%v)", out.String(), err)
	}
	out.Reset()
	if rc := run([]string{"topology"}, &out, &errb, testDeps(drv, nil, nil)); rc != exitOK || !strings.Contains(out.String(), "GPU0\tX\t0-3\t0\tN/A") {
		t.Errorf("topology rc %d: %q", rc, out.String())
	}
	out.Reset()
	if rc := run([]string{"fingerprint"}, &out, &errb, testDeps(drv, nil, nil)); rc != exitOK {
		t.Fatalf("fingerprint rc %d", rc)
	}
	var fp Fingerprint
	if err := json.Unmarshal(out.Bytes(), &fp); err != nil {
		t.Fatal(err)
	}
	if fp.GPUModel != "NVIDIA H200" || fp.GPUCount != 1 || fp.FreePerGPU[0] != 60 || fp.CheckpointAPI != "ok" || !strings.Contains(fp.UUIDRemap, ">= 580") {
		t.Errorf("fingerprint %+v", fp)
	}
	out.Reset()
	noNVML := fmt.Errorf("built without cgo: %w", gpu.ErrUnsupported)
	if rc := run([]string{"inventory"}, &out, &errb, testDeps(drv, nil, noNVML)); rc != exitUnsupported || !strings.Contains(out.String(), "without cgo") {
		t.Errorf("inventory without NVML: rc %d, %s", rc, out.String())
	}
	if !errors.Is(noNVML, gpu.ErrUnsupported) {
		t.Fatal("setup")
	}
}

// The real binary's non-GPU path on this machine: no libcuda, so exit 3 with a clear message.
func TestRealLoadWithoutDriver(t *testing.T) {
	var out, errb bytes.Buffer
	d := deps{loadDriver: func(lib string) (gpu.Driver, error) { return cuda.Load(lib) }}
	if rc := run([]string{"state", "--pid", "1", "--lib", "/nonexistent/libcuda.so.1"}, &out, &errb, d); rc != exitUnsupported {
		t.Errorf("rc %d", rc)
	}
	if !strings.Contains(out.String(), "NVIDIA driver installed") {
		t.Errorf("output %s", out.String())
	}
}

// TestHelperInventory: the helper's answers are compared with NVML's in this process (here fake
// GPU nodes stand for both; the other node also differs in its device paths): equal answers pass, a different driver version fails naming
// it, and a node without NVML exits 3.
func TestHelperInventory(t *testing.T) {
	spec := fake.NodeSpec{Driver: "580.65.06", CUDA: "12.8",
		GPUs:  []fake.GPUSpec{{UUID: "GPU-a", Name: "Fake H200", MemoryBytes: 1 << 30}, {UUID: "GPU-b", Name: "Fake H200", MemoryBytes: 1 << 30}},
		Links: [][]string{{"X", "NV4"}, {"NV4", "X"}}}
	local, err := fake.Setup(t.TempDir(), spec)
	if err != nil {
		t.Fatal(err)
	}
	same := local
	spec.Driver = "575.51.03"
	other, err := fake.Setup(t.TempDir(), spec)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		remote   *fake.Node
		localErr error
		want     int
		mismatch string
	}{
		{"same", same, nil, exitOK, ""},
		{"other driver", other, nil, exitFailed, "versions"},
		{"no NVML", same, fmt.Errorf("load libnvidia-ml.so.1: %w", gpu.ErrUnsupported), exitUnsupported, ""},
	} {
		d := deps{
			openNVML: func() (gpu.Inventory, error) {
				if tc.localErr != nil {
					return nil, tc.localErr
				}
				return local, nil
			},
			openHelper: func(string) (gpu.Inventory, func() error, error) { return tc.remote, func() error { return nil }, nil },
		}
		var out, errOut bytes.Buffer
		if rc := run([]string{"helper-inventory", "--helper", "/h"}, &out, &errOut, d); rc != tc.want {
			t.Errorf("%s: exit %d, want %d: %s%s", tc.name, rc, tc.want, out.String(), errOut.String())
			continue
		}
		var r HelperInventoryReport
		if err := json.Unmarshal(out.Bytes(), &r); err != nil {
			t.Fatalf("%s: %v: %s", tc.name, err, out.String())
		}
		switch {
		case tc.localErr != nil:
			if !strings.Contains(r.Error, "libnvidia-ml") {
				t.Errorf("%s: error %q", tc.name, r.Error)
			}
		case len(r.Compared) != 4:
			t.Errorf("%s: compared %v, want devices, versions, topology and process-memory", tc.name, r.Compared)
		case tc.mismatch == "" && len(r.Mismatches) != 0:
			t.Errorf("%s: mismatches %v", tc.name, r.Mismatches)
		case tc.mismatch != "" && !slices.ContainsFunc(r.Mismatches, func(m string) bool {
			return strings.HasPrefix(m, tc.mismatch) && strings.Contains(m, "575.51.03") && strings.Contains(m, "580.65.06")
		}):
			t.Errorf("%s: mismatches %v, want one on %s naming both values", tc.name, r.Mismatches, tc.mismatch)
		}
	}
	if rc := run([]string{"helper-inventory"}, &bytes.Buffer{}, &bytes.Buffer{}, deps{}); rc != exitUsage {
		t.Errorf("without --helper: exit %d, want %d", rc, exitUsage)
	}
}
