package kube

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/gpu"
	gpufake "github.com/berth-dev/berth/gpu/fake"
)

const mi = 1 << 20

func u64(n uint64) *uint64 { return &n }

// pfNode is a Ready node with the berth labels of the source, 4 CPUs and 8Gi allocatable, and
// the pod's image.
func pfNode(name string) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"berth.dev/fingerprint": "f", "berth.dev/kernel": "6.8", "kubernetes.io/hostname": name}},
		Status: corev1.NodeStatus{
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}, {Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse}},
			Allocatable: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("8Gi"),
				"nvidia.com/gpu": resource.MustParse("1")},
			Images: []corev1.ContainerImage{{Names: []string{normalizeImage("img"), "localhost/img@sha256:aaaa"}}},
		},
	}
}

// pfPod is runningPod with the image pulled never, and requests.
func pfPod() *corev1.Pod {
	p := runningPod()
	p.UID = "pod-uid"
	p.Spec.Containers[0].ImagePullPolicy = corev1.PullNever
	p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("256Mi")}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "infer", ContainerID: "containerd://" + pfContainerID}}
	return p
}

// pfStats: the container holds 100Mi with a 1Mi writable layer; every node has 10Gi of disk and
// 4Gi of memory available.
func pfStats() map[string]*statsapi.Summary {
	node := func(name string) *statsapi.Summary {
		return &statsapi.Summary{Node: statsapi.NodeStats{NodeName: name,
			Memory: &statsapi.MemoryStats{AvailableBytes: u64(4 << 30)}, Fs: &statsapi.FsStats{AvailableBytes: u64(10 << 30)}}}
	}
	m := map[string]*statsapi.Summary{"kube1": node("kube1"), "kube2": node("kube2"), "kube3": node("kube3")}
	m["kube1"].Pods = []statsapi.PodStats{{PodRef: statsapi.PodReference{Name: "infer", Namespace: "ns", UID: "pod-uid"},
		Containers: []statsapi.ContainerStats{{Name: "infer", Memory: &statsapi.MemoryStats{RSSBytes: u64(100 * mi), WorkingSetBytes: u64(120 * mi)},
			Rootfs: &statsapi.FsStats{UsedBytes: u64(1 * mi)}}}}}
	return m
}

type pfAgent struct {
	refusals []move.Refusal
	err      error
	asked    []move.Need
}

func (a *pfAgent) ask(_ context.Context, node, name string, need move.Need) ([]move.Refusal, error) {
	a.asked = append(a.asked, need)
	return a.refusals, a.err
}

// pfContainerID is the source container's ID in pfPod's status.
const pfContainerID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// hostProbe is a NodeProbe that does in this process what a node's berth-probe pod does
// (`berthctl checkpoint need` and `checkpoint check --host-root`), with the same code
// (move.HeldOnHost, move.Preflight with HostRoot and the GPU inventory): each node's host is a
// directory (its / as the probe's /host shows it) and a fake GPU node. The source container's
// process is this test's: its cgroup file under kube1's host names pfContainerID, and the device
// memory it holds is what this process maps of kube1's fake GPU (gpu/fake reads /proc/PID/maps).
type hostProbe struct {
	hosts map[string]string
	gpus  map[string]*gpufake.Node
	// checked counts Check calls
	checked int
}

func (h *hostProbe) inv(node string) gpu.Inventory {
	if g := h.gpus[node]; g != nil {
		return g
	}
	return nil
}

func (h *hostProbe) Source(_ context.Context, node, id, podUID string) (move.Need, error) {
	return move.HeldOnHost(h.hosts[node], id, move.Anchor{PodUID: podUID}, h.inv(node))
}

func (h *hostProbe) Check(ctx context.Context, node string, need move.Need) ([]move.Refusal, error) {
	h.checked++
	err := move.Preflight(ctx, move.Destination{Local: true, HostRoot: h.hosts[node], GPUs: h.inv(node)}, need)
	var pe *move.PreflightError
	if errors.As(err, &pe) {
		return pe.Refusals, nil
	}
	return nil, err
}

