package shim

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"time"

	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/pkg/sys/reaper"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/gpu/backend"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/shim/helper"
)

// Register registers berth's task service as the shim's TTRPC "task" plugin, built on runc's
// task service with the configuration read from configPath (LoadConfig) and the real dependencies
// (RealDeps: CRIU, runc, containerd found in PATH). Call it once, from main, before shim.RunShim.
func Register(configPath string) {
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
			cfg, err := LoadConfig(configPath)
			if err != nil {
				return nil, err
			}
			inner, err := task.NewTaskService(ic.Context, pp.(shim.Publisher), ss.(shutdown.Service))
			if err != nil {
				return nil, fmt.Errorf("runc task service: %w", err)
			}
			deps, err := RealDeps(cfg)
			if err != nil {
				return nil, err
			}
			return NewService(inner, cfg, deps), nil
		},
	})
}

// RealDeps returns the dependencies of a real node: the fingerprint from /proc and the
// versions that `criu --version`, `runc --version` and `containerd --version` print (run through
// containerd's reaper, which owns every child of a shim), CRIU statistics from stats-dump, the
// credentials of checkpointed processes from their CRIU images and pulls from registries (both
// by berth-shim-helper, run through the reaper: package shim/helper), the GPU backend that cfg.GPU
// names (backend.OpenLazy: CUDA is loaded by the first call that needs the GPUs, so a
// container that never checkpoints or restores one does not carry it; the inventory is NVML read
// by a `berth-shim-helper gpu-inventory` process, started by that call too and kept until the
// shim's GPU calls have been idle for helper.InventoryIdle: helper.Inventory), the trust policy cfg's trust keys name (signature.LoadPolicy: an error
// names the key file; a signing key that does not exist yet is generated, signature.EnsureKey),
// and the wall clock.
func RealDeps(cfg Config) (Deps, error) {
	if cfg.SigningKey != "" {
		// a node that has no key yet makes one, which it trusts: its own checkpoints restore on
		// it with no configuration (containerd's own checkpoint and restore through ctr)
		if _, err := signature.EnsureKey(cfg.SigningKey); err != nil {
			return Deps{}, fmt.Errorf("shim config %s: signing_key: %w", cfg.Path, err)
		}
	}
	policy, err := signature.LoadPolicy(cfg.TrustConfig)
	if err != nil {
		return Deps{}, fmt.Errorf("shim config %s: %w", cfg.Path, err)
	}
	inv := &helper.Inventory{Start: reaperStart} // NVML read by berth-shim-helper, started on first use
	b, err := backend.OpenLazy(cfg.GPU, cfg.FakeGPURoot, inv.Open)
	if err != nil {
		return Deps{}, err
	}
	src := fingerprint.NodeSources("/proc", cfg.CRIUPath, reaperOutput)
	helpers := helper.Client{Run: reaperOutput} // berth-shim-helper, a child the reaper owns
	return Deps{
		Fingerprint: func(ctx context.Context) (fingerprint.Fingerprint, error) {
			fp, err := fingerprint.Collect(ctx, src)
			if err != nil || b == nil {
				return fp, err
			}
			fp.GPUs, err = backend.FingerprintGPUs(b.Inventory())
			return fp, err
		},
		DumpStats:     criu.ReadDumpStats,
		ReadProcesses: func(dir string) ([]privilege.Process, error) { return helpers.ReadProcesses(context.Background(), dir) },
		CheckSeccomp: func(dir string, profile *specs.LinuxSeccomp) error {
			return helpers.CheckSeccomp(context.Background(), dir, profile)
		},
		GPU:      b,
		Registry: helpers,
		Trust:    policy,
		Now:      time.Now,
	}, nil
}

// reaperStart starts cmd through containerd's reaper (see reaperOutput) and returns the wait for
// its exit.
func reaperStart(cmd *exec.Cmd) (func() error, error) {
	ec, err := reaper.Default.Start(cmd)
	if err != nil {
		return nil, err
	}
	return func() error {
		status, err := reaper.Default.Wait(cmd, ec)
		if err == nil && status != 0 {
			err = fmt.Errorf("exit status %d", status)
		}
		return err
	}, nil
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
