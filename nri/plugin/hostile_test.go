package plugin_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/plugin"
	"github.com/berth-dev/berth/oci"
)

// TestKubeletGPUsOnly (issue 19, finding 3): under a kubelet a pod that requests no GPU but
// carries berth.dev/gpus gets none from berth-nri and is refused, naming what to do; a pod the
// device plugin gave GPUs is placed next to them, and GPUs that hang off two NUMA nodes are
// recorded and counted as misaligned; a namespace the administrator lists may still ask.
func TestKubeletGPUsOnly(t *testing.T) {
	rt := startRuntime(t)
	reg := prometheus.NewRegistry()
	c := kubeletCfg()
	_, _, stop := rt.connect(c, plugin.WithRegisterer(reg))
	defer stop()

	adj, _, err := rt.create("greedy", ctrSpec{name: "greedy", annotations: gpus(2)})
	if !errors.Is(err, plugin.ErrGPUsNotGranted) && (err == nil || !strings.Contains(err.Error(), "gpu_annotation_namespaces")) {
		t.Fatalf("berth.dev/gpus under a kubelet: adjustment %v, %v; want a refusal naming gpu_annotation_namespaces", adj, err)
	}
	if err != nil && !strings.Contains(err.Error(), "request nvidia.com/gpu") {
		t.Errorf("the refusal does not say how to get GPUs: %v", err)
	}

	// the device plugin's GPUs 3 and 4: NVSwitch-connected, but on NUMA nodes 0 and 1
	adj, _, err = rt.create("given", ctrSpec{name: "given", devices: []string{"/dev/nvidia3", "/dev/nvidia4"}, cpus: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(adj.GetLinux().GetDevices()) != 0 || len(adj.GetCDIDevices()) != 0 {
		t.Errorf("berth-nri added devices to a container the kubelet gave GPUs: %v", adj.GetLinux().GetDevices())
	}
	rec := adj.GetAnnotations()[oci.AnnotationPlacement]
	if !strings.Contains(rec, `"gpus":"3-4"`) || !strings.Contains(rec, `"misaligned":["`+alloc.MisalignedNUMA+`"]`) {
		t.Errorf("placement record %s: want GPUs 3-4 recorded as misaligned (gpu_numa)", rec)
	}
	fams := gather(t, reg)
	if got := value(t, fams, plugin.MetricGPUsMisaligned, "reason", alloc.MisalignedNUMA); got != 1 {
		t.Errorf("%s{reason=%s} = %v, want 1", plugin.MetricGPUsMisaligned, alloc.MisalignedNUMA, got)
	}
	if got := value(t, fams, plugin.MetricRefusals, "reason", plugin.ReasonGPUsNotGranted); got != 1 {
		t.Errorf("%s{reason=%s} = %v, want 1", plugin.MetricRefusals, plugin.ReasonGPUsNotGranted, got)
	}
	stop()

	// an administrator's namespace may ask (the runtime's pods are in "default")
	c.GPUAnnotationNamespaces = []string{"default"}
	_, _, stop2 := rt.connect(c)
	defer stop2()
	adj, _, err = rt.create("lab", ctrSpec{name: "lab", annotations: gpus(1)})
	if err != nil || len(adj.GetLinux().GetDevices()) == 0 {
		t.Errorf("berth.dev/gpus in a listed namespace: %v %v", adj.GetLinux().GetDevices(), err)
	}
}

// TestForgedPlacementRecordNotBelieved (issue 19, finding 6): a container created while
// berth-nri was down, carrying a berth.dev/placement annotation it did not write (every GPU and
// half the CPUs, exclusive), is re-booked from what it holds after a restart; a record of
// berth-nri's copied onto another container is not believed either; later pods are placed.
func TestForgedPlacementRecordNotBelieved(t *testing.T) {
	rt := startRuntime(t)
	forged := `{"cpus":"0-111","exclusive":true,"gpus":"0-7","policy":"best-effort","aligned":true}`
	if _, _, err := rt.create("forger", ctrSpec{name: "forger", annotations: map[string]string{oci.AnnotationPlacement: forged}}); err != nil {
		t.Fatal(err)
	}
	// a genuine record of another container (a's), copied: its mac is bound to a's id
	p, _, stop := rt.connect(cfg())
	adj, _, err := rt.create("a", ctrSpec{name: "a", annotations: gpus(1)})
	if err != nil {
		t.Fatal(err)
	}
	if pl, _ := p.Placement("ctr-forger"); pl.Exclusive || len(pl.GPUs) != 0 {
		t.Errorf("forged record believed: %+v", pl)
	}
	stop()
	genuine := adj.GetAnnotations()[oci.AnnotationPlacement]
	if _, _, err := rt.create("copier", ctrSpec{name: "copier", annotations: map[string]string{oci.AnnotationPlacement: genuine}}); err != nil {
		t.Fatal(err)
	}

	p2, _, stop2 := rt.connect(cfg())
	defer stop2()
	for _, id := range []string{"ctr-forger", "ctr-copier"} {
		if pl, ok := p2.Placement(id); !ok || pl.Exclusive || len(pl.GPUs) != 0 {
			t.Errorf("after a restart %s is booked as %+v (%v), want shared and GPU-less", id, pl, ok)
		}
	}
	if pl, ok := p2.Placement("ctr-a"); !ok || topology.FormatIDList(pl.GPUs) != "0" {
		t.Errorf("berth-nri's own record of a is not believed after a restart: %+v %v", pl, ok)
	}
	// seven GPUs are free: the forger holds none
	if _, _, err := rt.create("b", ctrSpec{name: "b", annotations: gpus(7)}); err != nil {
		t.Errorf("a pod after the forged record: %v", err)
	}
}

// TestRecordMustMatchContainer: a record berth-nri wrote is believed only for what the
// container holds: one whose GPUs or exclusive cpuset differ from the runtime's is re-booked.
func TestRecordMustMatchContainer(t *testing.T) {
	rt := startRuntime(t)
	_, _, stop := rt.connect(cfg())
	if _, _, err := rt.create("x", ctrSpec{name: "x", annotations: gpus(2), cpus: 2}); err != nil {
		t.Fatal(err)
	}
	stop()
	// the runtime now says the container has another cpuset (updated behind berth-nri's back)
	rt.mu.Lock()
	rt.ctrs["ctr-x"].Linux.Resources.Cpu.Cpus = "0-111"
	rt.mu.Unlock()
	p, _, stop2 := rt.connect(cfg())
	defer stop2()
	if pl, ok := p.Placement("ctr-x"); !ok || pl.Exclusive {
		t.Errorf("a record whose exclusive CPUs are not the container's cpuset was believed: %+v", pl)
	}
}

// TestAnnotationLength: a megabyte annotation value is refused with a short message.
func TestAnnotationLength(t *testing.T) {
	rt := startRuntime(t)
	_, _, stop := rt.connect(cfg())
	defer stop()
	huge := strings.Repeat("7", 1<<20)
	_, _, err := rt.create("huge", ctrSpec{name: "huge", annotations: map[string]string{oci.AnnotationGPUs: huge}})
	if !errors.Is(err, plugin.ErrBadAnnotation) && (err == nil || !strings.Contains(err.Error(), "max_annotation_bytes")) {
		t.Fatalf("1 MiB berth.dev/gpus: %v", err)
	}
	if len(err.Error()) > 1024 {
		t.Errorf("the refusal is %d bytes long", len(err.Error()))
	}
}

// TestEnvGPUSquat: under a kubelet a pod that requests no GPU but sets NVIDIA_VISIBLE_DEVICES to
// every GPU books none of them, on create or after a restart (Synchronize); the device plugin's
// pods that follow get theirs. With trust_visible_devices_env the variable books GPUs again.
func TestEnvGPUSquat(t *testing.T) {
	rt := startRuntime(t)
	c := kubeletCfg()
	_, _, stop := rt.connect(c)
	defer stop()
	squat := ctrSpec{name: "squatter", env: []string{plugin.EnvVisibleDevices + "=0,1,2,3,4,5,6,7"}}
	adj, _, err := rt.create("squatter", squat)
	if err != nil {
		t.Fatal(err)
	}
	if rec := adj.GetAnnotations()[oci.AnnotationPlacement]; strings.Contains(rec, `"gpus"`) {
		t.Errorf("the squatter's record books GPUs: %s", rec)
	}
	if _, _, err := rt.create("given", ctrSpec{name: "given", devices: []string{"/dev/nvidia3"}, env: []string{plugin.EnvVisibleDevices + "=3"}}); err != nil {
		t.Fatalf("the device plugin's pod with GPU 3 beside the squatter: %v", err)
	}
	stop()
	_, _, stop2 := rt.connect(c)
	if _, _, err := rt.create("given2", ctrSpec{name: "given2", devices: []string{"/dev/nvidia5"}}); err != nil {
		t.Fatalf("after a restart, the device plugin's pod with GPU 5: %v", err)
	}
	stop2()

	c.TrustVisibleDevicesEnv = true
	_, _, stop3 := rt.connect(c)
	defer stop3()
	adj, _, err = rt.create("envvar", ctrSpec{name: "envvar", env: []string{plugin.EnvVisibleDevices + "=6"}})
	if err != nil {
		t.Fatal(err)
	}
	if rec := adj.GetAnnotations()[oci.AnnotationPlacement]; !strings.Contains(rec, `"gpus":"6"`) {
		t.Errorf("trust_visible_devices_env: record %s, want GPU 6 booked", rec)
	}
}