// newHostProbe makes kube1 and kube2's hosts: each with /proc holding this process's PID (the
// machine's PID namespace, as the e2e cluster's nodes share it), its cgroup on kube1 naming
// pfContainerID; kube1 with /data/models (a hostPath of the pod), kube2 without; a fake GPU
// "Fake H200" of 4 GiB on each, of which this process maps gib GiB on kube1's (0: none).
func newHostProbe(t *testing.T, gib int64) *hostProbe {
	h := &hostProbe{hosts: map[string]string{}, gpus: map[string]*gpufake.Node{}}
	pid := strconv.Itoa(os.Getpid())
	for _, n := range []string{"kube1", "kube2"} {
		root := t.TempDir()
		h.hosts[n] = root
		if err := os.MkdirAll(filepath.Join(root, "proc", pid), 0o755); err != nil {
			t.Fatal(err)
		}
		g, err := gpufake.Setup(filepath.Join(t.TempDir(), "gpu"), gpufake.NodeSpec{Driver: "580.65.06", CUDA: "12.8",
			GPUs: []gpufake.GPUSpec{{UUID: "GPU-" + n + "-0", Name: "Fake H200", MemoryBytes: 4 << 30}}})
		if err != nil {
			t.Fatal(err)
		}
		h.gpus[n] = g
	}
	if err := os.WriteFile(filepath.Join(h.hosts["kube1"], "proc", pid, "cgroup"), []byte("0::/kubepods/podpod-uid/"+pfContainerID+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(h.hosts["kube1"], "data", "models"), 0o755); err != nil {
		t.Fatal(err)
	}
	if gib > 0 {
		h.holdGPU(t, "kube1", "mem-held", gib)
	}
	return h
}

// holdGPU makes gib GiB of node's fake GPU used by a device memory file name, which this
// process maps (MAP_SHARED, never touched: sparse) until the test ends when name is not "mem-fill".
func (h *hostProbe) holdGPU(t *testing.T, node, name string, gib int64) {
	dir, err := h.gpus[node].Dir("GPU-" + node + "-0")
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(gib << 30); err != nil {
		t.Fatal(err)
	}
	if name == "mem-fill" {
		return
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(gib<<30), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(b) })
}

// withData gives p's container the hostPath volume /data/models (type typ, nil: none) at /models.
func withData(p *corev1.Pod, typ *corev1.HostPathType) {
	p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "models", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/data/models", Type: typ}}})
	p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "models", MountPath: "/models"})
}

