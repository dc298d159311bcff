package plugin_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/node/nodetest"
	"github.com/berth-dev/berth/nri/plugin"
	"github.com/berth-dev/berth/oci"
)

var dgxNode *node.Node

// recordKeyFile is the record key every plugin of the tests shares, as restarts of berth-nri on
// one node share /var/lib/berth/nri/record.key.
var recordKeyFile string

// TestMain builds the DGX H100 model once (a 224-CPU sysfs tree is slow to write on some disks).
func TestMain(m *testing.M) {
	if os.Getenv("BERTH_TEST_LOG") == "" {
		_ = log.SetLevel("warn") // BERTH_TEST_LOG=1 shows every placement
	}
	dir, err := os.MkdirTemp("", "plugin-test-")
	if err != nil {
		panic(err)
	}
	spec, topo := nodetest.DGXH100()
	err = nodetest.WriteSysfs(dir, spec)
	var n *node.Node
	if err == nil {
		n, err = node.ReadSysfs(dir)
	}
	if err == nil {
		var devs []gpu.Device
		for i := range topo.GPUs {
			devs = append(devs, gpu.Device{Index: i, UUID: fmt.Sprintf("GPU-%08d-aaaa-bbbb-cccc-000000000000", i)})
		}
		dgxNode, err = n.WithGPUs(topo, devs)
	}
	os.RemoveAll(dir)
	if err != nil {
		panic(err)
	}
	keyDir, err := os.MkdirTemp("", "plugin-key-")
	if err != nil {
		panic(err)
	}
	recordKeyFile = filepath.Join(keyDir, "nri", "record.key")
	code := m.Run()
	os.RemoveAll(keyDir)
	os.Exit(code)
}

func uuid(i int) string { return fmt.Sprintf("GPU-%08d-aaaa-bbbb-cccc-000000000000", i) }

// fakeDevices: the host has /dev/nvidia-uvm (major 510) and nothing else.
func fakeDevices(path string) (string, int64, int64, bool) {
	if path == "/dev/nvidia-uvm" {
		return "c", 510, 0, true
	}
	return "", 0, 0, false
}

// runtime is an in-process NRI runtime (containerd/nri's adaptation package on a temporary
// socket) that remembers pods and containers and applies adjustments and updates to them the
// way containerd does, so that a restarted plugin's Synchronize sees what it set.
type runtime struct {
	t      *testing.T
	r      *adaptation.Adaptation
	sock   string
	mu     sync.Mutex
	pods   map[string]*api.PodSandbox
	ctrs   map[string]*api.Container
	synced chan []*api.ContainerUpdate
}

func startRuntime(t *testing.T) *runtime {
	dir, err := os.MkdirTemp("", "nri-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	rt := &runtime{t: t, sock: filepath.Join(dir, "nri.sock"), pods: map[string]*api.PodSandbox{}, ctrs: map[string]*api.Container{},
		synced: make(chan []*api.ContainerUpdate, 8)}
	sync := func(ctx context.Context, cb adaptation.SyncCB) error {
		rt.mu.Lock()
		var pods []*api.PodSandbox
		var ctrs []*api.Container
		for _, p := range rt.pods {
			pods = append(pods, p)
		}
		for _, c := range rt.ctrs {
			ctrs = append(ctrs, proto.Clone(c).(*api.Container))
		}
		rt.mu.Unlock()
		ups, err := cb(ctx, pods, ctrs)
		rt.synced <- ups
		return err
	}
	update := func(_ context.Context, ups []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) {
		rt.applyUpdates(ups)
		return nil, nil
	}
	rt.r, err = adaptation.New("berth-test", "v0", sync, update,
		adaptation.WithSocketPath(rt.sock),
		adaptation.WithPluginPath(filepath.Join(dir, "plugins")),
		adaptation.WithPluginConfigPath(filepath.Join(dir, "conf.d")))
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.r.Start(); err != nil {
		t.Fatal(err)
	}
	<-rt.synced // Start synchronizes the (no) pre-started plugins once
	t.Cleanup(rt.r.Stop)
	return rt
}

