package e2e

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// nriTopology is the fake GPU inventory: two GPUs joined by NVLink, GPU0 close to CPU 0 and GPU1
// close to CPU 1 of this machine, both on NUMA node 0.
const nriTopology = "# fake GPUs for berth's NRI end-to-end test\n" +
	"\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n" +
	"GPU0\t X \tNV4\t0\t0\n" +
	"GPU1\tNV4\t X \t1\t0\n"

// nriPlugin is a running berth-nri process.
type nriPlugin struct {
	cmd *exec.Cmd
	log string
}

// startNRI starts berth-nri with config cfg and waits until it has synchronized with containerd;
// it returns the plugin and the synchronize log line.
func startNRI(t *testing.T, bin, cfg, logPath string) (*nriPlugin, string) {
	t.Helper()
	f, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(bin, "-config", cfg)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &nriPlugin{cmd: cmd, log: logPath}
	t.Cleanup(p.stop)
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		b, _ := os.ReadFile(logPath)
		for line := range strings.SplitSeq(string(b), "\n") {
			if strings.Contains(line, "berth-nri: synchronized") {
				return p, line
			}
		}
	}
	b, _ := os.ReadFile(logPath)
	t.Fatalf("berth-nri did not synchronize in 30s:\n%s", b)
	return nil, ""
}

