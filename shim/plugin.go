package shim

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"runtime"

	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/pkg/sys/reaper"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// RuntimeName is the containerd runtime type served by containerd-shim-berth-v2.
const RuntimeName = "io.containerd.berth.v2"

// Register registers berth's task service as the shim's TTRPC "task" plugin, built on runc's
// task service with the configuration from ConfigPath() and the real dependencies (CRIU, runc,
// containerd found in PATH). Call it once, from main, before shim.RunShim.
func Register() {
	registry.Register(&plugin.Registration{
		Type:     plugins.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugins.EventPlugin, plugins.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (any, error) {
			pp, err := ic.GetByID(plugins.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugins.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			cfg, err := LoadConfig(ConfigPath())
			if err != nil {
				return nil, err
			}
			inner, err := task.NewTaskService(ic.Context, pp.(shim.Publisher), ss.(shutdown.Service))
			if err != nil {
				return nil, fmt.Errorf("runc task service: %w", err)
			}
			deps, err := RealDeps(cfg, true)
			if err != nil {
				return nil, err
			}
			return NewService(inner, cfg, deps), nil
		},
	})
}

// RealDeps returns the dependencies of a real node: the fingerprint from /proc, CRIU's version
// RPC, `runc --version` and `containerd --version`; CRIU statistics from stats-dump.
//
// Inside the shim process, which reaps every child itself (containerd's reaper), CRIU's version
// comes from `criu --version` run through the reaper; elsewhere (berthctl) from go-criu's
// version RPC. inShim selects the first.
func RealDeps(cfg Config, inShim bool) (Deps, error) {
	criuPath := cfg.CRIUPath
	if criuPath == "" {
		criuPath = "criu"
	}
	var run fingerprint.Runner
	criuVersion := criu.New(cfg.CRIUPath).VersionString
	if inShim {
		run = reaperOutput
		criuVersion = fingerprint.ExecVersionWith(run, criuPath, "--version")
	}
	backend, err := GPUBackend(cfg)
	if err != nil {
		return Deps{}, err
	}
	return Deps{
		Fingerprint: func(ctx context.Context) (fingerprint.Fingerprint, error) {
			fp, err := fingerprint.Collect(ctx, fingerprint.Sources{
				ProcRoot:          "/proc",
				Arch:              runtime.GOARCH,
				CRIUVersion:       criuVersion,
				RuncVersion:       fingerprint.ExecVersionWith(run, "runc", "--version"),
				ContainerdVersion: fingerprint.ExecVersionWith(run, "containerd", "--version"),
			})
			if err != nil || backend == nil {
				return fp, err
			}
			fp.GPUs, err = NodeGPUs(backend.Inventory())
			return fp, err
		},
		DumpStats: criu.ReadDumpStats,
		GPU:       backend,
	}, nil
}

// GPUBackend returns the GPU backend cfg.GPU selects: nil for "none", the fake GPU node at
// cfg.FakeGPURoot for "fake", the CUDA driver and NVML for "cuda". Errors name what is missing.
func GPUBackend(cfg Config) (gpu.Backend, error) {
	switch cfg.GPU {
	case "", "none":
		return nil, nil
	case "fake":
		b, err := fake.NewBackend(cfg.FakeGPURoot)
		if err != nil {
			return nil, fmt.Errorf("fake GPU backend: %w", err)
		}
		return b, nil
	case "cuda":
		if cudaBackend == nil {
			return nil, fmt.Errorf("gpu = \"cuda\": this build has no CUDA backend: %w", gpu.ErrUnsupported)
		}
		return cudaBackend()
	}
	return nil, fmt.Errorf("gpu %q: want none, cuda or fake", cfg.GPU)
}

// cudaBackend builds the real NVIDIA backend; set by the file that wires gpu/cuda and gpu/nvml.
var cudaBackend func() (gpu.Backend, error)

// NodeGPUs returns a node's GPUs as fingerprint entries (fingerprint v2), in index order.
func NodeGPUs(inv gpu.Inventory) ([]fingerprint.GPU, error) {
	devs, err := inv.Devices()
	if err != nil {
		return nil, fmt.Errorf("GPU inventory: %w", err)
	}
	v, err := inv.Versions()
	if err != nil {
		return nil, fmt.Errorf("GPU driver versions: %w", err)
	}
	var out []fingerprint.GPU
	for _, d := range devs {
		out = append(out, fingerprint.GPU{Index: d.Index, UUID: d.UUID, Name: d.Name, MemoryBytes: d.MemoryTotal, Driver: v.Driver, CUDA: v.CUDA})
	}
	return out, nil
}

// reaperOutput runs cmd through containerd's reaper, which owns every child of a shim: a plain
// cmd.Wait would race it and fail with "no child processes".
func reaperOutput(cmd *exec.Cmd) ([]byte, error) {
	var out bytes.Buffer
	cmd.Stdout = &out
	ec, err := reaper.Default.Start(cmd)
	if err != nil {
		return nil, err
	}
	status, err := reaper.Default.Wait(cmd, ec)
	if err != nil {
		return nil, err
	}
	if status != 0 {
		return nil, fmt.Errorf("%s exited with status %d", cmd.Path, status)
	}
	return out.Bytes(), nil
}