// connect starts a fresh berth-nri plugin on the runtime's socket and waits until it is
// synchronized and registered (opts add to WithDeviceInfo(fakeDevices)); it returns the plugin,
// the updates its Synchronize asked for, and a function that stops it.
func (rt *runtime) connect(cfg plugin.Config, opts ...plugin.Option) (*plugin.Plugin, []*api.ContainerUpdate, func()) {
	t := rt.t
	cfg.Socket = rt.sock
	p, err := plugin.New(cfg, dgxNode, append([]plugin.Option{plugin.WithDeviceInfo(fakeDevices)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	s, err := stub.New(p, stub.WithSocketPath(rt.sock), stub.WithPluginName("berth"), stub.WithPluginIdx("40"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	var ups []*api.ContainerUpdate
	select {
	case ups = <-rt.synced:
	case <-time.After(10 * time.Second):
		t.Fatal("plugin never synchronized")
	}
	rt.r.BlockPluginSync().Unblock() // returns once the plugin is registered
	return p, ups, func() {
		s.Stop()
		time.Sleep(200 * time.Millisecond) // let the runtime notice the closed connection
	}
}

func (rt *runtime) applyUpdates(ups []*api.ContainerUpdate) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for _, u := range ups {
		if c, ok := rt.ctrs[u.GetContainerId()]; ok {
			c.Linux.Resources.Cpu.Cpus = u.GetLinux().GetResources().GetCpu().GetCpus()
		}
	}
}

// ctrSpec describes a container to create.
type ctrSpec struct {
	name        string
	annotations map[string]string
	cpus        int // exclusive CPUs (quota = period * cpus, shares = 1024 * cpus); 0: none
	env         []string
	cdi         []string
	devices     []string
}

func (rt *runtime) create(pod string, cs ctrSpec) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	p := &api.PodSandbox{Id: "pod-" + pod, Name: pod, Namespace: "default", Uid: "uid-" + pod}
	c := &api.Container{Id: "ctr-" + cs.name, PodSandboxId: p.Id, Name: cs.name, State: api.ContainerState_CONTAINER_CREATED,
		Annotations: map[string]string{}, Env: cs.env, CreatedAt: time.Now().UnixNano(),
		Linux: &api.LinuxContainer{Resources: &api.LinuxResources{Cpu: &api.LinuxCPU{}}}}
	for k, v := range cs.annotations {
		c.Annotations[k] = v
	}
	if cs.cpus > 0 {
		c.Linux.Resources.Cpu.Period = api.UInt64(uint64(100000))
		c.Linux.Resources.Cpu.Quota = api.Int64(int64(cs.cpus) * 100000)
		c.Linux.Resources.Cpu.Shares = api.UInt64(uint64(cs.cpus) * 1024)
	}
	for _, d := range cs.cdi {
		c.CDIDevices = append(c.CDIDevices, &api.CDIDevice{Name: d})
	}
	for _, d := range cs.devices {
		c.Linux.Devices = append(c.Linux.Devices, &api.LinuxDevice{Path: d, Type: "c", Major: 195})
	}
	ctx := context.Background()
	if err := rt.r.RunPodSandbox(ctx, &api.RunPodSandboxRequest{Pod: p}); err != nil {
		return nil, nil, err
	}
	rsp, err := rt.r.CreateContainer(ctx, &api.CreateContainerRequest{Pod: p, Container: c})
	if err != nil {
		return nil, nil, err
	}
	adj := rsp.GetAdjust()
	// Apply the adjustment as containerd does, and start the container.
	rt.mu.Lock()
	for k, v := range adj.GetAnnotations() {
		c.Annotations[k] = v
	}
	if cpu := adj.GetLinux().GetResources().GetCpu(); cpu != nil {
		c.Linux.Resources.Cpu.Cpus, c.Linux.Resources.Cpu.Mems = cpu.GetCpus(), cpu.GetMems()
	}
	c.Linux.Devices = append(c.Linux.Devices, adj.GetLinux().GetDevices()...)
	for _, kv := range adj.GetEnv() {
		c.Env = append(c.Env, kv.Key+"="+kv.Value)
	}
	c.CDIDevices = append(c.CDIDevices, adj.GetCDIDevices()...)
	c.State = api.ContainerState_CONTAINER_RUNNING
	rt.pods[p.Id] = p
	rt.ctrs[c.Id] = c
	rt.mu.Unlock()
	rt.applyUpdates(rsp.GetUpdate())
	return adj, rsp.GetUpdate(), nil
}

func (rt *runtime) stop(name string) []*api.ContainerUpdate {
	rt.mu.Lock()
	c := rt.ctrs["ctr-"+name]
	p := rt.pods[c.PodSandboxId]
	rt.mu.Unlock()
	rsp, err := rt.r.StopContainer(context.Background(), &api.StopContainerRequest{Pod: p, Container: c})
	if err != nil {
		rt.t.Fatal(err)
	}
	rt.applyUpdates(rsp.GetUpdate())
	if err := rt.r.RemoveContainer(context.Background(), &api.RemoveContainerRequest{Pod: p, Container: c}); err != nil {
		rt.t.Fatal(err)
	}
	rt.mu.Lock()
	delete(rt.ctrs, c.Id)
	rt.mu.Unlock()
	return rsp.GetUpdate()
}

func (rt *runtime) cpus(name string) string {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.ctrs["ctr-"+name].GetLinux().GetResources().GetCpu().GetCpus()
}

// cfg is the configuration of a node without a kubelet (berth.dev/gpus honoured everywhere),
// with the tests' shared record key.
func cfg() plugin.Config {
	c := plugin.DefaultConfig()
	c.GPUAnnotationNamespaces = []string{"*"}
	c.RecordKeyFile = recordKeyFile
	return c
}

// kubeletCfg is cfg on a node whose GPUs the kubelet gives (the default: no namespace may ask
// berth-nri for GPUs).
func kubeletCfg() plugin.Config {
	c := cfg()
	c.GPUAnnotationNamespaces = nil
	return c
}

func gpus(n int) map[string]string { return map[string]string{oci.AnnotationGPUs: fmt.Sprint(n)} }

func devicePaths(adj *api.ContainerAdjustment) []string {
	var p []string
	for _, d := range adj.GetLinux().GetDevices() {
		p = append(p, fmt.Sprintf("%s=%s%d:%d", d.Path, d.Type, d.Major, d.Minor))
	}
	return p
}

func env(adj *api.ContainerAdjustment, key string) string {
	for _, kv := range adj.GetEnv() {
		if kv.Key == key {
			return kv.Value
		}
	}
	return ""
}

// TestRuntimeCreateRestartStop drives the plugin through a real NRI runtime: placement,
// adjustment contents, a plugin restart that re-books without re-pinning, and release.
func TestRuntimeCreateRestartStop(t *testing.T) {
	rt := startRuntime(t)
	_, ups, stop := rt.connect(cfg())
	if len(ups) != 0 {
		t.Fatalf("first Synchronize asked for updates %v", ups)
	}

	adj, ups, err := rt.create("infer", ctrSpec{name: "a", annotations: gpus(2), cpus: 4})
	if err != nil {
		t.Fatal(err)
	}
	cpu := adj.GetLinux().GetResources().GetCpu()
	if cpu.GetCpus() != "0-1,112-113" || cpu.GetMems() != "0" || len(ups) != 0 {
		t.Errorf("a: cpus %q mems %q updates %v", cpu.GetCpus(), cpu.GetMems(), ups)
	}
	wantDev := []string{"/dev/nvidia0=c195:0", "/dev/nvidia1=c195:1", "/dev/nvidiactl=c195:255", "/dev/nvidia-uvm=c510:0"}
	if got := devicePaths(adj); !slices.Equal(got, wantDev) {
		t.Errorf("a: devices %v, want %v", got, wantDev)
	}
	if got := env(adj, plugin.EnvVisibleDevices); got != uuid(0)+","+uuid(1) {
		t.Errorf("a: NVIDIA_VISIBLE_DEVICES=%q", got)
	}
	rec := adj.GetAnnotations()[oci.AnnotationPlacement]
	for _, want := range []string{`"cpus":"0-1,112-113"`, `"exclusive":true`, `"gpus":"0-1"`, `"policy":"best-effort"`, uuid(1)} {
		if !strings.Contains(rec, want) {
			t.Errorf("placement annotation %s lacks %s", rec, want)
		}
	}

	// A shared container without GPUs gets the pool: every CPU but a's.
	adj, _, err = rt.create("web", ctrSpec{name: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if got := adj.GetLinux().GetResources().GetCpu().GetCpus(); got != "2-111,114-223" {
		t.Errorf("b: cpus %q", got)
	}
	if adj.GetLinux().GetResources().GetCpu().GetMems() != "" {
		t.Errorf("b: mems set for an unaligned container")
	}

	// Restart the plugin: it re-books a and b from the runtime and asks for no update.
	stop()
	p2, ups, stop2 := rt.connect(cfg())
	defer stop2()
	if len(ups) != 0 {
		t.Fatalf("Synchronize after restart asked for updates %v", ups)
	}
	if pl, ok := p2.Placement("ctr-a"); !ok || topology.FormatIDList(pl.CPUs) != "0-1,112-113" || topology.FormatIDList(pl.GPUs) != "0-1" || !pl.Exclusive {
		t.Fatalf("restarted plugin's view of a: %+v %v", pl, ok)
	}

	// The next container gets what a does not hold.
	adj, ups, err = rt.create("infer2", ctrSpec{name: "c", annotations: gpus(2), cpus: 4})
	if err != nil {
		t.Fatal(err)
	}
	if got := devicePaths(adj)[:2]; !slices.Equal(got, []string{"/dev/nvidia2=c195:2", "/dev/nvidia3=c195:3"}) {
		t.Errorf("c: devices %v, want GPUs 2 and 3", got)
	}
	if got := adj.GetLinux().GetResources().GetCpu().GetCpus(); got != "2-3,114-115" {
		t.Errorf("c: cpus %q", got)
	}
	if len(ups) != 1 || ups[0].ContainerId != "ctr-b" || rt.cpus("b") != "4-111,116-223" {
		t.Errorf("c: updates %v, b now %q", ups, rt.cpus("b"))
	}

	// Stopping a gives its CPUs back to b's pool.
	ups = rt.stop("a")
	if len(ups) != 1 || rt.cpus("b") != "0-1,4-113,116-223" {
		t.Errorf("stop a: updates %v, b now %q", ups, rt.cpus("b"))
	}
	if _, ok := p2.Placement("ctr-a"); ok {
		t.Error("a still placed after stop and remove")
	}
}

// TestRuntimeBadInput: every bad request fails the creation with a clear error, is counted under
// its refusal reason and policy, and changes nothing; the next good request gets what it would
// have got.
func TestRuntimeBadInput(t *testing.T) {
	rt := startRuntime(t)
	reg := prometheus.NewRegistry()
	_, _, stop := rt.connect(cfg(), plugin.WithRegisterer(reg))
	defer stop()
	if _, _, err := rt.create("dup", ctrSpec{name: "dup"}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		cs     ctrSpec
		want   string
		reason string
		policy string
	}{
		{"words", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "two"}}, `berth.dev/gpus="two": want a whole number of GPUs`, plugin.ReasonBadAnnotation, "best-effort"},
		{"negative", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "-1"}}, `berth.dev/gpus="-1": want a whole number`, plugin.ReasonBadAnnotation, "best-effort"},
		{"fraction", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "1.5"}}, `"1.5"`, plugin.ReasonBadAnnotation, "best-effort"},
		{"empty", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: ""}}, `berth.dev/gpus=""`, plugin.ReasonBadAnnotation, "best-effort"},
		{"huge", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "99999999999999999999"}}, "too many GPUs", plugin.ReasonBadAnnotation, "best-effort"},
		{"larger than node", ctrSpec{annotations: gpus(9)}, "it asks for 9 GPUs; this node has 8 GPUs", plugin.ReasonUnplaceable, "best-effort"},
		{"too many CPUs", ctrSpec{cpus: 300}, "it asks for 300 exclusive CPUs; this node can give at most 223", plugin.ReasonUnplaceable, "best-effort"},
		{"unknown policy", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "1", oci.AnnotationNUMAPolicy: "tight"}}, `unknown NUMA policy "tight"`, plugin.ReasonUnknownPolicy, "unknown"},
		{"single-numa 8", ctrSpec{annotations: map[string]string{oci.AnnotationGPUs: "8", oci.AnnotationNUMAPolicy: "single-numa-node"}},
			"no single NUMA node can hold 8 free GPUs even when empty; free now: node 0: 4 GPUs (0-3), 112 CPUs; node 1: 4 GPUs (4-7), 112 CPUs",
			plugin.ReasonUnplaceable, "single-numa-node"},
		{"count disagrees with CDI", ctrSpec{annotations: gpus(2), cdi: []string{"nvidia.com/gpu=" + uuid(5)}}, `berth.dev/gpus="2", but the container already has GPUs 5`,
			plugin.ReasonBadAnnotation, "best-effort"},
		{"same id twice", ctrSpec{name: "dup", annotations: map[string]string{oci.AnnotationNUMAPolicy: "restricted"}}, "container ctr-dup is already placed",
			plugin.ReasonConflict, "restricted"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.cs.name == "" {
				tt.cs.name = fmt.Sprintf("bad%d", i)
			}
			refusals, refused := gathered(t, reg, plugin.MetricRefusals, "reason", tt.reason), gathered(t, reg, plugin.MetricPlacements, "result", "refused", "policy", tt.policy)
			adj, _, err := rt.create("bad", tt.cs)
			if err == nil || !strings.Contains(err.Error(), tt.want) || adj != nil {
				t.Fatalf("create = %v, %v; want an error containing %q", adj, err, tt.want)
			}
			if got := gathered(t, reg, plugin.MetricRefusals, "reason", tt.reason); got != refusals+1 {
				t.Errorf("%s{reason=%q} = %v, want %v", plugin.MetricRefusals, tt.reason, got, refusals+1)
			}
			if got := gathered(t, reg, plugin.MetricPlacements, "result", "refused", "policy", tt.policy); got != refused+1 {
				t.Errorf("%s{result=refused,policy=%q} = %v, want %v", plugin.MetricPlacements, tt.policy, got, refused+1)
			}
			t.Log(err)
		})
	}
	if got := gathered(t, reg, plugin.MetricRefusals, "reason", plugin.ReasonOther); got != 0 {
		t.Errorf("refusals of reason other: %v", got)
	}
	adj, _, err := rt.create("good", ctrSpec{name: "good", annotations: gpus(2), cpus: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := adj.GetLinux().GetResources().GetCpu().GetCpus(); got != "0,112" || env(adj, plugin.EnvVisibleDevices) != uuid(0)+","+uuid(1) {
		t.Fatalf("after bad requests: cpus %q, GPUs %q", got, env(adj, plugin.EnvVisibleDevices))
	}
}

// TestRuntimeCDIAndAssigned: CDI injection, and GPUs that came with the container.
func TestRuntimeCDIAndAssigned(t *testing.T) {
	rt := startRuntime(t)
	c := cfg()
	c.CDI = true
	_, _, stop := rt.connect(c)
	defer stop()

	adj, _, err := rt.create("cdi", ctrSpec{name: "cdi", annotations: gpus(1)})
	if err != nil {
		t.Fatal(err)
	}
	if d := adj.GetCDIDevices(); len(d) != 1 || d[0].Name != "nvidia.com/gpu="+uuid(0) || len(adj.GetLinux().GetDevices()) != 0 {
		t.Fatalf("CDI adjustment: %v, devices %v", d, devicePaths(adj))
	}

	// A device plugin gave GPU 5 by CDI and GPU 6 by env: berth aligns CPUs and memory to node 1
	// and injects nothing.
	adj, _, err = rt.create("given", ctrSpec{name: "given", cpus: 2, cdi: []string{"nvidia.com/gpu=" + uuid(5)},
		env: []string{"NVIDIA_VISIBLE_DEVICES=6"}})
	if err != nil {
		t.Fatal(err)
	}
	cpu := adj.GetLinux().GetResources().GetCpu()
	if cpu.GetMems() != "1" || cpu.GetCpus() != "56,168" || len(adj.GetCDIDevices()) != 0 || env(adj, plugin.EnvVisibleDevices) != "" {
		t.Fatalf("assigned GPUs: cpus %q mems %q CDI %v env %q", cpu.GetCpus(), cpu.GetMems(), adj.GetCDIDevices(), env(adj, plugin.EnvVisibleDevices))
	}
	// /dev/nvidia7 in the spec books GPU 7: a request for 3 GPUs on node 1 cannot be met there.
	if _, _, err := rt.create("dev", ctrSpec{name: "dev", devices: []string{"/dev/nvidia7"}, env: []string{"NVIDIA_VISIBLE_DEVICES=all"}}); err != nil {
		t.Fatal(err)
	}
	_, _, err = rt.create("three", ctrSpec{name: "three", annotations: map[string]string{oci.AnnotationGPUs: "3", oci.AnnotationNUMAPolicy: "single-numa-node"}})
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = rt.create("four", ctrSpec{name: "four", annotations: map[string]string{oci.AnnotationGPUs: "2", oci.AnnotationNUMAPolicy: "single-numa-node"}})
	if err == nil || !strings.Contains(err.Error(), "no NUMA node has 2 free GPUs; free now: node 0: 0 GPUs") || !strings.Contains(err.Error(), "node 1: 1 GPU (4)") {
		t.Fatalf("expected a single-numa-node refusal naming the free GPUs, got %v", err)
	}
}

// TestConcurrentCreates calls the plugin from many goroutines at once: no CPU or GPU is given
// twice, and every request that fits is placed.
func TestConcurrentCreates(t *testing.T) {
	reg := prometheus.NewRegistry()
	p, err := plugin.New(cfg(), dgxNode, plugin.WithDeviceInfo(fakeDevices), plugin.WithRegisterer(reg))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 40)
	for i := range errs {
		wg.Go(func() {
			g := 0
			if i%5 == 0 {
				g = 1
			}
			pod := &api.PodSandbox{Id: fmt.Sprint("p", i), Name: fmt.Sprint("p", i), Namespace: "default"}
			c := &api.Container{Id: fmt.Sprint("c", i), Name: "c", Annotations: map[string]string{oci.AnnotationGPUs: fmt.Sprint(g)},
				Linux: &api.LinuxContainer{Resources: &api.LinuxResources{Cpu: &api.LinuxCPU{
					Quota: api.Int64(int64(500000)), Period: api.UInt64(uint64(100000)), Shares: api.UInt64(uint64(5 * 1024))}}}}
			_, _, errs[i] = p.CreateContainer(context.Background(), pod, c)
		})
	}
	wg.Wait()
	cpuOwner, gpuOwner := map[int]string{}, map[int]string{}
	placed := 0
	for i, err := range errs {
		id := fmt.Sprint("c", i)
		pl, ok := p.Placement(id)
		if err != nil || !ok {
			continue
		}
		placed++
		for _, c := range pl.CPUs {
			if o, dup := cpuOwner[c]; dup {
				t.Fatalf("CPU %d given to %s and %s", c, o, id)
			}
			cpuOwner[c] = id
		}
		for _, g := range pl.GPUs {
			if o, dup := gpuOwner[g]; dup {
				t.Fatalf("GPU %d given to %s and %s", g, o, id)
			}
			gpuOwner[g] = id
		}
	}
	// 40 x 5 CPUs = 200 <= 223, 8 x 1 GPU: everything fits.
	if placed != 40 || len(gpuOwner) != 8 || len(cpuOwner) != 200 {
		t.Fatalf("placed %d, GPUs %d, CPUs %d; errors %v", placed, len(gpuOwner), len(cpuOwner), errs)
	}
	// Every decision was counted once, and the gauges add up to what was placed.
	fams := gather(t, reg)
	if got := value(t, fams, plugin.MetricPlacements, "result", "placed", "policy", "best-effort"); got != 40 {
		t.Errorf("placements counted: %v, want 40", got)
	}
	if h := metric(t, fams, plugin.MetricDecisionDuration).GetHistogram(); h.GetSampleCount() != 40 {
		t.Errorf("decisions timed: %d, want 40", h.GetSampleCount())
	}
	cpus := value(t, fams, plugin.MetricCPUsHeld, "numa_node", "0") + value(t, fams, plugin.MetricCPUsHeld, "numa_node", "1")
	gpus := value(t, fams, plugin.MetricGPUsHeld, "numa_node", "0") + value(t, fams, plugin.MetricGPUsHeld, "numa_node", "1")
	if cpus != 200 || gpus != 8 {
		t.Errorf("gauges: %v CPUs and %v GPUs held, want 200 and 8", cpus, gpus)
	}
}

