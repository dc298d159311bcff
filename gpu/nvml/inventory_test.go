package nvml

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// fakeLib is an NVML that answers from tables.
type fakeLib struct {
	driver    string
	cuda      int
	devs      []DeviceInfo
	links     [][]NVLink
	ancestors map[[2]int]Ancestor
	countErr  error
	procs     map[int][]Process // GPU index -> nvmlDeviceGetComputeRunningProcesses
	procsErr  map[int]error
}

func (f *fakeLib) DriverVersion() (string, error)  { return f.driver, nil }
func (f *fakeLib) CUDADriverVersion() (int, error) { return f.cuda, nil }
func (f *fakeLib) DeviceCount() (int, error)       { return len(f.devs), f.countErr }
func (f *fakeLib) Device(i int) (DeviceInfo, error) {
	return f.devs[i], nil
}
func (f *fakeLib) NVLinks(i int) ([]NVLink, error) {
	if f.links == nil {
		return nil, nil
	}
	return f.links[i], nil
}
func (f *fakeLib) ComputeProcesses(i int) ([]Process, error) {
	return f.procs[i], f.procsErr[i]
}
func (f *fakeLib) CommonAncestor(i, j int) (Ancestor, error) {
	if i > j {
		i, j = j, i
	}
	a, ok := f.ancestors[[2]int{i, j}]
	if !ok {
		return 0, fmt.Errorf("no ancestor for %d-%d", i, j)
	}
	return a, nil
}

func gpuBus(i int) string    { return fmt.Sprintf("00000000:%02X:00.0", 0x18+i*0x10) }
func switchBus(s int) string { return fmt.Sprintf("00000000:%02X:00.0", 0xA0+s) }

// fakeFromFixture builds an NVML whose answers should give the topology of fixture: NV# pairs as
// direct GPU-to-GPU links, or, with switches, as links from every GPU to NVSwitches
// (perSwitch[s] links to switch s, every link's remote end the switch); PCIe classes as common
// ancestors; CPU affinity from the fixture; NUMA nodes written into a sysfs tree under root.
func fakeFromFixture(t *testing.T, want *topology.Topology, perSwitch []int, remote RemoteType, root string) *fakeLib {
	t.Helper()
	n := len(want.GPUs)
	f := &fakeLib{driver: "580.65.06", cuda: 13000, links: make([][]NVLink, n), ancestors: map[[2]int]Ancestor{}}
	level := map[topology.Link]Ancestor{topology.PIX: AncestorSingle, topology.PXB: AncestorMultiple,
		topology.PHB: AncestorHostBridge, topology.NODE: AncestorNode, topology.SYS: AncestorSystem}
	for i, g := range want.GPUs {
		f.devs = append(f.devs, DeviceInfo{
			UUID: fmt.Sprintf("GPU-%08x-0000-0000-0000-000000000000", i), Name: "NVIDIA H100 80GB HBM3",
			Arch: "hopper", CCMajor: 9, MemoryTotal: 80 << 30, MemoryUsed: 1 << 20,
			PCIBusID: gpuBus(i), Minor: i, CPUAffinity: g.CPUs, Persistence: true,
		})
		if len(g.NUMA) == 1 {
			dir := filepath.Join(root, "bus", "pci", "devices", NormalizeBusID(gpuBus(i)))
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte(fmt.Sprintf("%d\n", g.NUMA[0])), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		link := 0
		for s, k := range perSwitch {
			for range k {
				f.links[i] = append(f.links[i], NVLink{Link: link, RemoteBusID: switchBus(s), Remote: remote})
				link++
			}
		}
		for j := range n {
			l := want.Link(i, j)
			switch {
			case i == j:
			case l.Kind == topology.LinkNVLink && perSwitch == nil:
				for range l.NVLinks {
					f.links[i] = append(f.links[i], NVLink{Link: link, RemoteBusID: gpuBus(j), Remote: remote})
					link++
				}
			case l.Kind != topology.LinkNVLink && i < j:
				f.ancestors[[2]int{i, j}] = level[l]
			}
		}
	}
	return f
}

func parseFixture(t *testing.T, name string) *topology.Topology {
	t.Helper()
	fh, err := os.Open(filepath.Join("testdata", name)) // copies of ../topology/testdata/topologies
	if err != nil {
		t.Fatalf("fixture %s: %v", name, err)
	}
	defer fh.Close()
	tp, err := topology.Parse(fh)
	if err != nil {
		t.Fatal(err)
	}
	return tp
}

func TestTopologyFromNVML(t *testing.T) {
	for _, c := range []struct {
		name      string
		fixture   string
		perSwitch []int
		remote    RemoteType
	}{
		// HGX H100: 18 links per GPU over 4 NVSwitches; no link ends at a GPU.
		{"nvswitch", "05-dgx-h100.tsv", []int{5, 4, 4, 5}, RemoteSwitch},
		// The same on a driver that cannot say what the remote end is: the bus id is no GPU's.
		{"nvswitch, remote type unknown", "05-dgx-h100.tsv", []int{5, 4, 4, 5}, RemoteUnknown},
		{"nvlink bridge pairs", "02-8gpu-nvlink-bridge-pairs.tsv", nil, RemoteGPU},
		{"dgx-1 hybrid cube mesh", "01-dgx1-v100.tsv", nil, RemoteGPU},
		{"dgx-1, remote type unknown", "01-dgx1-v100.tsv", nil, RemoteUnknown},
		{"pcie only", "07-4xl40s-pcie.tsv", nil, RemoteGPU},
	} {
		t.Run(c.name, func(t *testing.T) {
			want := parseFixture(t, c.fixture)
			root := t.TempDir()
			inv := New(fakeFromFixture(t, want, c.perSwitch, c.remote, root), WithSysfsRoot(root))
			got, err := inv.Topology()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("topology from NVML:\n%s\nwant (%s):\n%s", got, c.fixture, want)
			}
		})
	}
}

