package e2e

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// The Kubernetes cluster (test/node kube*.go) is started by the first test that needs it and
// stopped after the last one (TestMain) or on SIGINT/SIGTERM, also while it is starting.
var kube struct {
	once   sync.Once
	mu     sync.Mutex
	cancel context.CancelFunc // cancels a start in progress
	done   chan struct{}      // closed when the start returned
	c      *node.KubeCluster
	dir    string
	err    error
}

// needKube returns the running cluster, starting it on first use. Without root, the stack or the
// Kubernetes binaries the test skips, except under CI=true, where it fails.
func needKube(t testing.TB) *node.KubeCluster {
	t.Helper()
	if err := node.RequireKube(); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI=true but %v", err)
		}
		t.Skip(err)
	}
	kube.once.Do(func() {
		dir, err := os.MkdirTemp("/var/tmp", "berth-kube-")
		if err != nil {
			kube.err = err
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		kube.mu.Lock()
		kube.dir, kube.cancel, kube.done = dir, cancel, make(chan struct{})
		kube.mu.Unlock()
		c, err := node.StartKube(ctx, node.KubeOptions{Dir: dir, Nodes: 2, Log: os.Stderr})
		kube.mu.Lock()
		kube.c, kube.err = c, err
		close(kube.done)
		kube.mu.Unlock()
	})
	if kube.err != nil {
		t.Fatalf("start the Kubernetes cluster: %v", kube.err)
	}
	return kube.c
}

// stopKube stops the cluster if one was started (a start in progress is cancelled, and cleans
// up after itself) and removes its directory, which BERTH_E2E_KEEP keeps after a failure.
func stopKube(failed bool) {
	kube.mu.Lock()
	cancel, done := kube.cancel, kube.done
	kube.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	kube.mu.Lock()
	defer kube.mu.Unlock()
	if kube.c != nil {
		kube.c.Stop(context.Background())
		kube.c = nil
	}
	if kube.dir != "" {
		if (failed || kube.err != nil) && os.Getenv("BERTH_E2E_KEEP") != "" {
			fmt.Fprintln(os.Stderr, "e2e: keeping", kube.dir)
		} else {
			os.RemoveAll(kube.dir)
		}
		kube.dir = ""
	}
}

// kubePodYAML is the inference pod a user would write for berth: runtimeClassName berth, one
// exclusive CPU (Guaranteed QoS, which berth-nri pins), the RuntimeDefault seccomp profile and a
// locked-down security context, with annotations and the nodeSelector selector.
func kubePodYAML(name, ns string, annotations, selector map[string]string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: v1\nkind: Pod\nmetadata:\n  name: %s\n  namespace: %s\n  labels: {app: infer}\n", name, ns)
	if len(annotations) > 0 {
		b.WriteString("  annotations:\n")
		for _, k := range slices.Sorted(maps.Keys(annotations)) {
			fmt.Fprintf(&b, "    %s: %q\n", k, annotations[k])
		}
	}
	b.WriteString("spec:\n  runtimeClassName: berth\n  restartPolicy: Never\n  nodeSelector:\n")
	for _, k := range slices.Sorted(maps.Keys(selector)) {
		fmt.Fprintf(&b, "    %s: %q\n", k, selector[k])
	}
	fmt.Fprintf(&b, `  securityContext:
    seccompProfile: {type: RuntimeDefault}
  containers:
  - name: infer
    image: %s
    imagePullPolicy: Never
    args: ["-weights-mib", "16", "-delay-ms", "0"]
    ports: [{containerPort: 8080}]
    resources:
      requests: {cpu: "1", memory: 256Mi}
      limits: {cpu: "1", memory: 256Mi}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: ["ALL"]}
`, image.WorkloadRef)
	return b.String()
}

// kubeGetPod returns the pod as the API server has it.
func kubeGetPod(t *testing.T, ctx context.Context, c *node.KubeCluster, ns, name string) *corev1.Pod {
	t.Helper()
	out, err := c.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var p corev1.Pod
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		t.Fatalf("pod %s: %v", name, err)
	}
	return &p
}

// kubeRunPod creates the pod and waits until it is Ready; on failure it reports what the API
// server and the node say about it.
func kubeRunPod(t *testing.T, ctx context.Context, c *node.KubeCluster, ns, name, manifest string) *corev1.Pod {
	t.Helper()
	if _, err := c.KubectlIn(ctx, strings.NewReader(manifest), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=120s"); err != nil {
		desc, _ := c.Kubectl(ctx, "-n", ns, "describe", "pod", name)
		t.Fatalf("pod %s not Ready: %v\n%s", name, err, desc)
	}
	return kubeGetPod(t, ctx, c, ns, name)
}