func TestPreflightRefusals(t *testing.T) {
	for _, tc := range []struct {
		name   string
		edit   func(dst *corev1.Node, p *corev1.Pod, st map[string]*statsapi.Summary, a *pfAgent) []runtime.Object
		field  string // "": passes
		values []string
	}{
		{"passes", func(*corev1.Node, *corev1.Pod, map[string]*statsapi.Summary, *pfAgent) []runtime.Object { return nil }, "", nil},
		{"not Ready", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Status.Conditions[0].Status, d.Status.Conditions[0].Reason = corev1.ConditionUnknown, "NodeStatusUnknown"
			return nil
		}, "node kube2 condition Ready", []string{"Unknown (NodeStatusUnknown)", "True"}},
		{"memory pressure", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Status.Conditions[1].Status = corev1.ConditionTrue
			return nil
		}, "node kube2 condition MemoryPressure", []string{"True", "False"}},
		{"disk pressure", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Status.Conditions = append(d.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeDiskPressure, Status: corev1.ConditionTrue, Reason: "KubeletHasDiskPressure"})
			return nil
		}, "node kube2 condition DiskPressure", []string{"True (KubeletHasDiskPressure)"}},
		{"cordoned", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Spec.Unschedulable = true
			return nil
		}, "node kube2 spec.unschedulable", []string{"true", "false"}},
		{"taint", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "batch", Effect: corev1.TaintEffectNoSchedule}}
			return nil
		}, "node kube2 taint", []string{"dedicated=batch:NoSchedule"}},
		{"tolerated taint", func(d *corev1.Node, p *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "batch", Effect: corev1.TaintEffectNoSchedule}}
			p.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}
			return nil
		}, "", nil},
		{"fingerprint label", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Labels["berth.dev/kernel"] = "6.1"
			return nil
		}, "node kube2 label berth.dev/kernel", []string{`"6.1"`, `"6.8"`}},
		{"fingerprint label absent", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			delete(d.Labels, "berth.dev/fingerprint")
			return nil
		}, "node kube2 label berth.dev/fingerprint", []string{`"absent"`, `"f"`}},
		{"image absent", func(d *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Status.Images = []corev1.ContainerImage{{Names: []string{normalizeImage("other")}}}
			return nil
		}, "node kube2 status.images", []string{"without img (1 images)", "img"}},
		{"image absent, pulled", func(d *corev1.Node, p *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			d.Status.Images = nil
			p.Spec.Containers[0].ImagePullPolicy = corev1.PullIfNotPresent
			return nil
		}, "", nil},
		{"cpu requested", func(*corev1.Node, *corev1.Pod, map[string]*statsapi.Summary, *pfAgent) []runtime.Object {
			other := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "big", Namespace: "x"}, Spec: corev1.PodSpec{NodeName: "kube2",
				Containers: []corev1.Container{{Name: "c", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("3500m")}}}}}}
			done := other.DeepCopy()
			done.Name, done.Status.Phase = "done", corev1.PodSucceeded
			return []runtime.Object{other, done}
		}, "node kube2 status.allocatable[cpu] minus the requests of its pods", []string{"500m free (4 allocatable, 3500m requested)", ">= 1"}},
		{"GPU requested", func(_ *corev1.Node, p *corev1.Pod, _ map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			p.Spec.Containers[0].Resources.Requests["nvidia.com/gpu"] = resource.MustParse("2")
			return nil
		}, "node kube2 status.allocatable[nvidia.com/gpu] minus the requests of its pods", []string{"1 free", ">= 2"}},
		{"memory available", func(_ *corev1.Node, _ *corev1.Pod, st map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			st["kube2"].Node.Memory.AvailableBytes = u64(50 * mi)
			return nil
		}, "node kube2 node.memory.availableBytes", []string{"52428800 bytes (50Mi)", ">= 104857600 bytes (100Mi)"}},
		{"disk available", func(_ *corev1.Node, _ *corev1.Pod, st map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			st["kube2"].Node.Fs.AvailableBytes = u64(50 * mi)
			return nil
		}, "node kube2 node.fs.availableBytes", []string{"50Mi", ">= 105906176 bytes (101Mi)"}},
		{"source disk", func(_ *corev1.Node, _ *corev1.Pod, st map[string]*statsapi.Summary, _ *pfAgent) []runtime.Object {
			st["kube1"].Node.Fs.AvailableBytes = u64(10 * mi)
			return nil
		}, "source node kube1 node.fs.availableBytes", []string{"10Mi", "101Mi"}},
		{"agent refuses", func(_ *corev1.Node, _ *corev1.Pod, _ map[string]*statsapi.Summary, a *pfAgent) []runtime.Object {
			a.refusals = []move.Refusal{{Field: "free disk under /var/lib/berth/checkpoints", Value: "1 bytes", Limit: ">= 105906176 bytes"}}
			return nil
		}, "node kube2 free disk under /var/lib/berth/checkpoints", []string{"1 bytes", ">= 105906176 bytes"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst, p, st, a := pfNode("kube1"), pfNode("kube2"), pfPod(), pfStats(), &pfAgent{}
			objs := append([]runtime.Object{src, dst, p}, tc.edit(dst, p, st, a)...)
			cs := fake.NewClientset(objs...)
			o := Options{To: "kube2", Preflight: a.ask, Stats: func(_ context.Context, n string) (*statsapi.Summary, error) { return st[n], nil }}
			got, err := preflight(context.Background(), cs, o, p, "infer", "ns-infer-1")
			if tc.field == "" {
				if err != nil || got != "kube2" {
					t.Fatalf("preflight = %q, %v; want kube2", got, err)
				}
				if len(a.asked) != 1 || a.asked[0].DiskBytes != 101*mi {
					t.Errorf("the agent was asked %+v; want one query with DiskBytes %d", a.asked, 101*mi)
				}
				return
			}
			var pe *move.PreflightError
			if !errors.As(err, &pe) || !errors.Is(err, move.ErrPreflight) {
				t.Fatalf("preflight = %q, %v; want a PreflightError", got, err)
			}
			for _, r := range pe.Refusals {
				if !strings.HasPrefix(r.Field, tc.field) {
					continue
				}
				s := r.String()
				for _, v := range tc.values {
					if !strings.Contains(s, v) {
						t.Errorf("refusal %q lacks %q", s, v)
					}
				}
				if r.Value == "" || r.Limit == "" {
					t.Errorf("refusal %+v: no value or limit", r)
				}
				return
			}
			t.Errorf("no refusal of %q in %v", tc.field, err)
		})
	}
}