// TestSetNode: a rebuilt model keeps every placement; one whose CPUs vanished stays tracked as
// unmanaged without its exclusive CPUs.
func TestSetNode(t *testing.T) {
	p, err := plugin.New(cfg(), dgxNode, plugin.WithDeviceInfo(fakeDevices))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i, spec := range []struct{ gpus, cpus int }{{2, 4}, {0, 0}} {
		pod := &api.PodSandbox{Id: fmt.Sprint("p", i), Name: fmt.Sprint("p", i), Namespace: "default"}
		c := &api.Container{Id: fmt.Sprint("c", i), Name: "c", Annotations: gpus(spec.gpus),
			Linux: &api.LinuxContainer{Resources: &api.LinuxResources{Cpu: &api.LinuxCPU{}}}}
		if spec.cpus > 0 {
			c.Linux.Resources.Cpu = &api.LinuxCPU{Quota: api.Int64(int64(spec.cpus) * 100000), Period: api.UInt64(uint64(100000)), Shares: api.UInt64(uint64(spec.cpus) * 1024)}
		}
		if _, _, err := p.CreateContainer(ctx, pod, c); err != nil {
			t.Fatal(err)
		}
	}
	before, _ := p.Placement("c0")
	if err := p.SetNode(ctx, dgxNode); err != nil {
		t.Fatal(err)
	}
	after, ok := p.Placement("c0")
	if !ok || !slices.Equal(before.CPUs, after.CPUs) || !slices.Equal(before.GPUs, after.GPUs) || !after.Exclusive {
		t.Fatalf("placement changed by SetNode: %+v -> %+v", before, after)
	}
	// A smaller node (CPUs 0-15 only, no GPUs): c0's GPUs and CPUs 112-113 are gone.
	spec := nodetest.Spec{Sockets: 1, NUMAPerSocket: 1, CoresPerNUMA: 8, Threads: 2, MemPerNUMA: 1 << 20}
	small := nodetest.Build(t, spec, nil)
	if err := p.SetNode(ctx, small); err != nil {
		t.Fatal(err)
	}
	got, ok := p.Placement("c0")
	if !ok || got.Exclusive || len(got.GPUs) != 0 || !slices.Equal(got.CPUs, []int{0, 1}) {
		t.Fatalf("c0 on the smaller node: %+v %v (want unmanaged, shared, CPUs 0-1 that still exist)", got, ok)
	}
	if _, ok := p.Placement("c1"); !ok {
		t.Fatal("c1 lost")
	}
}

