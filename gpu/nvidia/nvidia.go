// Package nvidia is the container convention for real NVIDIA GPUs, as berth's shim needs it:
// which GPUs an OCI spec gives a container (NVIDIA_VISIBLE_DEVICES, by UUID or index, or the
// /dev/nvidia<minor> device nodes in linux.devices), and how to give a restored container the
// GPUs of the device map at the same in-container paths. Backend ties it to the CUDA driver
// (gpu/cuda) and an inventory (gpu/nvml) as a gpu.Backend.
//
// What does not belong here: NVML or libcuda calls (gpu/nvml, gpu/cuda), CDI spec generation.
package nvidia

import (
	"fmt"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
)

// EnvVisibleDevices is the NVIDIA Container Toolkit's variable naming a container's GPUs.
const EnvVisibleDevices = "NVIDIA_VISIBLE_DEVICES"

// deviceMajor is the character device major number of /dev/nvidia<minor>.
const deviceMajor = 195

// ContainerGPUs returns the UUIDs of the GPUs spec gives the container, in its device order:
// from NVIDIA_VISIBLE_DEVICES when it names GPUs (UUIDs or indices into devs; "all" means every
// GPU), else from the /dev/nvidia<minor> entries in linux.devices matched against devs'
// DevicePaths. "void", "none" or an empty value names none, and the device nodes decide: a CDI
// container (nvidia-ctk's specs, the GPU Operator's default) has NVIDIA_VISIBLE_DEVICES=void and
// its GPUs as device nodes. An index or device that devs lacks is an error naming it.
func ContainerGPUs(spec *specs.Spec, devs []gpu.Device) ([]string, error) {
	if spec.Process != nil {
		for _, e := range spec.Process.Env {
			v, ok := strings.CutPrefix(e, EnvVisibleDevices+"=")
			if !ok {
				continue
			}
			switch v {
			case "", "none", "void":
				return deviceGPUs(spec, devs)
			case "all":
				var out []string
				for _, d := range devs {
					out = append(out, d.UUID)
				}
				return out, nil
			}
			var out []string
			for _, f := range strings.Split(v, ",") {
				f = strings.TrimSpace(f)
				if strings.HasPrefix(f, "GPU-") {
					out = append(out, f)
					continue
				}
				i, err := strconv.Atoi(f)
				if err != nil || i < 0 || i >= len(devs) {
					return nil, fmt.Errorf("%s=%q: %q is neither a GPU UUID nor an index below %d", EnvVisibleDevices, v, f, len(devs))
				}
				out = append(out, devs[i].UUID)
			}
			return out, nil
		}
	}
	return deviceGPUs(spec, devs)
}

// NamesGPUs reports whether spec gives the container any GPU by this convention, without
// knowing the node's GPUs: NVIDIA_VISIBLE_DEVICES names one ("all", a UUID or an index: not
// "void", "none" or empty), or linux.devices has a /dev/nvidia<minor> node. A container for
// which it is false needs no GPU driver, so that a node whose driver cannot be opened still
// checkpoints its CPU-only containers.
func NamesGPUs(spec *specs.Spec) bool {
	if spec == nil {
		return false
	}
	if spec.Process != nil {
		for _, e := range spec.Process.Env {
			if v, ok := strings.CutPrefix(e, EnvVisibleDevices+"="); ok && v != "" && v != "none" && v != "void" {
				return true
			}
		}
	}
	if spec.Linux != nil {
		for _, d := range spec.Linux.Devices {
			if isGPUNode(d.Path) {
				return true
			}
		}
	}
	return false
}

// deviceGPUs returns the GPUs of spec's /dev/nvidia<minor> device nodes, in spec order.
func deviceGPUs(spec *specs.Spec, devs []gpu.Device) ([]string, error) {
	if spec.Linux == nil {
		return nil, nil
	}
	var out []string
	for _, d := range spec.Linux.Devices {
		if !isGPUNode(d.Path) {
			continue
		}
		dev, ok := byPath(devs, d.Path)
		if !ok {
			return nil, fmt.Errorf("device %s in the spec is not a GPU of this node", d.Path)
		}
		out = append(out, dev.UUID)
	}
	return out, nil
}