// TestPreflightHostRefusals: what only the nodes' hosts can tell, through their probes (a
// hostProbe running the probe's code on directories and fake GPUs): (a) a hostPath volume's path
// missing on the destination, (b) with hostPID the container's PIDs in use there, (c) the device
// memory the container holds on the source's GPU (from the source's fake GPU and its
// processes) more than the destination's GPUs of that model have free. Each refusal names the
// field, its value and the limit.
func TestPreflightHostRefusals(t *testing.T) {
	dirType, orCreate := corev1.HostPathDirectory, corev1.HostPathDirectoryOrCreate
	for _, tc := range []struct {
		name   string
		gib    int64 // GiB the container holds on kube1's GPU
		edit   func(t *testing.T, p *corev1.Pod, h *hostProbe)
		field  string // "": passes
		values []string
		checks int // probe.Check calls
	}{
		{"nothing to check", 0, func(*testing.T, *corev1.Pod, *hostProbe) {}, "", nil, 0},
		{"hostPath present", 0, func(t *testing.T, p *corev1.Pod, h *hostProbe) {
			withData(p, &dirType)
			if err := os.MkdirAll(filepath.Join(h.hosts["kube2"], "data", "models"), 0o755); err != nil {
				t.Fatal(err)
			}
		}, "", nil, 1},
		{"hostPath missing", 0, func(_ *testing.T, p *corev1.Pod, _ *hostProbe) { withData(p, nil) },
			"node kube2 volumes[models].hostPath.path (mounted at /models)", []string{"/data/models (missing)", "an existing path"}, 1},
		{"hostPath missing, Directory", 0, func(_ *testing.T, p *corev1.Pod, _ *hostProbe) { withData(p, &dirType) },
			"node kube2 volumes[models].hostPath.path (mounted at /models)", []string{"/data/models (missing)"}, 1},
		{"hostPath DirectoryOrCreate: the kubelet makes it", 0, func(_ *testing.T, p *corev1.Pod, _ *hostProbe) { withData(p, &orCreate) }, "", nil, 0},
		{"hostPID, PID in use", 0, func(_ *testing.T, p *corev1.Pod, _ *hostProbe) { p.Spec.HostPID = true },
			"node kube2 PID " + strconv.Itoa(os.Getpid()), []string{"in use in the host's PID namespace", "free"}, 1},
		{"hostPID, PID free", 0, func(t *testing.T, p *corev1.Pod, h *hostProbe) {
			p.Spec.HostPID = true
			if err := os.RemoveAll(filepath.Join(h.hosts["kube2"], "proc", strconv.Itoa(os.Getpid()))); err != nil {
				t.Fatal(err)
			}
		}, "", nil, 1},
		{"own PID namespace, PID in use there", 0, func(*testing.T, *corev1.Pod, *hostProbe) {}, "", nil, 0},
		{"GPU memory fits", 2, func(*testing.T, *corev1.Pod, *hostProbe) {}, "", nil, 1},
		{"GPU memory full", 2, func(t *testing.T, _ *corev1.Pod, h *hostProbe) { h.holdGPU(t, "kube2", "mem-fill", 3) },
			"node kube2 gpu[0] device memory free (Fake H200)", []string{"1073741824 bytes at most, on GPU-kube2-0 (3221225472 of 4294967296 bytes used)",
				">= 2147483648 bytes (what the container held on GPU-kube1-0)"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst, p, st := pfNode("kube1"), pfNode("kube2"), pfPod(), pfStats()
			h := newHostProbe(t, tc.gib)
			tc.edit(t, p, h)
			cs := fake.NewClientset(src, dst, p)
			o := Options{To: "kube2", Probe: h, Stats: func(_ context.Context, n string) (*statsapi.Summary, error) { return st[n], nil }}
			got, err := preflight(context.Background(), cs, o, p, "infer", "ns-infer-1")
			if h.checked != tc.checks {
				t.Errorf("the destination's probe was asked %d times, want %d", h.checked, tc.checks)
			}
			if tc.field == "" {
				if err != nil || got != "kube2" {
					t.Fatalf("preflight = %q, %v; want kube2", got, err)
				}
				return
			}
			var pe *move.PreflightError
			if !errors.As(err, &pe) || !errors.Is(err, move.ErrPreflight) {
				t.Fatalf("preflight = %q, %v; want a PreflightError", got, err)
			}
			t.Logf("refused: %v", err)
			for _, r := range pe.Refusals {
				if r.Field != tc.field {
					continue
				}
				for _, v := range tc.values {
					if !strings.Contains(r.String(), v) {
						t.Errorf("refusal %q lacks %q", r, v)
					}
				}
				return
			}
			t.Errorf("no refusal of %q in %v", tc.field, err)
		})
	}
}

