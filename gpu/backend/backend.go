// Package backend chooses a node's GPU backend by name: the one switch over berth's GPU
// implementations (none, the CUDA driver with NVML, the fake GPU). The shim and berthctl both
// open their backend here, so a name means the same thing everywhere.
//
// The CUDA backend's inventory is opened by a function the caller passes (InventoryOpener), so
// that this package does not link NVML: berthctl passes nvml.OpenInventory (NVML in its own
// process), the shim an inventory served by berth-shim-helper (package shim/helper), because
// go-nvml's bindings cost every container's shim about 1.4 MB of resident memory.
//
// What belongs here: choosing and opening a backend (OpenLazy: on first use, for a process that
// may never need its GPUs), and describing its GPUs as fingerprint entries. What does not: the backends themselves (gpu/cuda, gpu/nvml, gpu/nvidia, gpu/fake).
package backend

import (
	"errors"
	"fmt"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/cuda"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/nvidia"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// The backend names, as in the shim's `gpu` key and berthctl's --gpu flag.
const (
	// None: the node has no GPUs berth manages; Open returns a nil Backend.
	None = "none"
	// CUDA: the CUDA driver's checkpoint API (libcuda.so.1, loaded at run time) and NVML.
	CUDA = "cuda"
	// Fake: the fake GPU of package gpu/fake, rooted at a node directory.
	Fake = "fake"
)

// ErrUnknown is returned (wrapped, naming the value) by Check and Open for a name that is not
// None, CUDA or Fake.
var ErrUnknown = errors.New("unknown GPU backend")

// Check validates a backend name and, for Fake, its node directory (an absolute path). It
// returns an error wrapping ErrUnknown or naming the missing root; keyName and rootName are how
// the caller spells the two settings in messages ("gpu"/"fake_gpu_root", "--gpu"/"--fake-gpu-root").
func Check(kind, fakeRoot, keyName, rootName string) error {
	switch kind {
	case None, CUDA:
		return nil
	case Fake:
		if len(fakeRoot) == 0 || fakeRoot[0] != '/' {
			return fmt.Errorf("%s %q needs %s with an absolute path, got %q", keyName, Fake, rootName, fakeRoot)
		}
		return nil
	}
	return fmt.Errorf("%s %q: want %s, %s or %s: %w", keyName, kind, None, CUDA, Fake, ErrUnknown)
}

// InventoryOpener opens a CUDA node's GPU inventory (Devices, Versions, ProcessMemory and,
// where it is a gpu.Topologist, Topology): nvml.OpenInventory, or the shim's berth-shim-helper
// client. Its error says why the inventory cannot be read (NVML missing, the helper missing).
type InventoryOpener func() (gpu.Inventory, error)

// Open returns the backend kind names: nil for None (or ""), the fake GPU node at fakeRoot for
// Fake, libcuda.so.1's checkpoint API with the inventory openInventory opens for CUDA (not
// called for the other kinds). Errors name what is missing (the library, the inventory wrapped
// as "NVML inventory: ...", the fake node directory) or wrap ErrUnknown.
func Open(kind, fakeRoot string, openInventory InventoryOpener) (gpu.Backend, error) {
	switch kind {
	case "", None:
		return nil, nil
	case Fake:
		b, err := fake.NewBackend(fakeRoot)
		if err != nil {
			return nil, fmt.Errorf("fake GPU backend: %w", err)
		}
		return b, nil
	case CUDA:
		drv, err := cuda.Load("")
		if err != nil {
			return nil, fmt.Errorf("CUDA checkpoint driver: %w", err)
		}
		inv, err := openInventory()
		if err != nil {
			return nil, fmt.Errorf("NVML inventory: %w", err)
		}
		return &nvidia.Backend{Drv: drv, Inv: inv}, nil
	}
	return nil, fmt.Errorf("gpu backend %q: want %s, %s or %s: %w", kind, None, CUDA, Fake, ErrUnknown)
}

// FingerprintGPUs returns inv's GPUs as fingerprint entries (fingerprint v2), in index order:
// index, UUID, name and total memory in bytes from Inventory.Devices, driver and CUDA versions
// from Inventory.Versions. Errors from either call are wrapped.
func FingerprintGPUs(inv gpu.Inventory) ([]fingerprint.GPU, error) {
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