// AdaptSpec rewrites spec for pairs (checkpoint GPU -> this node's GPU, in the container's
// device order): NVIDIA_VISIBLE_DEVICES lists the new UUIDs in the same order, and the k-th
// /dev/nvidia<minor> device node of the spec gets the major/minor of pairs[k].New, at the path
// the old one had in the container (the restored process reopens the same paths), with a cgroup
// rule allowing it. devs are this node's GPUs; errors name a UUID missing from them.
func AdaptSpec(spec *specs.Spec, devs []gpu.Device, pairs []gpu.UUIDPair) error {
	newUUIDs := make([]string, len(pairs))
	for i, p := range pairs {
		newUUIDs[i] = p.New
	}
	if spec.Process != nil {
		for i, e := range spec.Process.Env {
			if strings.HasPrefix(e, EnvVisibleDevices+"=") {
				spec.Process.Env[i] = EnvVisibleDevices + "=" + strings.Join(newUUIDs, ",")
			}
		}
	}
	if spec.Linux == nil {
		return nil
	}
	k := 0
	for i, d := range spec.Linux.Devices {
		if !isGPUNode(d.Path) || k >= len(pairs) {
			continue
		}
		nd, ok := byUUID(devs, pairs[k].New)
		if !ok || len(nd.DevicePaths) == 0 {
			return fmt.Errorf("GPU %s has no device node on this node", pairs[k].New)
		}
		minor, err := minorOf(nd.DevicePaths[0])
		if err != nil {
			return err
		}
		spec.Linux.Devices[i].Major, spec.Linux.Devices[i].Minor = deviceMajor, int64(minor)
		if spec.Linux.Resources != nil {
			major, mi := int64(deviceMajor), int64(minor)
			spec.Linux.Resources.Devices = append(spec.Linux.Resources.Devices,
				specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: &mi, Access: "rwm"})
		}
		k++
	}
	return nil
}

// Backend is a node's real NVIDIA GPUs as a gpu.Backend: the CUDA checkpoint driver (gpu/cuda),
// an inventory (gpu/nvml: devices, versions, and the device memory each process holds, from
// nvmlDeviceGetComputeRunningProcesses), and this package's container convention.
type Backend struct {
	Drv gpu.Driver
	Inv gpu.Inventory
}

// Driver returns the CUDA checkpoint driver.
func (b *Backend) Driver() gpu.Driver { return b.Drv }

// Inventory returns the node's GPUs.
func (b *Backend) Inventory() gpu.Inventory { return b.Inv }

// ContainerGPUs is ContainerGPUs over the inventory's devices.
func (b *Backend) ContainerGPUs(spec *specs.Spec) ([]string, error) {
	devs, err := b.Inv.Devices()
	if err != nil {
		return nil, err
	}
	return ContainerGPUs(spec, devs)
}

// AdaptSpec is AdaptSpec over the inventory's devices.
func (b *Backend) AdaptSpec(spec *specs.Spec, pairs []gpu.UUIDPair) error {
	devs, err := b.Inv.Devices()
	if err != nil {
		return err
	}
	return AdaptSpec(spec, devs, pairs)
}

func isGPUNode(path string) bool {
	rest, ok := strings.CutPrefix(path, "/dev/nvidia")
	if !ok || rest == "" {
		return false
	}
	_, err := strconv.Atoi(rest)
	return err == nil
}

func minorOf(path string) (int, error) {
	rest, _ := strings.CutPrefix(path, "/dev/nvidia")
	n, err := strconv.Atoi(rest)
	if err != nil {
		return 0, fmt.Errorf("device path %s: not /dev/nvidia<minor>", path)
	}
	return n, nil
}

func byPath(devs []gpu.Device, path string) (gpu.Device, bool) {
	for _, d := range devs {
		for _, p := range d.DevicePaths {
			if p == path {
				return d, true
			}
		}
	}
	return gpu.Device{}, false
}

func byUUID(devs []gpu.Device, uuid string) (gpu.Device, bool) {
	for _, d := range devs {
		if d.UUID == uuid {
			return d, true
		}
	}
	return gpu.Device{}, false
}
