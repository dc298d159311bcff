package oci

import specs "github.com/opencontainers/runtime-spec/specs-go"

// MemoryLimit returns spec's linux.resources.memory.limit in bytes; 0 when spec sets none (or an
// unlimited one, -1).
func MemoryLimit(spec *specs.Spec) int64 {
	if spec == nil || spec.Linux == nil || spec.Linux.Resources == nil || spec.Linux.Resources.Memory == nil ||
		spec.Linux.Resources.Memory.Limit == nil || *spec.Linux.Resources.Memory.Limit <= 0 {
		return 0
	}
	return *spec.Linux.Resources.Memory.Limit
}

// IsBindMount reports whether m is a bind mount: type "bind", or a "bind"/"rbind" option (how
// containerd and the kubelet write them).
func IsBindMount(m specs.Mount) bool {
	if m.Type == "bind" {
		return true
	}
	for _, o := range m.Options {
		if o == "bind" || o == "rbind" {
			return true
		}
	}
	return false
}