// kubeContainer returns the pod's node and its container's CRI id.
func kubeContainer(t *testing.T, c *node.KubeCluster, p *corev1.Pod) (*node.KubeNode, string) {
	t.Helper()
	n := c.Node(p.Spec.NodeName)
	if n == nil || len(p.Status.ContainerStatuses) == 0 {
		t.Fatalf("pod %s: node %q, %d container statuses", p.Name, p.Spec.NodeName, len(p.Status.ContainerStatuses))
	}
	id, ok := strings.CutPrefix(p.Status.ContainerStatuses[0].ContainerID, "containerd://")
	if !ok {
		t.Fatalf("pod %s: container id %q", p.Name, p.Status.ContainerStatuses[0].ContainerID)
	}
	return n, id
}

// kubeSecurity is what a running container kept of its security context, read from its spec
// and its process.
type kubeSecurity struct {
	seccompSpec bool   // the spec has a seccomp profile (RuntimeDefault)
	readonly    bool   // read-only root filesystem
	seccomp     string // /proc/PID/status Seccomp (2: filter)
	noNewPrivs  string // NoNewPrivs (1)
	capEff      string // CapEff (all zero: every capability dropped)
}

func kubeSecurityOf(t *testing.T, ctx context.Context, n *node.KubeNode, id string) kubeSecurity {
	t.Helper()
	ins, err := n.Inspect(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	s := kubeSecurity{
		seccompSpec: ins.Spec.Linux != nil && ins.Spec.Linux.Seccomp != nil && len(ins.Spec.Linux.Seccomp.Syscalls) > 0,
		readonly:    ins.Spec.Root != nil && ins.Spec.Root.Readonly,
		seccomp:     nriProcStatus(ins.PID, "Seccomp"),
		noNewPrivs:  nriProcStatus(ins.PID, "NoNewPrivs"),
		capEff:      nriProcStatus(ins.PID, "CapEff"),
	}
	return s
}

func (s kubeSecurity) check(t *testing.T, what string) {
	t.Helper()
	t.Logf("%s: seccomp profile in spec %v, seccomp mode %s, no_new_privs %s, CapEff %s, read-only root %v", what, s.seccompSpec, s.seccomp, s.noNewPrivs, s.capEff, s.readonly)
	if !s.seccompSpec || s.seccomp != "2" || s.noNewPrivs != "1" || strings.Trim(s.capEff, "0") != "" || !s.readonly {
		t.Errorf("%s lost its security context: %+v; want the RuntimeDefault profile in the spec and seccomp mode 2, no_new_privs, no capabilities, read-only root", what, s)
	}
}

// checkPinned checks that berth-nri pinned the container: one exclusive CPU in its spec, its
// cgroup's cpuset and its process's affinity, and the placement record.
func checkPinned(t *testing.T, ctx context.Context, n *node.KubeNode, id, what string) {
	t.Helper()
	p := nriInspect(t, ctx, n.Node, id)
	t.Logf("%s on %s: spec cpus %q mems %q, cgroup cpuset %q/%q, affinity %q, placement %s", what, n.Name, p.cpus, p.mems, p.cgCPUs, p.cgMems, p.allowed, p.record)
	if p.cpus == "" || strings.ContainsAny(p.cpus, ",-") || p.cgCPUs != p.cpus || p.allowed != p.cpus || p.cgMems != p.mems ||
		!strings.Contains(p.record, `"exclusive":true`) {
		t.Errorf("%s not pinned by berth-nri: spec cpus %q mems %q, cgroup %q/%q, affinity %q, placement %q", what, p.cpus, p.mems, p.cgCPUs, p.cgMems, p.allowed, p.record)
	}
}

// TestKubeInference runs the inference workload as a user would on Kubernetes, through the API
// server with kubectl: nodes labelled by Node Feature Discovery from berthctl labels; a pod with runtimeClassName berth on kube1, pinned by the berth-nri
// DaemonSet and keeping its seccomp profile and security context; a session streamed; the
// kubelet checkpoint API (POST /api/v1/nodes/NODE/proxy/checkpoint/NS/POD/CONTAINER) writes an
// archive in kube1's kubelet checkpoint directory, which checkpointctl reads; the archive copied
// under kube2's checkpoint root, a pod with berth.dev/restore-from and the node selector of
// `berthctl checkpoint selector` comes up Ready on kube2, pinned, with the same security, and
// the session continues with the tokens of an uninterrupted run and no prefill recomputed.
func TestKubeInference(t *testing.T) {
	c := needKube(t)
	if len(c.Nodes) < 2 {
		t.Fatalf("cluster has %d nodes", len(c.Nodes))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for _, tm := range c.Timings {
		t.Logf("cluster: %-70s %6.1f s", tm.Step, tm.Took.Seconds())
	}
	src, dst := c.Nodes[0], c.Nodes[1]
	// Node Feature Discovery labelled every node from the feature file berthctl labels wrote
	for _, n := range c.Nodes {
		out, err := c.Kubectl(ctx, "get", "node", n.Name, "-o", "json")
		if err != nil {
			t.Fatal(err)
		}
		var kn corev1.Node
		if err := json.Unmarshal([]byte(out), &kn); err != nil {
			t.Fatal(err)
		}
		if n.Labels["berth.dev/fingerprint"] == "" {
			t.Fatalf("node %s: feature file without berth.dev/fingerprint: %v", n.Name, n.Labels)
		}
		for k, v := range n.Labels {
			if kn.Labels[k] != v {
				t.Errorf("node %s: label %s=%q, the feature file says %q", n.Name, k, kn.Labels[k], v)
			}
		}
		if !strings.Contains(kn.Annotations["nfd.node.kubernetes.io/feature-labels"], "berth.dev/fingerprint") {
			t.Errorf("node %s: labels not set by NFD (annotations %v)", n.Name, kn.Annotations)
		}
	}
	const ns = "berth-e2e"
	if _, err := c.Kubectl(ctx, "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = c.Kubectl(context.Background(), "delete", "namespace", ns, "--wait=false")
	})

	t0 := time.Now()
	srcPod := kubeRunPod(t, ctx, c, ns, "infer", kubePodYAML("infer", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}))
	tStart := time.Since(t0)
	n, cid := kubeContainer(t, c, srcPod)
	if n != src {
		t.Fatalf("pod on %s, want %s", n.Name, src.Name)
	}
	checkPinned(t, ctx, src, cid, "source container")
	kubeSecurityOf(t, ctx, src, cid).check(t, "source container")

	st := client.Target{BaseURL: srcPod.Status.PodIP + ":8080"}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	const prompt = "kubelet checkpoint api"
	first, err := client.Stream(ctx, st, client.Request{Session: "kube", Prompt: prompt, N: 30})
	if err != nil {
		t.Fatal(err)
	}
	before, err := client.Stats(ctx, st)
	if err != nil {
		t.Fatal(err)
	}

	// the kubelet checkpoint API, through the API server's node proxy
	t0 = time.Now()
	out, err := c.Kubectl(ctx, "create", "--raw", fmt.Sprintf("/api/v1/nodes/%s/proxy/checkpoint/%s/%s/infer", src.Name, ns, srcPod.Name), "-f", "/dev/null")
	if err != nil {
		t.Fatalf("kubelet checkpoint API: %v", err)
	}
	tCheckpoint := time.Since(t0)
	var resp struct {
		Items []string `json:"items"`
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil || len(resp.Items) != 1 {
		t.Fatalf("checkpoint API answered %q (%v); want one archive", out, err)
	}
	archive := resp.Items[0]
	if filepath.Dir(archive) != src.CheckpointDir {
		t.Errorf("archive %s is not in the kubelet's checkpoint directory %s", archive, src.CheckpointDir)
	}
	fi, err := os.Stat(archive)
	if err != nil {
		t.Fatal(err)
	}
	if names := kubeTarNames(t, archive); !slices.Contains(names, "checkpoint/berth.json") {
		t.Errorf("archive %s has no checkpoint/berth.json (berth's manifest): %v", archive, names)
	}
	kubeInspectVerify(t, ctx, c, dst, archive)
	if out, err := exec.CommandContext(ctx, c.Stack.Tool("checkpointctl"), "show", archive).CombinedOutput(); err != nil {
		t.Errorf("checkpointctl show %s: %v\n%s", archive, err, out)
	}
	if p := kubeGetPod(t, ctx, c, ns, srcPod.Name); p.Status.Phase != corev1.PodRunning {
		t.Errorf("source pod %s after the checkpoint; want Running", p.Status.Phase)
	}

	t.Run("restore on the other node", func(t *testing.T) {
		// the archive as the destination's shim takes it: a file under its checkpoint root
		name := "infer-kube.tar"
		if err := copyFile(archive, filepath.Join(dst.CheckpointRoot, name)); err != nil {
			t.Fatal(err)
		}
		selector := kubeSelector(t, ctx, c, archive)
		for k, v := range selector {
			if dst.Labels[k] != v {
				t.Errorf("selector %s=%s does not match %s's label %q", k, v, dst.Name, dst.Labels[k])
			}
		}
		selector["kubernetes.io/hostname"] = dst.Name // the other node
		t0 := time.Now()
		rp := kubeRunPod(t, ctx, c, ns, "infer-restored", kubePodYAML("infer-restored", ns, map[string]string{"berth.dev/restore-from": name}, selector))
		tRestore := time.Since(t0)
		rn, rid := kubeContainer(t, c, rp)
		if rn != dst {
			t.Fatalf("restored pod on %s, want %s", rn.Name, dst.Name)
		}
		checkPinned(t, ctx, dst, rid, "restored container")
		kubeSecurityOf(t, ctx, dst, rid).check(t, "restored container")

		rt := client.Target{BaseURL: rp.Status.PodIP + ":8080"}
		rest, err := client.Stream(ctx, rt, client.Request{Session: "kube", N: 60, From: 30})
		if err != nil {
			t.Fatal(err)
		}
		want, err := model.Reference(model.Config{WeightsMiB: 16, Seed: 1}, prompt, 60)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := strings.Join(append(first, rest...), " "), strings.Join(model.Words(want), " "); got != want {
			t.Errorf("session across the move:\n got %s\nwant %s", got, want)
		}
		after, err := client.Stats(ctx, rt)
		if err != nil {
			t.Fatal(err)
		}
		if after.Prefills != before.Prefills {
			t.Errorf("restored workload counts %d prefills, the source had %d: context recomputed", after.Prefills, before.Prefills)
		}
		logs, err := c.Kubectl(ctx, "-n", ns, "logs", rp.Name)
		if err != nil {
			t.Error(err)
		}
		if strings.Count(logs, "infer ready") > 1 {
			t.Errorf("restored pod's log shows the workload starting again:\n%s", logs)
		}
		t.Logf("Kubernetes, inference (16 MiB weights), archive %.1f MiB:\n"+
			"  pod created -> Ready (kube1)                 %8.1f ms\n"+
			"  kubelet checkpoint API (via API server)      %8.1f ms\n"+
			"  restore pod created -> Ready (kube2)         %8.1f ms",
			float64(fi.Size())/(1<<20), tStart.Seconds()*1000, tCheckpoint.Seconds()*1000, tRestore.Seconds()*1000)
	})
}

// kubeSelector returns the node selector `berthctl checkpoint selector` prints for the kubelet's
// archive, read in place (the shim's checkpoint/berth.json inside the tar).
func kubeSelector(t *testing.T, ctx context.Context, c *node.KubeCluster, archive string) map[string]string {
	t.Helper()
	var v struct {
		NodeSelector map[string]string `json:"nodeSelector"`
	}
	out, err := exec.CommandContext(ctx, c.Berthctl(), "checkpoint", "selector", "-o", "json", archive).CombinedOutput()
	if err != nil {
		t.Fatalf("berthctl checkpoint selector %s: %v: %s", archive, err, out)
	}
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("berthctl checkpoint selector: %v: %s", err, out)
	}
	if len(v.NodeSelector) == 0 || v.NodeSelector["berth.dev/fingerprint"] == "" {
		t.Fatalf("selector without berth.dev/fingerprint: %v", v.NodeSelector)
	}
	return v.NodeSelector
}

