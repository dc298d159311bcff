//go:build cgo

package nvml

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/berth-dev/berth/gpu"
)

// Open loads NVML (libnvidia-ml.so.1, or WithLibraryPath) and initialises it (nvmlInit). Errors
// wrap ErrNotLoaded (hence gpu.ErrUnsupported) and say whether the library is missing (no NVIDIA
// driver on this node) or failed to initialise. Close the Inventory to shut NVML down.
func Open(opts ...Option) (*Inventory, error) {
	o := newOptions(opts)
	var lopts []nvml.LibraryOption
	if o.libPath != "" {
		lopts = append(lopts, nvml.WithLibraryPath(o.libPath))
	}
	lib := nvml.New(lopts...)
	if r := lib.Init(); r != nvml.SUCCESS {
		name := o.libPath
		if name == "" {
			name = "libnvidia-ml.so.1"
		}
		if r == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("load %s (is the NVIDIA driver installed?): %w", name, ErrNotLoaded)
		}
		return nil, fmt.Errorf("initialise NVML from %s: %s: %w", name, lib.ErrorString(r), ErrNotLoaded)
	}
	inv := New(&nvmlLib{lib: lib}, opts...)
	inv.close = func() error {
		if r := lib.Shutdown(); r != nvml.SUCCESS {
			return fmt.Errorf("shut down NVML: %w", r)
		}
		return nil
	}
	return inv, nil
}

// nvmlLib is Lib on go-nvml.
type nvmlLib struct {
	lib nvml.Interface
}

func ok(r nvml.Return) error {
	if r == nvml.SUCCESS {
		return nil
	}
	return r
}

func (l *nvmlLib) DriverVersion() (string, error) {
	v, r := l.lib.SystemGetDriverVersion()
	return v, ok(r)
}

func (l *nvmlLib) CUDADriverVersion() (int, error) {
	v, r := l.lib.SystemGetCudaDriverVersion()
	return v, ok(r)
}

func (l *nvmlLib) DeviceCount() (int, error) {
	n, r := l.lib.DeviceGetCount()
	return n, ok(r)
}

func (l *nvmlLib) device(i int) (nvml.Device, error) {
	d, r := l.lib.DeviceGetHandleByIndex(i)
	if r != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetHandleByIndex(%d): %w", i, r)
	}
	return d, nil
}

// cpuAffinityCPUs is the CPU count the affinity mask is read for (the mask's size, not the
// node's CPUs: Linux allows at most 8192).
const cpuAffinityCPUs = 8192

func (l *nvmlLib) Device(i int) (DeviceInfo, error) {
	d, err := l.device(i)
	if err != nil {
		return DeviceInfo{}, err
	}
	var info DeviceInfo
	var r nvml.Return
	if info.UUID, r = d.GetUUID(); r != nvml.SUCCESS {
		return info, fmt.Errorf("nvmlDeviceGetUUID: %w", r)
	}
	if info.Name, r = d.GetName(); r != nvml.SUCCESS {
		return info, fmt.Errorf("nvmlDeviceGetName: %w", r)
	}
	if a, r := d.GetArchitecture(); r == nvml.SUCCESS {
		info.Arch = ArchName(uint32(a))
	}
	if maj, minor, r := d.GetCudaComputeCapability(); r == nvml.SUCCESS {
		info.CCMajor, info.CCMinor = maj, minor
	}
	mem, r := d.GetMemoryInfo()
	if r != nvml.SUCCESS {
		return info, fmt.Errorf("nvmlDeviceGetMemoryInfo: %w", r)
	}
	info.MemoryTotal, info.MemoryUsed = mem.Total, mem.Used
	pci, r := d.GetPciInfo()
	if r != nvml.SUCCESS {
		return info, fmt.Errorf("nvmlDeviceGetPciInfo: %w", r)
	}
	info.PCIBusID = busID(pci)
	info.Minor = -1
	if m, r := d.GetMinorNumber(); r == nvml.SUCCESS {
		info.Minor = m
	}
	if mask, r := d.GetCpuAffinity(cpuAffinityCPUs); r == nvml.SUCCESS {
		words := make([]uint64, len(mask))
		for k, w := range mask {
			words[k] = uint64(w)
		}
		info.CPUAffinity = CPUMaskIDs(words, uintBits)
	}
	if cur, _, r := d.GetMigMode(); r == nvml.SUCCESS {
		info.MIG = cur == nvml.DEVICE_MIG_ENABLE
	}
	if p, r := d.GetPersistenceMode(); r == nvml.SUCCESS {
		info.Persistence = p == nvml.FEATURE_ENABLED
	}
	return info, nil
}

// uintBits is the width of the words of nvmlDeviceGetCpuAffinity's mask (C unsigned long).
const uintBits = 32 << (^uint(0) >> 63)

func busID(p nvml.PciInfo) string {
	b := make([]byte, 0, len(p.BusId))
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

func (l *nvmlLib) NVLinks(i int) ([]NVLink, error) {
	d, err := l.device(i)
	if err != nil {
		return nil, err
	}
	var links []NVLink
	for k := range nvml.NVLINK_MAX_LINKS {
		st, r := d.GetNvLinkState(k)
		if r != nvml.SUCCESS || st != nvml.FEATURE_ENABLED {
			// NOT_SUPPORTED (no NVLink) or INVALID_ARGUMENT (past the last link): skip.
			continue
		}
		pci, r := d.GetNvLinkRemotePciInfo(k)
		if r != nvml.SUCCESS {
			return nil, fmt.Errorf("nvmlDeviceGetNvLinkRemotePciInfo(link %d): %w", k, r)
		}
		l := NVLink{Link: k, RemoteBusID: busID(pci), Remote: RemoteUnknown}
		if t, r := d.GetNvLinkRemoteDeviceType(k); r == nvml.SUCCESS {
			switch t {
			case nvml.NVLINK_DEVICE_TYPE_GPU:
				l.Remote = RemoteGPU
			case nvml.NVLINK_DEVICE_TYPE_SWITCH:
				l.Remote = RemoteSwitch
			case nvml.NVLINK_DEVICE_TYPE_IBMNPU:
				l.Remote = RemoteOther
			}
		}
		links = append(links, l)
	}
	return links, nil
}

func (l *nvmlLib) CommonAncestor(i, j int) (Ancestor, error) {
	a, err := l.device(i)
	if err != nil {
		return 0, err
	}
	b, err := l.device(j)
	if err != nil {
		return 0, err
	}
	lvl, r := a.GetTopologyCommonAncestor(b)
	if r != nvml.SUCCESS {
		return 0, fmt.Errorf("nvmlDeviceGetTopologyCommonAncestor: %w", r)
	}
	return Ancestor(lvl), nil
}

func (l *nvmlLib) ComputeProcesses(i int) ([]Process, error) {
	d, err := l.device(i)
	if err != nil {
		return nil, err
	}
	procs, r := d.GetComputeRunningProcesses()
	if r == nvml.ERROR_NOT_SUPPORTED {
		return nil, fmt.Errorf("nvmlDeviceGetComputeRunningProcesses: %w: %w", r, gpu.ErrUnsupported)
	}
	if r != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetComputeRunningProcesses: %w", r)
	}
	out := make([]Process, len(procs))
	for k, p := range procs {
		out[k] = Process{PID: int(p.Pid), UsedMemory: p.UsedGpuMemory}
	}
	return out, nil
}
