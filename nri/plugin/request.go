package plugin

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/nri/pkg/api"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/oci"
)

// EnvVisibleDevices is the NVIDIA container toolkit's variable naming a container's GPUs.
const EnvVisibleDevices = "NVIDIA_VISIBLE_DEVICES"

// ErrBadAnnotation: a berth annotation's value cannot be used; the message names key and value.
var ErrBadAnnotation = errors.New("bad annotation")

// ErrGPUsNotGranted: a container asks berth-nri for GPUs (berth.dev/gpus) in a namespace where
// GPUs are the kubelet's to give (Config.GPUAnnotationNamespaces).
var ErrGPUsNotGranted = errors.New("GPUs not granted")

// maxGPUsAnnotation bounds berth.dev/gpus before it reaches the allocator (no node has more).
const maxGPUsAnnotation = 1 << 10

// annotation looks key up for container c of pod as the package documentation says; found
// reports whether any of the three places has it, where names it for messages.
func annotation(pod *api.PodSandbox, c *api.Container, key string) (value, where string, found bool) {
	if v, ok := c.GetAnnotations()[key]; ok {
		return v, "container annotation " + key, true
	}
	perCtr := key + ".container." + c.GetName()
	if v, ok := pod.GetAnnotations()[perCtr]; ok {
		return v, "pod annotation " + perCtr, true
	}
	if v, ok := pod.GetAnnotations()[key]; ok {
		return v, "pod annotation " + key, true
	}
	return "", "", false
}

// checkLength refuses an annotation value longer than max bytes, quoting only its first 64.
func checkLength(v, where string, max int) error {
	if len(v) <= max {
		return nil
	}
	return fmt.Errorf("%w: %s is %d bytes, more than %d (max_annotation_bytes); it begins %q", ErrBadAnnotation, where, len(v), max, v[:64])
}

// parseGPUCount parses berth.dev/gpus: a whole number, 0 to maxGPUsAnnotation, nothing else.
func parseGPUCount(v, where string) (int, error) {
	s := strings.TrimSpace(v)
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%w: %s=%q: want a whole number of GPUs (\"0\", \"1\", \"8\")", ErrBadAnnotation, where, v)
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > maxGPUsAnnotation {
		return 0, fmt.Errorf("%w: %s=%q: too many GPUs", ErrBadAnnotation, where, v)
	}
	return n, nil
}

// containerName is "namespace/pod/container" for messages.
func containerName(pod *api.PodSandbox, c *api.Container) string {
	return pod.GetNamespace() + "/" + pod.GetName() + "/" + c.GetName()
}

// cpuRequest derives the exclusive CPU count and the CPU limit (milli-CPUs) from the container's
// cgroup settings: an integer CPU limit (quota a whole multiple of period) whose request equals
// it (shares == CPUs*1024, as the kubelet writes shares = milliCPU*1024/1000) gets that many
// exclusive CPUs.
func cpuRequest(c *api.Container) (exclusive int, milli int64) {
	cpu := c.GetLinux().GetResources().GetCpu()
	quota, period, shares := cpu.GetQuota().GetValue(), cpu.GetPeriod().GetValue(), cpu.GetShares().GetValue()
	if quota <= 0 || period == 0 {
		return 0, 0
	}
	milli = quota * 1000 / int64(period)
	if quota%int64(period) != 0 {
		return 0, milli
	}
	n := quota / int64(period)
	if shares != uint64(n)*1024 {
		return 0, milli
	}
	return int(n), milli
}

var devNode = regexp.MustCompile(`^/dev/nvidia([0-9]+)$`)

