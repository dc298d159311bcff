package kube

import (
	"context"
	"errors"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-dev/berth/oci"
)

func runningPod() *corev1.Pod {
	rc := RuntimeClass
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "infer", Namespace: "ns", Labels: map[string]string{"app": "infer"}},
		Spec: corev1.PodSpec{
			RuntimeClassName: &rc, NodeName: "kube1",
			NodeSelector: map[string]string{"kubernetes.io/hostname": "kube1"},
			Containers:   []corev1.Container{{Name: "infer", Image: "img"}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning},
	}
}

func TestCheckMovable(t *testing.T) {
	yes := true
	for _, tc := range []struct {
		name string
		edit func(*corev1.Pod)
		want error
	}{
		{"movable", func(*corev1.Pod) {}, nil},
		{"ReplicaSet", func(p *corev1.Pod) {
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", Controller: &yes}}
		}, nil},
		{"StatefulSet", func(p *corev1.Pod) {
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "web", Controller: &yes}}
		}, ErrOwned},
		{"Job", func(p *corev1.Pod) {
			p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "batch/v1", Kind: "Job", Name: "j", Controller: &yes}}
		}, ErrOwned},
		{"owner", func(p *corev1.Pod) { p.OwnerReferences = []metav1.OwnerReference{{Kind: "Job", Name: "j"}} }, ErrOwned},
		{"runc", func(p *corev1.Pod) { p.Spec.RuntimeClassName = nil }, ErrNotMovable},
		{"pending", func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }, ErrNotMovable},
		{"two containers", func(p *corev1.Pod) { p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "b"}) }, ErrNotMovable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := runningPod()
			tc.edit(p)
			c, err := checkMovable(p, "")
			if !errors.Is(err, tc.want) || (err == nil && c != "infer") {
				t.Errorf("checkMovable = %q, %v; want %v", c, err, tc.want)
			}
		})
	}
	if _, err := checkMovable(runningPod(), "other"); !errors.Is(err, ErrNotMovable) {
		t.Errorf("unknown container: %v", err)
	}
}

func TestRestorePod(t *testing.T) {
	src := runningPod()
	res := &Result{Checkpoint: "ns-infer-1.tar", Selector: map[string]string{"berth.dev/fingerprint": "f", "kubernetes.io/hostname": "kube2"}}
	p := restorePod(src, Options{}, res)
	if p.Spec.NodeName != "" || p.Spec.NodeSelector["kubernetes.io/hostname"] != "kube2" || p.Spec.NodeSelector["berth.dev/fingerprint"] != "f" {
		t.Errorf("spec: node %q selector %v", p.Spec.NodeName, p.Spec.NodeSelector)
	}
	if p.Annotations[oci.AnnotationRestoreFrom] != "ns-infer-1.tar" || p.Annotations[AnnotationMovedFrom] != "ns/infer@kube1" || p.Labels["app"] != "infer" {
		t.Errorf("metadata: %v %v", p.Annotations, p.Labels)
	}
	if src.Spec.NodeSelector["kubernetes.io/hostname"] != "kube1" {
		t.Error("the source pod's spec was changed")
	}
	again := restorePod(p, Options{}, res)
	if len(again.Name) != len(p.Name) {
		t.Errorf("a moved pod moved again is named %s (was %s)", again.Name, p.Name)
	}
}

func TestMatchNode(t *testing.T) {
	cs := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "kube2", Labels: map[string]string{"berth.dev/fingerprint": "f"}}})
	if err := matchNode(context.Background(), cs, map[string]string{"berth.dev/fingerprint": "f"}, "kube2"); err != nil {
		t.Errorf("matchNode: %v", err)
	}
	if err := matchNode(context.Background(), cs, map[string]string{"berth.dev/fingerprint": "g"}, "kube2"); !errors.Is(err, ErrNoNode) {
		t.Errorf("matchNode with other labels: %v, want ErrNoNode", err)
	}
}

func TestPrepareAdoption(t *testing.T) {
	yes := true
	rs := &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "rs", Namespace: "ns", UID: "rs-uid"},
		Spec:       appsv1.ReplicaSetSpec{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "infer"}}},
	}
	everything := rs.DeepCopy()
	everything.Name, everything.UID, everything.Spec.Selector = "all", "all-uid", &metav1.LabelSelector{}
	cs := fake.NewClientset(rs, everything)
	p := runningPod()
	for _, tc := range []struct {
		name string
		ref  metav1.OwnerReference
		ok   bool
	}{
		{"selects the pod", metav1.OwnerReference{Kind: "ReplicaSet", Name: "rs", UID: "rs-uid", Controller: &yes}, true},
		{"missing", metav1.OwnerReference{Kind: "ReplicaSet", Name: "gone", UID: "x", Controller: &yes}, false},
		{"replaced", metav1.OwnerReference{Kind: "ReplicaSet", Name: "rs", UID: "old-uid", Controller: &yes}, false},
		{"selects every pod", metav1.OwnerReference{Kind: "ReplicaSet", Name: "all", UID: "all-uid", Controller: &yes}, false},
	} {
		_, err := prepareAdoption(context.Background(), cs, p, &tc.ref)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrOwned)) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

func TestAgentAddress(t *testing.T) {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "berth-agent-x", Namespace: DefaultAgentNamespace},
		Spec: corev1.PodSpec{NodeName: "kube2", Containers: []corev1.Container{
			{Name: "gc"},
			{Name: DefaultAgentContainer, Ports: []corev1.ContainerPort{{Name: "metrics", ContainerPort: 9000}, {Name: AgentPortName, ContainerPort: 7650}}},
		}},
		Status: corev1.PodStatus{PodIP: "10.88.92.2"},
	}
	if a, err := agentAddress(p, DefaultAgentContainer); err != nil || a != "10.88.92.2:7650" {
		t.Errorf("agentAddress = %q, %v", a, err)
	}
	p.Status.PodIP = "fd00::2"
	if a, _ := agentAddress(p, DefaultAgentContainer); a != "[fd00::2]:7650" {
		t.Errorf("IPv6: %q", a)
	}
	p.Status.PodIP = ""
	if _, err := agentAddress(p, DefaultAgentContainer); err == nil {
		t.Error("no pod IP: no error")
	}
	// no agent pod at all
	a := &Agents{Client: fake.NewClientset()}
	if _, err := a.ArchiveSelector(context.Background(), "kube1", "/x/checkpoint-a.tar"); !errors.Is(err, ErrNoAgent) {
		t.Errorf("without agents: %v, want ErrNoAgent", err)
	}
}

func TestMoveMode(t *testing.T) {
	for _, tc := range []struct {
		requested string
		canStream bool
		want      string // "" for an error
	}{
		{"", true, ModeCopy},
		{"", false, ModeStored},
		{ModeStored, true, ModeStored},
		{ModeStored, false, ModeStored},
		{ModeCopy, true, ModeCopy},
		{ModeCopy, false, ""},
		{"lazy", true, ""},
	} {
		got, err := moveMode(tc.requested, tc.canStream)
		if got != tc.want || (err != nil) != (tc.want == "") {
			t.Errorf("moveMode(%q, canStream %v) = %q, %v; want %q", tc.requested, tc.canStream, got, err, tc.want)
		}
	}
}