// A switch board where one GPU lost a link to one switch: its pairs drop to NV17, the rest
// stay NV18.
func TestTopologyDegradedSwitchLink(t *testing.T) {
	want := parseFixture(t, "05-dgx-h100.tsv")
	root := t.TempDir()
	f := fakeFromFixture(t, want, []int{5, 4, 4, 5}, RemoteSwitch, root)
	f.links[3] = f.links[3][1:]
	got, err := New(f, WithSysfsRoot(root)).Topology()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		for j := range 8 {
			wantL := topology.NV(18)
			switch {
			case i == j:
				wantL = topology.Self
			case i == 3 || j == 3:
				wantL = topology.NV(17)
			}
			if got.Link(i, j) != wantL {
				t.Errorf("GPU%d-GPU%d = %s, want %s", i, j, got.Link(i, j), wantL)
			}
		}
	}
}

func TestDevicesAndVersions(t *testing.T) {
	root := t.TempDir()
	want := parseFixture(t, "07-4xl40s-pcie.tsv")
	f := fakeFromFixture(t, want, nil, RemoteGPU, root)
	f.devs[1].MIG = true
	f.devs[2].Minor = -1
	f.devs[2].CCMajor, f.devs[2].CCMinor = 8, 9
	// GPU 3 has no numa_node file: NUMANode -1.
	if err := os.RemoveAll(filepath.Join(root, "bus", "pci", "devices", NormalizeBusID(gpuBus(3)))); err != nil {
		t.Fatal(err)
	}
	inv := New(f, WithSysfsRoot(root))
	devs, err := inv.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 4 {
		t.Fatalf("%d devices", len(devs))
	}
	d0 := devs[0]
	wantD0 := gpu.Device{Index: 0, UUID: "GPU-00000000-0000-0000-0000-000000000000", Name: "NVIDIA H100 80GB HBM3",
		Arch: "hopper", ComputeCapability: "9.0", MemoryTotal: 80 << 30, MemoryUsed: 1 << 20,
		PCIBusID: "0000:18:00.0", NUMANode: 0, CPUAffinity: want.GPUs[0].CPUs,
		DevicePaths: []string{"/dev/nvidia0"}, Persistence: true}
	if !reflect.DeepEqual(d0, wantD0) {
		t.Errorf("device 0 = %+v\nwant %+v", d0, wantD0)
	}
	if !devs[1].MIG || devs[2].DevicePaths != nil || devs[2].ComputeCapability != "8.9" || devs[2].NUMANode != 1 || devs[3].NUMANode != -1 {
		t.Errorf("devices = %+v", devs)
	}
	v, err := inv.Versions()
	if err != nil || v != (gpu.Versions{Driver: "580.65.06", DriverMajor: 580, CUDA: "13.0"}) {
		t.Errorf("Versions = %+v, %v", v, err)
	}
	snap, err := inv.Snapshot()
	if err != nil || len(snap.Devices) != 4 || snap.Topology.Link(0, 1) != topology.NODE {
		t.Errorf("Snapshot = %+v, %v", snap, err)
	}
}

func TestErrors(t *testing.T) {
	f := &fakeLib{driver: "garbage", cuda: 12080, countErr: errors.New("boom")}
	if _, err := New(f).Versions(); err == nil || !strings.Contains(err.Error(), "garbage") {
		t.Errorf("Versions(garbage) = %v", err)
	}
	if _, err := New(f).Devices(); err == nil || !strings.Contains(err.Error(), "count GPUs") {
		t.Errorf("Devices = %v", err)
	}
	// An NVML topology level berth does not know is an error, not a guess.
	root := t.TempDir()
	want := parseFixture(t, "07-4xl40s-pcie.tsv")
	f = fakeFromFixture(t, want, nil, RemoteGPU, root)
	f.ancestors[[2]int{0, 1}] = 35
	if _, err := New(f, WithSysfsRoot(root)).Topology(); err == nil || !strings.Contains(err.Error(), "GPU 0 and GPU 1") {
		t.Errorf("Topology(unknown level) = %v", err)
	}
	if _, err := New(&fakeLib{}).Topology(); err == nil {
		t.Error("Topology(no GPUs): no error")
	}
}