// containerGPUs returns the GPU indices the container of Kubernetes namespace ns already has
// (see the package doc), and notes on names it could not use. NVIDIA_VISIBLE_DEVICES counts only
// where the configuration trusts it for ns (Config.envGPUsTrusted): any pod can set it.
func (p *Plugin) containerGPUs(ns string, c *api.Container) ([]int, []string) {
	n := p.node
	var gpus []int
	var notes []string
	var env []string // NVIDIA_VISIBLE_DEVICES values not trusted for ns
	all := func() {
		for i := range n.NumGPUs() {
			gpus = append(gpus, i)
		}
	}
	byName := func(name, src string) {
		switch {
		case name == "all":
			all()
			return
		case name == "" || name == "none" || name == "void":
			return
		}
		if i, err := strconv.Atoi(name); err == nil && i >= 0 && i < n.NumGPUs() {
			gpus = append(gpus, i)
			return
		}
		if i, ok := n.GPUByUUID(name); ok {
			gpus = append(gpus, i)
			return
		}
		if parent, _, ok := strings.Cut(name, ":"); ok { // MIG "GPU:instance"
			if i, err := strconv.Atoi(parent); err == nil && i >= 0 && i < n.NumGPUs() {
				gpus = append(gpus, i)
				return
			}
		}
		notes = append(notes, fmt.Sprintf("%s names GPU %q, which is not a GPU of this node", src, name))
	}
	prefix := p.cfg.CDIKind + "="
	for _, d := range c.GetCDIDevices() {
		if name, ok := strings.CutPrefix(d.GetName(), prefix); ok {
			byName(name, "CDI device "+d.GetName())
		}
	}
	for _, kv := range c.GetEnv() {
		v, ok := strings.CutPrefix(kv, EnvVisibleDevices+"=")
		if !ok {
			continue
		}
		if strings.TrimSpace(v) == "all" {
			if len(c.GetCDIDevices()) == 0 {
				notes = append(notes, EnvVisibleDevices+"=all in the environment alone is not taken as a GPU assignment")
			}
			continue
		}
		if !p.cfg.envGPUsTrusted(ns) {
			env = append(env, v)
			continue
		}
		for name := range strings.SplitSeq(v, ",") {
			byName(strings.TrimSpace(name), EnvVisibleDevices)
		}
	}
	for _, d := range c.GetLinux().GetDevices() {
		if i, ok := p.devPaths[d.GetPath()]; ok {
			gpus = append(gpus, i)
		} else if m := devNode.FindStringSubmatch(d.GetPath()); m != nil {
			notes = append(notes, fmt.Sprintf("device %s is not a GPU of this node", d.GetPath()))
		}
	}
	if len(env) > 0 {
		// the GPUs the container really has come from its device nodes and CDI devices; a
		// variable alone books nothing, or a pod could hold every GPU of the node
		var named []int
		for _, v := range env {
			for name := range strings.SplitSeq(v, ",") {
				if i, ok := p.envGPU(strings.TrimSpace(name)); ok && !slices.Contains(gpus, i) && !slices.Contains(named, i) {
					named = append(named, i)
				}
			}
		}
		if len(named) > 0 {
			slices.Sort(named)
			notes = append(notes, fmt.Sprintf("%s names GPUs %s beyond the container's device nodes and CDI devices; not booked: namespace %q is not trusted to name GPUs by environment (trust_visible_devices_env, gpu_annotation_namespaces)",
				EnvVisibleDevices, topology.FormatIDList(named), ns))
		}
	}
	slices.Sort(gpus)
	return slices.Compact(gpus), notes
}

// envGPU returns the index of the node's GPU an NVIDIA_VISIBLE_DEVICES entry name names (an
// index or a UUID); false for any other name.
func (p *Plugin) envGPU(name string) (int, bool) {
	if i, err := strconv.Atoi(name); err == nil && i >= 0 && i < p.node.NumGPUs() {
		return i, true
	}
	return p.node.GPUByUUID(name)
}

// request turns an NRI container into an allocation request. Errors wrap ErrBadAnnotation or
// alloc.ErrUnknownPolicy and name the annotation.
func (p *Plugin) request(pod *api.PodSandbox, c *api.Container) (alloc.Request, []string, error) {
	r := alloc.Request{ID: c.GetId(), Name: "container " + containerName(pod, c), Policy: p.policy}
	if v, where, ok := annotation(pod, c, oci.AnnotationNUMAPolicy); ok {
		if err := checkLength(v, where, p.cfg.MaxAnnotationBytes); err != nil {
			return r, nil, err
		}
		pol, err := alloc.ParsePolicy(strings.TrimSpace(v))
		if err != nil {
			return r, nil, fmt.Errorf("%s: %w", where, err)
		}
		r.Policy = pol
	}
	r.ExclusiveCPUs, r.MilliCPU = cpuRequest(c)
	assigned, notes := p.containerGPUs(pod.GetNamespace(), c)
	v, where, ok := annotation(pod, c, oci.AnnotationGPUs)
	if !ok {
		r.AssignedGPUs = assigned
		return r, notes, nil
	}
	if err := checkLength(v, where, p.cfg.MaxAnnotationBytes); err != nil {
		return r, notes, err
	}
	n, err := parseGPUCount(v, where)
	if err != nil {
		return r, notes, err
	}
	switch {
	case len(assigned) == 0 && n > 0 && !p.cfg.gpuAnnotationAllowed(pod.GetNamespace()):
		// under a kubelet, GPUs are the device plugin's or DRA's: never one it did not give
		return r, notes, fmt.Errorf("%w: %s=%q asks berth-nri for GPUs, but namespace %q is not in gpu_annotation_namespaces of berth-nri's configuration: under a kubelet GPUs come from the device plugin or DRA (request nvidia.com/gpu in the container's resources; berth-nri aligns CPUs and memory to the GPUs it gets)",
			ErrGPUsNotGranted, where, v, pod.GetNamespace())
	case len(assigned) == 0:
		r.GPUs = n
	case n == len(assigned) || n == 0:
		// Someone else already gave the GPUs (a device plugin honouring the same count): use them.
		r.AssignedGPUs = assigned
	default:
		return r, notes, fmt.Errorf("%w: %s=%q, but the container already has GPUs %s", ErrBadAnnotation, where, v, topology.FormatIDList(assigned))
	}
	return r, notes, nil
}