// A probe that cannot answer fails the preflight with its error (nothing checkpointed), and a
// pod whose status has no container ID cannot be probed.
func TestPreflightProbeErrors(t *testing.T) {
	st := pfStats()
	stats := func(_ context.Context, n string) (*statsapi.Summary, error) { return st[n], nil }
	p := pfPod()
	h := newHostProbe(t, 0)
	h.hosts["kube1"] = t.TempDir() // no process of the container there
	if err := os.Mkdir(filepath.Join(h.hosts["kube1"], "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	cs := fake.NewClientset(pfNode("kube1"), pfNode("kube2"), p)
	if _, err := preflight(context.Background(), cs, Options{To: "kube2", Stats: stats, Probe: h}, p, "infer", "n"); err == nil || !strings.Contains(err.Error(), "no process") {
		t.Errorf("container not found by the source's probe: %v", err)
	}
	p.Status.ContainerStatuses = nil
	if _, err := preflight(context.Background(), cs, Options{To: "kube2", Stats: stats, Probe: h}, p, "infer", "n"); !errors.Is(err, ErrNotMovable) {
		t.Errorf("no container ID: %v", err)
	}
	pr := &Probes{Client: cs}
	if _, err := pr.Check(context.Background(), "kube2", move.Need{}); !errors.Is(err, ErrNoProbe) {
		t.Errorf("no probe pod: %v", err)
	}
}

func TestPreflightErrors(t *testing.T) {
	st := pfStats()
	stats := func(_ context.Context, n string) (*statsapi.Summary, error) {
		if s := st[n]; s != nil {
			return s, nil
		}
		return nil, fmt.Errorf("no kubelet on %s", n)
	}
	p := pfPod()
	cs := fake.NewClientset(pfNode("kube1"), pfNode("kube2"), p)
	a := &pfAgent{err: fmt.Errorf("checkpoint check in berth-agent-x: %w", ErrNoAgent)}
	_, err := preflight(context.Background(), cs, Options{To: "kube2", Stats: stats, Preflight: a.ask}, p, "infer", "n")
	var pe *move.PreflightError
	if !errors.Is(err, ErrNoAgent) || errors.As(err, &pe) {
		t.Errorf("agent unreachable: %v; want its error, not a refusal", err)
	}
	if _, err := preflight(context.Background(), cs, Options{To: "kube1", Stats: stats}, p, "infer", "n"); !errors.Is(err, ErrNotMovable) {
		t.Errorf("--to the source node: %v", err)
	}
	if _, err := preflight(context.Background(), cs, Options{To: "kube9", Stats: stats}, p, "infer", "n"); err == nil || !strings.Contains(err.Error(), "kube9") {
		t.Errorf("--to a missing node: %v", err)
	}
}

// Without --to: the first node by name whose labels match the source's and that passes.
func TestPreflightPicksNode(t *testing.T) {
	st := pfStats()
	stats := func(_ context.Context, n string) (*statsapi.Summary, error) { return st[n], nil }
	p := pfPod()
	other := pfNode("kube0")
	other.Labels["berth.dev/fingerprint"] = "g"
	full := pfNode("kube2")
	full.Status.Images = nil
	cs := fake.NewClientset(other, pfNode("kube1"), full, pfNode("kube3"), p)
	if n, err := preflight(context.Background(), cs, Options{Stats: stats}, p, "infer", "n"); err != nil || n != "kube3" {
		t.Errorf("preflight = %q, %v; want kube3 (kube0: other labels, kube2: no image)", n, err)
	}
	cs = fake.NewClientset(other, pfNode("kube1"), full, p)
	_, err := preflight(context.Background(), cs, Options{Stats: stats}, p, "infer", "n")
	if err == nil || !strings.Contains(err.Error(), "node kube2 status.images") {
		t.Errorf("no node passes: %v", err)
	}
	cs = fake.NewClientset(other, pfNode("kube1"), p)
	if _, err := preflight(context.Background(), cs, Options{Stats: stats}, p, "infer", "n"); !errors.Is(err, ErrNoNode) {
		t.Errorf("no node with the labels: %v", err)
	}
}

// fakeTransfer records what Move asked of it.
type fakeTransfer struct{ calls []string }

func (f *fakeTransfer) Copy(_ context.Context, src, _, dst, name string) (int64, error) {
	f.calls = append(f.calls, "copy "+src+" "+dst+" "+name)
	return 0, errors.New("not here")
}

func (f *fakeTransfer) Remove(_ context.Context, dst, name string) error {
	f.calls = append(f.calls, "remove "+dst+" "+name)
	return nil
}

// A refused move checkpoints nothing (the fake clientset has no REST client: a call to the
// kubelet checkpoint API would panic), sends nothing and creates no pod.
func TestMoveRefusedByPreflight(t *testing.T) {
	st := pfStats()
	p := pfPod()
	dst := pfNode("kube2")
	dst.Status.Images = nil
	cs := fake.NewClientset(pfNode("kube1"), dst, p)
	tr := &fakeTransfer{}
	selected := false
	o := Options{Namespace: "ns", Pod: "infer", To: "kube2", Transfer: tr,
		Stats:    func(_ context.Context, n string) (*statsapi.Summary, error) { return st[n], nil },
		Selector: func(context.Context, string, string) (map[string]string, error) { selected = true; return nil, nil }}
	res, err := Move(context.Background(), cs, o)
	if res != nil || !errors.Is(err, move.ErrPreflight) || !strings.Contains(err.Error(), "nothing was checkpointed") {
		t.Fatalf("Move = %+v, %v; want a preflight refusal", res, err)
	}
	t.Logf("refused: %v", err)
	if selected || len(tr.calls) > 0 {
		t.Errorf("after the refusal: selector read %v, transfer %v", selected, tr.calls)
	}
	pods, _ := cs.CoreV1().Pods("ns").List(context.Background(), metav1.ListOptions{})
	if len(pods.Items) != 1 || pods.Items[0].Name != "infer" {
		t.Errorf("pods after the refusal: %v", pods.Items)
	}
}

// TestCgroupPodUID: the probe finds a container below the cgroup the kubelet names after the
// pod's UID: the API server's for a pod, the static pod's config hash for a mirror pod.
func TestCgroupPodUID(t *testing.T) {
	p := pfPod()
	if got := cgroupPodUID(p); got != string(p.UID) || got == "" {
		t.Errorf("pod: %q; want its UID %q", got, p.UID)
	}
	p.Annotations = map[string]string{"kubernetes.io/config.mirror": "6f1c", "kubernetes.io/config.hash": "6f1c"}
	if got := cgroupPodUID(p); got != "6f1c" {
		t.Errorf("mirror pod: %q; want the config hash", got)
	}
}