func (p *nriPlugin) stop() {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// nriPlaced is what a created container got, read back from its spec, its cgroup and its process.
type nriPlaced struct {
	cpus, mems     string // spec
	cgCPUs, cgMems string // cgroup cpuset
	allowed        string // /proc/<pid>/status Cpus_allowed_list
	devices        []string
	visible        string // NVIDIA_VISIBLE_DEVICES
	record         string // berth.dev/placement
	devInCtr       bool   // /dev/nvidia<first GPU> exists inside the container
}

func nriInspect(t *testing.T, ctx context.Context, nd *node.Node, id string) nriPlaced {
	t.Helper()
	ins, err := nd.Inspect(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	var p nriPlaced
	s := ins.Spec
	if s.Linux != nil && s.Linux.Resources != nil && s.Linux.Resources.CPU != nil {
		p.cpus, p.mems = s.Linux.Resources.CPU.Cpus, s.Linux.Resources.CPU.Mems
	}
	for _, d := range s.Linux.Devices {
		p.devices = append(p.devices, d.Path+"="+d.Type+nriItoa(d.Major)+":"+nriItoa(d.Minor))
	}
	for _, e := range s.Process.Env {
		if v, ok := strings.CutPrefix(e, "NVIDIA_VISIBLE_DEVICES="); ok {
			p.visible = v
		}
	}
	p.record = s.Annotations["berth.dev/placement"]
	p.cgCPUs, p.cgMems = nriCgroupCpuset(t, s)
	if ins.PID > 0 {
		p.allowed = nriProcStatus(ins.PID, "Cpus_allowed_list")
		for _, d := range s.Linux.Devices {
			if strings.HasPrefix(d.Path, "/dev/nvidia") && d.Path != "/dev/nvidiactl" {
				st, err := os.Stat(filepath.Join("/proc", nriItoa(int64(ins.PID)), "root", d.Path))
				p.devInCtr = err == nil && st.Mode()&os.ModeCharDevice != 0
				break
			}
		}
	}
	return p
}

func nriItoa(v int64) string { return strconv.FormatInt(v, 10) }

// nriCgroupCpuset reads the container's cpuset.cpus and cpuset.mems from its cgroup (cgroup v1
// cpuset hierarchy, else the unified one).
func nriCgroupCpuset(t *testing.T, s *specs.Spec) (string, string) {
	path := s.Linux.CgroupsPath
	if strings.Contains(path, ":") {
		t.Logf("systemd cgroup path %q: cgroup not checked", path)
		return "", ""
	}
	for _, root := range []string{"/sys/fs/cgroup/cpuset", "/sys/fs/cgroup"} {
		dir := filepath.Join(root, path)
		c, err1 := os.ReadFile(filepath.Join(dir, "cpuset.cpus"))
		m, err2 := os.ReadFile(filepath.Join(dir, "cpuset.mems"))
		if err1 == nil && err2 == nil {
			return strings.TrimSpace(string(c)), strings.TrimSpace(string(m))
		}
	}
	t.Errorf("no cpuset cgroup for %s", path)
	return "", ""
}

func nriProcStatus(pid int, key string) string {
	f, err := os.Open(filepath.Join("/proc", nriItoa(int64(pid)), "status"))
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// TestNRIPlacement runs berth-nri against node1's real containerd (NRI on, CRI driven by crictl)
// with a fake GPU inventory mapped onto this machine's CPUs 0 and 1: the created containers'
// OCI spec, cgroup and process show the chosen cpus, mems, devices and env; the plugin is
// restarted between creates and nothing is double-booked or re-pinned; bad requests fail with
// clear errors and leave nothing behind; a stop gives resources back and grows the shared pool.
func TestNRIPlacement(t *testing.T) {
	c := needCluster(t)
	nd := c.Nodes[0]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	onlineB, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		t.Skip(err)
	}
	online, err := topology.ParseIDList(string(onlineB))
	if err != nil || len(online) < 2 || online[0] != 0 || online[1] != 1 {
		t.Skipf("needs online CPUs 0 and 1, have %q", onlineB)
	}
	all := topology.FormatIDList(online)
	rest := topology.FormatIDList(online[1:])

	dir := t.TempDir()
	bin := filepath.Join(dir, "berth-nri")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/berth-nri")
	build.Dir = node.RepoRoot()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build berth-nri: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(dir, "topo.txt"), []byte(nriTopology), 0o644); err != nil {
		t.Fatal(err)
	}
	devRoot := filepath.Join(dir, "dev") // empty: the fake GPUs have no host device nodes
	if err := os.MkdirAll(devRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "nri.toml")
	conf := "socket = \"" + nd.NRISocket + "\"\n" +
		"plugin_name = \"berth-e2e\"\n" +
		"gpu_source = \"file\"\n" +
		"topology_file = \"" + filepath.Join(dir, "topo.txt") + "\"\n" +
		"gpu_uuids = [\"GPU-nri-e2e-0\", \"GPU-nri-e2e-1\"]\n" +
		"dev_root = \"" + devRoot + "\"\n" +
		"refresh_seconds = 0\n" +
		// crictl's pods, no kubelet: berth-nri is the one that gives GPUs here
		"gpu_annotation_namespaces = [\"*\"]\n" +
		"record_key_file = \"" + filepath.Join(dir, "nri-state", "record.key") + "\"\n"
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}

	var pods []string
	t.Cleanup(func() {
		for _, p := range pods {
			nd.RemovePod(context.Background(), p)
		}
	})
	runPod := func(name string) (string, string) {
		t.Helper()
		id, pcfg, err := nd.RunPod(ctx, dir, node.CRIPod{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		pods = append(pods, id)
		return id, pcfg
	}
	create := func(pod, pcfg string, ctr node.CRIContainer) (string, error) {
		ctr.Image, ctr.Command = image.PauseRef, []string{image.PauseBinary}
		return nd.CreateContainer(ctx, dir, pod, pcfg, ctr)
	}
	start := func(id string) {
		t.Helper()
		if _, err := nd.Crictl(ctx, "start", id); err != nil {
			t.Fatal(err)
		}
	}
	gpus := func(n string) map[string]string { return map[string]string{"berth.dev/gpus": n} }

	plugin, line := startNRI(t, bin, cfg, filepath.Join(dir, "nri-1.log"))
	t.Log(line)

	// A: one GPU chosen by berth, one exclusive CPU (limit == request == 1 CPU).
	podA, cfgA := runPod("nri-a")
	a, err := create(podA, cfgA, node.CRIContainer{Name: "nri-a", Annotations: gpus("1"), CPUPeriod: 100000, CPUQuota: 100000, CPUShares: 1024})
	if err != nil {
		t.Fatal(err)
	}
	start(a)
	pa := nriInspect(t, ctx, nd, a)
	t.Logf("nri-a: %+v", pa)
	if pa.cpus != "0" || pa.mems != "0" || pa.cgCPUs != "0" || pa.cgMems != "0" || pa.allowed != "0" {
		t.Errorf("nri-a cpuset: spec %q/%q cgroup %q/%q process %q; want 0/0 everywhere", pa.cpus, pa.mems, pa.cgCPUs, pa.cgMems, pa.allowed)
	}
	if !slices.Contains(pa.devices, "/dev/nvidia0=c195:0") || !slices.Contains(pa.devices, "/dev/nvidiactl=c195:255") || slices.Contains(pa.devices, "/dev/nvidia1=c195:1") ||
		pa.visible != "GPU-nri-e2e-0" || !pa.devInCtr {
		t.Errorf("nri-a GPUs: devices %v, NVIDIA_VISIBLE_DEVICES %q, /dev/nvidia0 in container %v", pa.devices, pa.visible, pa.devInCtr)
	}
	if !strings.Contains(pa.record, `"exclusive":true`) || !strings.Contains(pa.record, `"gpus":"0"`) {
		t.Errorf("nri-a placement annotation %s", pa.record)
	}

	// Restart berth-nri: it re-books A from containerd and re-pins nothing.
	plugin.stop()
	plugin, line = startNRI(t, bin, cfg, filepath.Join(dir, "nri-2.log"))
	t.Log(line)
	if !strings.Contains(line, "placed-by-berth=1") {
		t.Errorf("after restart: %s", line)
	}

	// B: one GPU, shared CPUs: it must get the other GPU and the pool without A's CPU.
	podB, cfgB := runPod("nri-b")
	b, err := create(podB, cfgB, node.CRIContainer{Name: "nri-b", Annotations: gpus("1")})
	if err != nil {
		t.Fatal(err)
	}
	start(b)
	pb := nriInspect(t, ctx, nd, b)
	t.Logf("nri-b: %+v", pb)
	if pb.cpus != rest || pb.cgCPUs != rest || pb.allowed != rest || pb.mems != "0" {
		t.Errorf("nri-b cpuset: spec %q cgroup %q process %q mems %q; want %s (all but nri-a's CPU 0)", pb.cpus, pb.cgCPUs, pb.allowed, pb.mems, rest)
	}
	if !slices.Contains(pb.devices, "/dev/nvidia1=c195:1") || slices.Contains(pb.devices, "/dev/nvidia0=c195:0") || pb.visible != "GPU-nri-e2e-1" {
		t.Errorf("nri-b GPUs: devices %v, NVIDIA_VISIBLE_DEVICES %q (nri-a holds GPU 0)", pb.devices, pb.visible)
	}
	if again := nriInspect(t, ctx, nd, a); again.cgCPUs != "0" || again.allowed != "0" {
		t.Errorf("nri-a re-pinned: cgroup %q process %q", again.cgCPUs, again.allowed)
	}

	// Restart again; then no GPU is free, and bad requests fail clearly, leaving nothing behind.
	plugin.stop()
	plugin, line = startNRI(t, bin, cfg, filepath.Join(dir, "nri-3.log"))
	t.Log(line)
	if !strings.Contains(line, "containers=2") || !strings.Contains(line, "placed-by-berth=2") {
		t.Errorf("after second restart: %s", line)
	}
	podC, cfgC := runPod("nri-c")
	bad := []struct {
		name string
		ctr  node.CRIContainer
		want string
	}{
		{"nri-c-full", node.CRIContainer{Annotations: gpus("1")}, "the node does not have 1 free GPU; free now: node 0: 0 GPUs"},
		{"nri-c-negative", node.CRIContainer{Annotations: gpus("-1")}, "berth.dev/gpus=\\\"-1\\\": want a whole number of GPUs"},
		{"nri-c-words", node.CRIContainer{Annotations: gpus("two")}, "berth.dev/gpus=\\\"two\\\": want a whole number of GPUs"},
		{"nri-c-too-many", node.CRIContainer{Annotations: gpus("3")}, "it asks for 3 GPUs; this node has 2 GPUs"},
		{"nri-c-policy", node.CRIContainer{Annotations: map[string]string{"berth.dev/numa-policy": "tight"}}, "berth.dev/numa-policy: invalid placement request: unknown NUMA policy"},
		{"nri-c-cpus", node.CRIContainer{CPUPeriod: 100000, CPUQuota: 100000 * int64(len(online)), CPUShares: 1024 * int64(len(online))},
			"exclusive CPUs; this node can give at most"},
	}
	for _, tt := range bad {
		tt.ctr.Name = tt.name
		id, err := create(podC, cfgC, tt.ctr)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: create = %q, %v; want an error containing %q", tt.name, id, err, tt.want)
			continue
		}
		t.Logf("%s refused: %s", tt.name, nriLastLine(err.Error()))
	}
	if out, _ := nd.Crictl(ctx, "ps", "-a", "-q", "--pod", podC); out != "" {
		t.Errorf("refused containers left behind: %q", out)
	}

	// Stop A: its GPU and CPU come back, and B's shared pool grows to every CPU.
	nd.RemovePod(ctx, podA)
	var pb2 nriPlaced
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if pb2 = nriInspect(t, ctx, nd, b); pb2.cgCPUs == all {
			break
		}
	}
	if pb2.cgCPUs != all || pb2.allowed != all {
		t.Errorf("nri-b after nri-a stopped: cgroup %q process %q, want %s", pb2.cgCPUs, pb2.allowed, all)
	}
	podD, cfgD := runPod("nri-d")
	d, err := create(podD, cfgD, node.CRIContainer{Name: "nri-d", Annotations: gpus("1"), CPUPeriod: 100000, CPUQuota: 100000, CPUShares: 1024})
	if err != nil {
		t.Fatal(err)
	}
	start(d)
	pd := nriInspect(t, ctx, nd, d)
	t.Logf("nri-d: %+v", pd)
	if pd.visible != "GPU-nri-e2e-0" || pd.cgCPUs != "0" {
		t.Errorf("nri-d: NVIDIA_VISIBLE_DEVICES %q cgroup %q; want nri-a's freed GPU 0 and CPU 0", pd.visible, pd.cgCPUs)
	}

	// issue 19: a placement record berth-nri did not write (a pod's annotation, put on a
	// container created while berth-nri was down) is not believed after a restart, and under a
	// kubelet (the default configuration) berth.dev/gpus gives no GPU
	nd.RemovePod(ctx, podB)
	nd.RemovePod(ctx, podD)
	plugin.stop()
	podE, cfgE := runPod("nri-e")
	forged := `{"cpus":"0","exclusive":true,"gpus":"0-1","policy":"best-effort","aligned":true}`
	e, err := create(podE, cfgE, node.CRIContainer{Name: "nri-e", Annotations: map[string]string{"berth.dev/placement": forged}})
	if err != nil {
		t.Fatal(err)
	}
	start(e)
	kubeletCfg := filepath.Join(dir, "nri-kubelet.toml")
	if err := os.WriteFile(kubeletCfg, []byte(strings.ReplaceAll(conf, "gpu_annotation_namespaces = [\"*\"]\n", "")), 0o644); err != nil {
		t.Fatal(err)
	}
	plugin, line = startNRI(t, bin, kubeletCfg, filepath.Join(dir, "nri-4.log"))
	t.Log(line)
	if !strings.Contains(line, "placed-by-berth=0") {
		t.Errorf("the forged record was believed: %s", line)
	}
	podF, cfgF := runPod("nri-f")
	if id, err := create(podF, cfgF, node.CRIContainer{Name: "nri-f", Annotations: gpus("1")}); err == nil || !strings.Contains(err.Error(), "gpu_annotation_namespaces") {
		t.Errorf("berth.dev/gpus under a kubelet: create = %q, %v; want a refusal naming gpu_annotation_namespaces", id, err)
	}
	plugin.stop()
	plugin, line = startNRI(t, bin, cfg, filepath.Join(dir, "nri-5.log"))
	t.Log(line)
	podG, cfgG := runPod("nri-g")
	g, err := create(podG, cfgG, node.CRIContainer{Name: "nri-g", Annotations: gpus("2")})
	if err != nil {
		t.Fatalf("two GPUs after the forged record claimed both: %v", err)
	}
	start(g)
	if pg := nriInspect(t, ctx, nd, g); pg.visible != "GPU-nri-e2e-0,GPU-nri-e2e-1" {
		t.Errorf("nri-g: NVIDIA_VISIBLE_DEVICES %q, want both GPUs", pg.visible)
	}
	plugin.stop()
	if b, err := os.ReadFile(filepath.Join(dir, "nri-3.log")); err == nil && testing.Verbose() {
		t.Logf("berth-nri log:\n%s", b)
	}
}

func nriLastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndex(s, "\n"); i >= 0 {
		return s[i+1:]
	}
	return s
}