// TestRunReconnects runs the whole plugin (Run: model from files, stub, reconnect loop) against
// an in-process runtime, restarts the runtime on the same socket, and sees the plugin come back
// and place a container.
func TestRunReconnects(t *testing.T) {
	dir, err := os.MkdirTemp("", "nri-run-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	topo := filepath.Join(dir, "topo.txt")
	if err := os.WriteFile(topo, []byte(fakeTopology), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "nri.sock")
	start := func() (*adaptation.Adaptation, chan struct{}) {
		synced := make(chan struct{}, 4)
		r, err := adaptation.New("berth-test", "v0", func(ctx context.Context, cb adaptation.SyncCB) error {
			_, err := cb(ctx, nil, nil)
			synced <- struct{}{}
			return err
		}, func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) { return nil, nil },
			adaptation.WithSocketPath(sock), adaptation.WithPluginPath(filepath.Join(dir, "p")), adaptation.WithPluginConfigPath(filepath.Join(dir, "c")))
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(); err != nil {
			t.Fatal(err)
		}
		<-synced // the runtime's own start-up sync
		return r, synced
	}
	r, synced := start()
	// The plugin connects through a proxy, so that the test can cut the connection as a
	// containerd restart would (the in-process runtime's Stop leaves plugin connections open).
	proxy := filepath.Join(dir, "proxy.sock")
	l, err := net.Listen("unix", proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var connsMu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("unix", sock)
			if err != nil {
				in.Close()
				continue
			}
			connsMu.Lock()
			conns = append(conns, in, out)
			connsMu.Unlock()
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	cut := func() {
		connsMu.Lock()
		defer connsMu.Unlock()
		for _, c := range conns {
			c.Close()
		}
		conns = nil
	}
	c := cfg()
	c.Socket, c.GPUSource, c.TopologyFile, c.RefreshSeconds = proxy, "file", topo, 0
	c.SysfsRoot, _ = filepath.Abs(vmSysfs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- plugin.Run(ctx, c) }()
	waitSync := func() {
		t.Helper()
		select {
		case <-synced:
			r.BlockPluginSync().Unblock()
		case <-time.After(10 * time.Second):
			t.Fatal("plugin did not synchronize")
		}
	}
	waitSync()
	r.Stop()
	cut()
	r, synced = start()
	waitSync() // reconnected on its own
	pod := &api.PodSandbox{Id: "p", Name: "p", Namespace: "default"}
	ctr := &api.Container{Id: "c", PodSandboxId: "p", Name: "c", Annotations: gpus(1), Linux: &api.LinuxContainer{Resources: &api.LinuxResources{Cpu: &api.LinuxCPU{}}}}
	rsp, err := r.CreateContainer(ctx, &api.CreateContainerRequest{Pod: pod, Container: ctr})
	if err != nil {
		t.Fatal(err)
	}
	if env(rsp.GetAdjust(), plugin.EnvVisibleDevices) != "0" {
		t.Fatalf("after reconnect: adjustment %v", rsp.GetAdjust())
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run returned %v after cancel", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	r.Stop()
}