func TestAncestorLink(t *testing.T) {
	for a, want := range map[Ancestor]topology.Link{AncestorInternal: topology.PIX, AncestorSingle: topology.PIX,
		AncestorMultiple: topology.PXB, AncestorHostBridge: topology.PHB, AncestorNode: topology.NODE, AncestorSystem: topology.SYS} {
		if got, err := a.Link(); err != nil || got != want {
			t.Errorf("Ancestor(%d).Link() = %v, %v; want %v", a, got, err, want)
		}
	}
	if _, err := Ancestor(60).Link(); err == nil {
		t.Error("Ancestor(60): no error")
	}
}

func TestHelpers(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:18:00.0": "0000:18:00.0",
		"00000000:AB:00.0": "0000:ab:00.0",
		"0000:18:00.0":     "0000:18:00.0",
		"00010000:18:00.0": "00010000:18:00.0",
		"garbage":          "garbage",
	} {
		if got := NormalizeBusID(in); got != want {
			t.Errorf("NormalizeBusID(%q) = %q, want %q", in, got, want)
		}
	}
	if got := CPUMaskIDs([]uint64{0b1011, 1 << 63}, 64); !reflect.DeepEqual(got, []int{0, 1, 3, 127}) {
		t.Errorf("CPUMaskIDs = %v", got)
	}
	if got := CPUMaskIDs([]uint64{1, 1}, 32); !reflect.DeepEqual(got, []int{0, 32}) {
		t.Errorf("CPUMaskIDs(32-bit) = %v", got)
	}
	if ArchName(9) != "hopper" || ArchName(4294967295) != "" {
		t.Error("ArchName")
	}
}

func TestOpenFailsClearly(t *testing.T) {
	_, err := Open(WithLibraryPath("/nonexistent/libnvidia-ml.so.1"))
	if !errors.Is(err, gpu.ErrUnsupported) || !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Open(missing) = %v, want ErrUnsupported", err)
	}
	t.Log(err)
}

func TestProcessMemory(t *testing.T) {
	devs := []DeviceInfo{{UUID: "GPU-a", Name: "NVIDIA H200"}, {UUID: "GPU-b", Name: "NVIDIA H200"}, {UUID: "GPU-c", Name: "NVIDIA H200"}}
	tests := []struct {
		name     string
		procs    map[int][]Process
		procsErr map[int]error
		pid      int
		want     map[string]uint64
		wantErr  []string
		unsup    bool
	}{
		{name: "one GPU", pid: 100,
			procs: map[int][]Process{0: {{PID: 99, UsedMemory: 1 << 30}, {PID: 100, UsedMemory: 512 << 20}}},
			want:  map[string]uint64{"GPU-a": 512 << 20}},
		{name: "two GPUs, another process on the third", pid: 100,
			procs: map[int][]Process{0: {{PID: 100, UsedMemory: 1 << 20}}, 1: {{PID: 100, UsedMemory: 2 << 20}}, 2: {{PID: 7, UsedMemory: 3 << 20}}},
			want:  map[string]uint64{"GPU-a": 1 << 20, "GPU-b": 2 << 20}},
		{name: "several entries on one GPU are added", pid: 100,
			procs: map[int][]Process{1: {{PID: 100, UsedMemory: 1 << 20}, {PID: 100, UsedMemory: 1 << 20}}},
			want:  map[string]uint64{"GPU-b": 2 << 20}},
		{name: "listed with no memory yet", pid: 100,
			procs: map[int][]Process{2: {{PID: 100}}},
			want:  map[string]uint64{"GPU-c": 0}},
		{name: "not a CUDA process", pid: 100,
			procs: map[int][]Process{0: {{PID: 99, UsedMemory: 1 << 20}}},
			want:  map[string]uint64{}},
		{name: "value not available", pid: 100,
			procs:   map[int][]Process{1: {{PID: 100, UsedMemory: MemoryNotAvailable}}},
			wantErr: []string{"pid 100", "GPU 1", "not available"}, unsup: true},
		{name: "GPU cannot list processes", pid: 100,
			procsErr: map[int]error{2: fmt.Errorf("nvmlDeviceGetComputeRunningProcesses: Not Supported: %w", gpu.ErrUnsupported)},
			wantErr:  []string{"processes on GPU 2", "Not Supported"}, unsup: true},
		{name: "NVML fails", pid: 100,
			procsErr: map[int]error{0: errors.New("GPU is lost")},
			wantErr:  []string{"processes on GPU 0", "GPU is lost"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			inv := New(&fakeLib{devs: devs, procs: tc.procs, procsErr: tc.procsErr})
			got, err := inv.ProcessMemory(tc.pid)
			if len(tc.wantErr) > 0 {
				if err == nil {
					t.Fatalf("no error; got %v", got)
				}
				for _, w := range tc.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not name %q", err, w)
					}
				}
				if errors.Is(err, gpu.ErrUnsupported) != tc.unsup {
					t.Errorf("error %q: errors.Is(gpu.ErrUnsupported) = %v, want %v", err, !tc.unsup, tc.unsup)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("ProcessMemory(%d) = %v, want %v", tc.pid, got, tc.want)
			}
		})
	}
}
