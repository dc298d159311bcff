package nvidia

import (
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
)

var devs = []gpu.Device{
	{Index: 0, UUID: "GPU-a", DevicePaths: []string{"/dev/nvidia0"}},
	{Index: 1, UUID: "GPU-b", DevicePaths: []string{"/dev/nvidia1"}},
	{Index: 2, UUID: "GPU-c", DevicePaths: []string{"/dev/nvidia2"}},
}

func TestContainerGPUs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     []string
		devices []specs.LinuxDevice
		want    string
		wantErr string
	}{
		{name: "uuids", env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-c,GPU-a"}, want: "GPU-c,GPU-a"},
		{name: "indices", env: []string{"NVIDIA_VISIBLE_DEVICES=1,2"}, want: "GPU-b,GPU-c"},
		{name: "all", env: []string{"NVIDIA_VISIBLE_DEVICES=all"}, want: "GPU-a,GPU-b,GPU-c"},
		{name: "none", env: []string{"NVIDIA_VISIBLE_DEVICES=void"}, want: ""},
		// issue 21: CDI (nvidia-ctk's specs, the GPU Operator's default) sets void and injects
		// the device nodes; once read as no GPUs, so a checkpoint skipped the GPU steps
		{name: "CDI: void and device nodes", env: []string{"NVIDIA_VISIBLE_DEVICES=void"},
			devices: []specs.LinuxDevice{{Path: "/dev/nvidiactl"}, {Path: "/dev/nvidia-uvm"}, {Path: "/dev/nvidia1"}}, want: "GPU-b"},
		{name: "empty and device nodes", env: []string{"NVIDIA_VISIBLE_DEVICES="},
			devices: []specs.LinuxDevice{{Path: "/dev/nvidia0"}, {Path: "/dev/nvidia2"}}, want: "GPU-a,GPU-c"},
		{name: "bad index", env: []string{"NVIDIA_VISIBLE_DEVICES=7"}, wantErr: `"7" is neither`},
		{name: "device nodes", devices: []specs.LinuxDevice{{Path: "/dev/nvidiactl"}, {Path: "/dev/nvidia2"}}, want: "GPU-c"},
		{name: "unknown device node", devices: []specs.LinuxDevice{{Path: "/dev/nvidia9"}}, wantErr: "/dev/nvidia9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := &specs.Spec{Process: &specs.Process{Env: tc.env}, Linux: &specs.Linux{Devices: tc.devices}}
			got, err := ContainerGPUs(spec, devs)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || strings.Join(got, ",") != tc.want {
				t.Errorf("got %v, %v; want %s", got, err, tc.want)
			}
		})
	}
}

func TestAdaptSpec(t *testing.T) {
	spec := &specs.Spec{
		Process: &specs.Process{Env: []string{"A=1", "NVIDIA_VISIBLE_DEVICES=GPU-x,GPU-y"}},
		Linux: &specs.Linux{
			Devices:   []specs.LinuxDevice{{Path: "/dev/nvidiactl", Major: 195, Minor: 255}, {Path: "/dev/nvidia4", Major: 195, Minor: 4}, {Path: "/dev/nvidia5", Major: 195, Minor: 5}},
			Resources: &specs.LinuxResources{},
		},
	}
	if err := AdaptSpec(spec, devs, []gpu.UUIDPair{{Old: "GPU-x", New: "GPU-c"}, {Old: "GPU-y", New: "GPU-a"}}); err != nil {
		t.Fatal(err)
	}
	if spec.Process.Env[1] != "NVIDIA_VISIBLE_DEVICES=GPU-c,GPU-a" {
		t.Errorf("env %v", spec.Process.Env)
	}
	d := spec.Linux.Devices
	if d[0].Minor != 255 || d[1].Path != "/dev/nvidia4" || d[1].Minor != 2 || d[2].Path != "/dev/nvidia5" || d[2].Minor != 0 {
		t.Errorf("devices %+v", d)
	}
	if len(spec.Linux.Resources.Devices) != 2 || *spec.Linux.Resources.Devices[0].Minor != 2 {
		t.Errorf("cgroup rules %+v", spec.Linux.Resources.Devices)
	}
	if err := AdaptSpec(spec, devs, []gpu.UUIDPair{{Old: "GPU-x", New: "GPU-zz"}}); err == nil || !strings.Contains(err.Error(), "GPU-zz") {
		t.Errorf("missing GPU: %v", err)
	}
}

// TestNamesGPUs: whether a spec gives GPUs, without the node's inventory.
func TestNamesGPUs(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec *specs.Spec
		want bool
	}{
		{"nil", nil, false},
		{"no GPU", &specs.Spec{Process: &specs.Process{Env: []string{"A=1"}}}, false},
		{"void", &specs.Spec{Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=void"}}}, false},
		{"uuid", &specs.Spec{Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=GPU-a"}}}, true},
		{"all", &specs.Spec{Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=all"}}}, true},
		{"control node only", &specs.Spec{Linux: &specs.Linux{Devices: []specs.LinuxDevice{{Path: "/dev/nvidiactl"}}}}, false},
		{"CDI", &specs.Spec{Process: &specs.Process{Env: []string{"NVIDIA_VISIBLE_DEVICES=void"}}, Linux: &specs.Linux{Devices: []specs.LinuxDevice{{Path: "/dev/nvidia3"}}}}, true},
	} {
		if got := NamesGPUs(tc.spec); got != tc.want {
			t.Errorf("%s: NamesGPUs = %v, want %v", tc.name, got, tc.want)
		}
	}
}
