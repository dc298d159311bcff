package kube

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"

	"github.com/berth-dev/berth/cmd/berthctl/move"
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
