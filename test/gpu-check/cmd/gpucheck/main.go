// Command gpucheck runs berth's real GPU paths on an NVIDIA machine, one step per invocation or
// several in one process, and prints what it saw as JSON with timings. test/gpu-check/run.sh
// drives it; it is built beforehand (see test/gpu-check/README.md) because the GPU machine may
// have no Go toolchain.
//
//	gpucheck inventory   [--sysfs /sys]                 devices and versions (NVML + sysfs)
//	gpucheck topology    [--sysfs /sys]                 the topology, as `nvidia-smi topo -m` text
//	gpucheck fingerprint [--sysfs /sys] [--lib PATH]    the GPU fields of the node's fingerprint
//	gpucheck state|lock|checkpoint|restore|unlock --pid N [--timeout D] [--bytes B] [--pairs OLD=NEW,...] [--lib PATH]
//	gpucheck steps --pid N --steps lock,checkpoint,restore,unlock [...]
//	gpucheck helper-inventory --helper PATH [--pid N]    the shim's inventory (berth-shim-helper) against NVML here
//
// Exit status: 0 success, 1 a step failed, 2 usage, 3 the node lacks what the command needs
// (gpu.ErrUnsupported: no driver, driver too old, no cgo).
package main

import (
	"os"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/cuda"
	"github.com/berth-dev/berth/gpu/nvml"
	"github.com/berth-dev/berth/shim/helper"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr, deps{
		loadDriver: func(lib string) (gpu.Driver, error) { return cuda.Load(lib) },
		openInventory: func(sysfs string) (inventory, error) {
			return nvml.Open(nvml.WithSysfsRoot(sysfs))
		},
		openNVML: nvml.OpenInventory,
		openHelper: func(path string) (gpu.Inventory, func() error, error) {
			h := &helper.Inventory{Path: path}
			inv, err := h.Open()
			return inv, h.Close, err
		},
	}))
}
