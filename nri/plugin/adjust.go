package plugin

import (
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/nri/pkg/api"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/oci"
)

// DeviceInfo returns the type ("c" or "b") and major/minor numbers of the host device node at
// path (an absolute path as the container sees it, "/dev/nvidia0"), and whether it exists.
type DeviceInfo func(path string) (typ string, major, minor int64, ok bool)

// HostDevices returns a DeviceInfo that stats device nodes under devRoot (path "/dev/x" is
// looked up as devRoot/x).
func HostDevices(devRoot string) DeviceInfo {
	return func(path string) (string, int64, int64, bool) {
		var st unix.Stat_t
		host := filepath.Join(devRoot, strings.TrimPrefix(path, "/dev/"))
		if err := unix.Stat(host, &st); err != nil {
			return "", 0, 0, false
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR:
			return "c", int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev))), true
		case unix.S_IFBLK:
			return "b", int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev))), true
		}
		return "", 0, 0, false
	}
}

// nvidiaMajor is the character major number the NVIDIA driver registers for /dev/nvidiaN and
// /dev/nvidiactl (minor N and 255).
const nvidiaMajor = 195

// controlDevices are the NVIDIA device nodes every GPU container needs besides its GPUs'
// nodes; those other than nvidiactl are added only when the host has them (their major numbers
// are dynamic).
var controlDevices = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"}

// adjustment builds the container adjustment for placement pl: cpuset, mems, chosen GPUs and the
// placement annotation. It has no failure mode: a device node missing on the host falls back to
// the NVIDIA driver's fixed numbers.
func (p *Plugin) adjustment(pl alloc.Placement) *api.ContainerAdjustment {
	adj := &api.ContainerAdjustment{}
	adj.SetLinuxCPUSetCPUs(topology.FormatIDList(pl.CPUs))
	if pl.Mems != nil {
		adj.SetLinuxCPUSetMems(topology.FormatIDList(pl.Mems))
	}
	if pl.ChosenGPUs {
		names := p.gpuNames(pl.GPUs)
		if p.cfg.CDI {
			for _, n := range names {
				adj.AddCDIDevice(&api.CDIDevice{Name: p.cfg.CDIKind + "=" + n})
			}
		} else {
			for _, g := range pl.GPUs {
				for _, path := range p.node.GPUDevicePaths(g) {
					adj.AddDevice(p.device(path, g))
				}
			}
			for _, path := range controlDevices {
				if d := p.device(path, -1); d != nil {
					adj.AddDevice(d)
				}
			}
		}
		adj.AddEnv(EnvVisibleDevices, strings.Join(names, ","))
	}
	adj.AddAnnotation(oci.AnnotationPlacement, p.encodeRecord(pl))
	return adj
}

// gpuNames names GPUs for CDI and NVIDIA_VISIBLE_DEVICES: by UUID when every one is known,
// otherwise by index.
func (p *Plugin) gpuNames(gpus []int) []string {
	names := make([]string, len(gpus))
	for i, g := range gpus {
		names[i] = p.node.GPUUUID(g)
		if names[i] == "" {
			names = names[:0]
			for _, g := range gpus {
				names = append(names, strconv.Itoa(g))
			}
			return names
		}
	}
	return names
}

// device returns the device node at path for the container: the host's numbers when it exists,
// else the NVIDIA driver's fixed ones (195:index for a GPU node, 195:255 for nvidiactl), else nil.
func (p *Plugin) device(path string, gpu int) *api.LinuxDevice {
	typ, major, minor, ok := p.devInfo(path)
	if !ok {
		switch {
		case gpu >= 0:
			typ, major, minor = "c", nvidiaMajor, int64(gpu)
		case path == "/dev/nvidiactl":
			typ, major, minor = "c", nvidiaMajor, 255
		default:
			return nil
		}
	}
	return &api.LinuxDevice{Path: path, Type: typ, Major: major, Minor: minor, FileMode: api.FileMode(0o666)}
}

func updates(ups []alloc.Update) []*api.ContainerUpdate {
	var out []*api.ContainerUpdate
	formatted := map[*int]string{} // updates with the same pool share its slice (alloc.Update)
	for _, u := range ups {
		cu := &api.ContainerUpdate{ContainerId: u.ID, IgnoreFailure: true}
		var set string
		if len(u.CPUs) > 0 {
			var ok bool
			if set, ok = formatted[&u.CPUs[0]]; !ok {
				set = topology.FormatIDList(u.CPUs)
				formatted[&u.CPUs[0]] = set
			}
		}
		cu.SetLinuxCPUSetCPUs(set)
		out = append(out, cu)
	}
	return out
}