// record is the JSON value of the berth.dev/placement annotation.
type record struct {
	CPUs      string   `json:"cpus"`
	Exclusive bool     `json:"exclusive"`
	Mems      string   `json:"mems,omitempty"`
	NUMA      string   `json:"numa,omitempty"`
	GPUs      string   `json:"gpus,omitempty"`
	UUIDs     []string `json:"uuids,omitempty"`
	Chosen    bool     `json:"chosen,omitempty"`
	Policy    string   `json:"policy"`
	Aligned   bool     `json:"aligned"`
	// Misaligned is alloc.Placement.Misaligned: how GPUs given by someone else fall short.
	Misaligned []string `json:"misaligned,omitempty"`
	Reason     string   `json:"reason,omitempty"`
	// MAC authenticates the record as berth-nri's (recordMAC); a record without a valid one is
	// not believed.
	MAC string `json:"mac,omitempty"`
}

func (p *Plugin) encodeRecord(pl alloc.Placement) string {
	rec := record{
		CPUs: topology.FormatIDList(pl.CPUs), Exclusive: pl.Exclusive, GPUs: topology.FormatIDList(pl.GPUs),
		Chosen: pl.ChosenGPUs, Policy: string(pl.Policy), Aligned: pl.Aligned, Misaligned: pl.Misaligned, Reason: pl.Reason,
	}
	if pl.Mems != nil {
		rec.Mems = topology.FormatIDList(pl.Mems)
	}
	if pl.NUMANodes != nil {
		rec.NUMA = topology.FormatIDList(pl.NUMANodes)
	}
	for _, g := range pl.GPUs {
		if u := p.node.GPUUUID(g); u != "" {
			rec.UUIDs = append(rec.UUIDs, u)
		}
	}
	rec.MAC = p.recordMAC(pl.ID, rec)
	b, _ := json.Marshal(rec) // a struct of strings, bools and string slices: cannot fail
	return string(b)
}

// recordMAC is the hex HMAC-SHA256 (first 128 bits) of container id's record rec (its MAC
// field cleared) under the plugin's record key: only berth-nri, which holds the key, writes a
// record that verifies, and a record is bound to the container it was written for.
func (p *Plugin) recordMAC(id string, rec record) string {
	rec.MAC = ""
	b, _ := json.Marshal(rec)
	h := hmac.New(sha256.New, p.recordKey)
	h.Write([]byte(id))
	h.Write([]byte{0})
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// maxRecordBytes bounds a berth.dev/placement value decodeRecord parses (berth-nri writes a
// few hundred bytes; an 8-GPU record with UUIDs stays under 1 KiB).
const maxRecordBytes = 16 << 10

// decodeRecord reads a berth.dev/placement value back into a placement (CPUs: the recorded
// cpuset). GPUs named by UUID in the record win over indices, so a node whose GPU order
// changed still books the right GPUs.
func (p *Plugin) decodeRecord(id, v string) (alloc.Placement, error) {
	var rec record
	if len(v) > maxRecordBytes {
		return alloc.Placement{}, fmt.Errorf("%w: %s: %d bytes, more than %d", ErrBadAnnotation, oci.AnnotationPlacement, len(v), maxRecordBytes)
	}
	if err := json.Unmarshal([]byte(v), &rec); err != nil {
		return alloc.Placement{}, fmt.Errorf("%w: %s: %w", ErrBadAnnotation, oci.AnnotationPlacement, err)
	}
	if want := p.recordMAC(id, rec); !hmac.Equal([]byte(rec.MAC), []byte(want)) {
		return alloc.Placement{}, fmt.Errorf("%w: %s: not written by this berth-nri for container %s (no valid mac: a pod's annotation, a record of another container, or of a node with another record key)",
			ErrBadAnnotation, oci.AnnotationPlacement, id)
	}
	pl := alloc.Placement{ID: id, Exclusive: rec.Exclusive, ChosenGPUs: rec.Chosen, Policy: alloc.Policy(rec.Policy), Aligned: rec.Aligned, Misaligned: rec.Misaligned}
	var err error
	lists := []struct {
		s   string
		dst *[]int
	}{{rec.CPUs, &pl.CPUs}, {rec.Mems, &pl.Mems}, {rec.NUMA, &pl.NUMANodes}, {rec.GPUs, &pl.GPUs}}
	for _, l := range lists {
		if l.s == "" {
			continue
		}
		if *l.dst, err = topology.ParseIDList(l.s); err != nil {
			return alloc.Placement{}, fmt.Errorf("%w: %s: %w", ErrBadAnnotation, oci.AnnotationPlacement, err)
		}
	}
	if len(rec.UUIDs) == len(pl.GPUs) && len(rec.UUIDs) > 0 {
		var byUUID []int
		for _, u := range rec.UUIDs {
			if i, ok := p.node.GPUByUUID(u); ok {
				byUUID = append(byUUID, i)
			}
		}
		if len(byUUID) == len(rec.UUIDs) {
			slices.Sort(byUUID)
			pl.GPUs = byUUID
		}
	}
	return pl, nil
}