// kubeInspectVerify runs `berthctl checkpoint inspect --verify` on the kubelet's archive in place
// with the configuration of node n (which trusts every node's key): the shim's signature and the
// CRIU images' digests, read from the tar.
func kubeInspectVerify(t *testing.T, ctx context.Context, c *node.KubeCluster, n *node.KubeNode, archive string) {
	t.Helper()
	out, err := exec.CommandContext(ctx, c.Berthctl(), "--config", n.ShimConfig(), "checkpoint", "inspect", "--verify", archive).CombinedOutput()
	if err != nil {
		t.Fatalf("berthctl checkpoint inspect --verify %s: %v\n%s", archive, err, out)
	}
	if !strings.Contains(string(out), "signed by") || !strings.Contains(string(out), "SHA256:") || !strings.Contains(string(out), "checkpoint/berth.json of a kubelet archive") {
		t.Errorf("inspect --verify of the kubelet archive:\n%s", out)
	}
	t.Logf("berthctl checkpoint inspect --verify %s (on %s):\n%s", filepath.Base(archive), n.Name, out)
}

// kubeTarNames lists the entries of a tar archive.
func kubeTarNames(t *testing.T, p string) []string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names
		}
		if err != nil {
			t.Fatalf("archive %s: %v", p, err)
		}
		names = append(names, strings.TrimPrefix(h.Name, "./"))
	}
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
