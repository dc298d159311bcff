package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// kubeMoveResult is what `berthctl move -o json` prints.
type kubeMoveResult struct {
	Pod, Restored, From, To, Archive, Checkpoint string
	Bytes                                        int64
	Mode                                         string
	PageBytes                                    int64
	Phases                                       []struct {
		Name string
		Ms   float64
	}
	TotalMs float64
}

// kubectlBerth runs `kubectl berth ARGS` (berthctl as the kubectl plugin kubectl-berth, found on
// PATH) with the admin's kubeconfig in $KUBECONFIG, as a user's shell would.
func kubectlBerth(ctx context.Context, t *testing.T, c *node.KubeCluster, args ...string) (string, string, error) {
	t.Helper()
	plugins := t.TempDir()
	if err := os.Symlink(c.Berthctl(), filepath.Join(plugins, "kubectl-berth")); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, c.Kube.Tool("kubectl"), append([]string{"berth"}, args...)...)
	cmd.Env = append(os.Environ(), "PATH="+plugins+":"+os.Getenv("PATH"), "KUBECONFIG="+c.Kubeconfig)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

// assertRefusedMove runs pod (manifest; "" when it runs already) on its node and has `kubectl
// berth move --to` the other node refused by the preflight with stderr saying each of wants:
// nothing was checkpointed (no archive in the source kubelet's checkpoint directory), nothing
// stored in the destination's checkpoint root, no pod created, and the source's container the
// same one, running, with no restart.
func assertRefusedMove(ctx context.Context, t *testing.T, c *node.KubeCluster, ns, name, manifest string, wants ...string) {
	t.Helper()
	src, dst := c.Nodes[0], c.Nodes[1]
	var before *corev1.Pod
	if manifest != "" {
		before = kubeRunPod(t, ctx, c, ns, name, manifest)
	} else {
		before = kubeGetPod(t, ctx, c, ns, name)
	}
	list := func(dir string) []string {
		es, _ := os.ReadDir(dir)
		var names []string
		for _, e := range es {
			names = append(names, e.Name())
		}
		return names
	}
	archives, stored := list(src.CheckpointDir), list(dst.CheckpointRoot)
	pods, err := c.Kubectl(ctx, "-n", ns, "get", "pods", "-o", "name")
	if err != nil {
		t.Fatal(err)
	}
	_, stderr, err := kubectlBerth(ctx, t, c, "move", "-n", ns, name, "--to", dst.Name)
	t.Logf("refused move: %s", strings.TrimSpace(stderr))
	for _, want := range append([]string{"nothing was checkpointed"}, wants...) {
		if err == nil || !strings.Contains(stderr, want) {
			t.Errorf("move of %s to %s: %v; stderr lacks %q", name, dst.Name, err, want)
		}
	}
	after := kubeGetPod(t, ctx, c, ns, name)
	if after.Status.Phase != corev1.PodRunning || after.DeletionTimestamp != nil || len(after.Status.ContainerStatuses) != 1 ||
		after.Status.ContainerStatuses[0].ContainerID != before.Status.ContainerStatuses[0].ContainerID || after.Status.ContainerStatuses[0].RestartCount != 0 ||
		after.Status.ContainerStatuses[0].State.Running == nil {
		t.Errorf("source pod after the refusal: %s, containers %+v; before %+v", after.Status.Phase, after.Status.ContainerStatuses, before.Status.ContainerStatuses)
	}
	if now := list(src.CheckpointDir); strings.Join(now, " ") != strings.Join(archives, " ") {
		t.Errorf("the kubelet's checkpoint directory on %s after the refusal: %v, before %v (the source was checkpointed)", src.Name, now, archives)
	}
	if now := list(dst.CheckpointRoot); strings.Join(now, " ") != strings.Join(stored, " ") {
		t.Errorf("%s's checkpoint root after the refusal: %v, before %v", dst.Name, now, stored)
	}
	// no pod made (a pod of an earlier subtest may have gone meanwhile)
	now, err := c.Kubectl(ctx, "-n", ns, "get", "pods", "-o", "name")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range strings.Fields(now) {
		if !slices.Contains(strings.Fields(pods), p) {
			t.Errorf("pods after the refusal: %q, before %q: %s was made", now, pods, p)
		}
	}
}

// TestKubeMove moves a running inference pod to the other node with `kubectl berth move` (no
// node named: the one whose labels match its checkpoint), through the kubelet checkpoint API, in
// copy mode, the default (the pages stream to the destination's agent, which runs CRIU's page
// server with CAP_CHECKPOINT_RESTORE only; the kubelet's archive holds no page image); the
// session continues with the tokens of an uninterrupted run. A ReplicaSet's pod moves in stored
// mode; a copy-mode move whose destination agent is killed mid page stream leaves the source
// running and nothing on the destination. Before, a move that cannot finish
// (the restore pod's wait times out) leaves the source running and nothing on the destination,
// a pod a controller owns is refused, and the preflight refuses, before anything is
// checkpointed, a destination without the image, without a hostPath source (the nodes' berth
// probes) or with the host PIDs of a hostPID pod in use. After, `berthctl checkpoint gc` collects the archives.
func TestKubeMove(t *testing.T) {
	c := needKube(t)
	src, dst := c.Nodes[0], c.Nodes[1]
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	const ns = "berth-move"
	if _, err := c.Kubectl(ctx, "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = c.Kubectl(context.Background(), "delete", "namespace", ns, "--wait=false") })

	t.Run("the probe's uid is its own", func(t *testing.T) {
		// issue 19: a workload running as the probe's uid shares it with whoever execs into the
		// probe (same-uid processes read each other's environment); the chart's admission
		// policy refuses such a pod outside berth-system, in the pod's or a container's context
		pod := func(name, podCtx, ctrCtx string) string {
			return `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"` + name + `"},"spec":{` + podCtx +
				`"containers":[{"name":"c","image":"localhost/x:1"` + ctrCtx + `}]}}`
		}
		for _, tc := range []struct{ name, podCtx, ctrCtx string }{
			{"probe-uid-pod", `"securityContext":{"runAsUser":64535},`, ""},
			{"probe-uid-ctr", "", `,"securityContext":{"runAsUser":64535}`},
		} {
			var out string
			var err error
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
				// a policy takes effect once the API server's admission has loaded it
				out, err = c.KubectlIn(ctx, strings.NewReader(pod(tc.name, tc.podCtx, tc.ctrCtx)), "-n", ns, "create", "--dry-run=server", "-f", "-")
				if err != nil || time.Now().After(deadline) {
					break
				}
			}
			if err == nil || !strings.Contains(err.Error(), "uid 64535 is the berth probe's") {
				t.Errorf("%s in namespace %s: %q, %v; want the admission policy's refusal", tc.name, ns, out, err)
			}
		}
		if out, err := c.KubectlIn(ctx, strings.NewReader(pod("other-uid", `"securityContext":{"runAsUser":1000},`, "")), "-n", ns, "create", "--dry-run=server", "-f", "-"); err != nil {
			t.Errorf("a pod of another uid: %q, %v", out, err)
		}
	})

	t.Run("agent holds no signing key", func(t *testing.T) {
		// the agents' /etc/berth holds node.key, which shim.toml names as signing_key: the agent
		// runs without it (its receiver never signs), and it is not in the agent's container
		pod, err := c.Kubectl(ctx, "-n", "berth-system", "get", "pods", "-l", "app.kubernetes.io/name=berth-agent", "-o", "jsonpath={.items[0].metadata.name}")
		if err != nil {
			t.Fatal(err)
		}
		inspect := func(p string) string {
			out, err := c.Kubectl(ctx, "-n", "berth-system", "exec", pod, "-c", "agent", "--", "/usr/local/bin/berthctl", "checkpoint", "inspect", p)
			return fmt.Sprint(out, err) // berthctl's error is in kubectl's stderr, which err carries
		}
		if out := inspect("/etc/berth/" + node.AgentNodeKey); !strings.Contains(out, "no such file or directory") {
			t.Errorf("the node's private key in agent %s: inspect %s: %q, want no such file", pod, node.AgentNodeKey, out)
		}
		if out := inspect("/etc/berth/shim.toml"); strings.Contains(out, "no such file or directory") {
			t.Errorf("agent %s has no /etc/berth/shim.toml: %q", pod, out)
		}
	})

	t.Run("owned pod refused", func(t *testing.T) {
		if _, err := c.Kubectl(ctx, "-n", ns, "create", "configmap", "owner"); err != nil {
			t.Fatal(err)
		}
		uid, err := c.Kubectl(ctx, "-n", ns, "get", "configmap", "owner", "-o", "jsonpath={.metadata.uid}")
		if err != nil {
			t.Fatal(err)
		}
		pod := strings.Replace(kubePodYAML("owned", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}),
			"  labels: {app: infer}\n", fmt.Sprintf("  labels: {app: infer}\n  ownerReferences:\n  - {apiVersion: v1, kind: ConfigMap, name: owner, uid: %q, controller: true}\n", uid), 1)
		kubeRunPod(t, ctx, c, ns, "owned", pod)
		_, stderr, err := kubectlBerth(ctx, t, c, "move", "-n", ns, "owned")
		if err == nil || !strings.Contains(stderr, "owned by a controller") || !strings.Contains(stderr, "ConfigMap owner") {
			t.Errorf("move of an owned pod: %v\n%s", err, stderr)
		}
		if p := kubeGetPod(t, ctx, c, ns, "owned"); p.Status.Phase != corev1.PodRunning {
			t.Errorf("owned pod %s after the refused move", p.Status.Phase)
		}
		// gone before the next subtest lists the namespace's pods
		if _, err := c.Kubectl(ctx, "-n", ns, "delete", "pod", "owned", "--grace-period=1", "--timeout=60s"); err != nil {
			t.Errorf("delete the owned pod: %v", err)
		}
	})

	t.Run("preflight refuses a destination without the image", func(t *testing.T) {
		// an image only the source node has (a tag of the workload's, imagePullPolicy Never):
		// the destination's status.images lacks it, and its kubelet would not pull it
		const only = "localhost/berth/workload:preflight-src-only"
		if _, err := src.Ctr(ctx, "-n", "k8s.io", "images", "tag", "--force", image.WorkloadRef, only); err != nil {
			t.Fatal(err)
		}
		pod := strings.Replace(kubePodYAML("pfimg", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}), "image: "+image.WorkloadRef, "image: "+only, 1)
		defer func() { _, _ = c.Kubectl(context.Background(), "-n", ns, "delete", "pod", "pfimg", "--wait=false") }()
		agentLog := func() string {
			out, _ := c.Kubectl(ctx, "-n", "berth-system", "logs", "-l", "app.kubernetes.io/name=berth-agent", "-c", "agent", "--tail=-1")
			return strconv.Itoa(strings.Count(out, "answered a preflight query"))
		}
		answered := agentLog()
		assertRefusedMove(ctx, t, c, ns, "pfimg", pod, "node "+dst.Name+" status.images is without "+only, "needs "+only, "ErrImageNeverPull")
		// the destination's agent answered its part (free disk under its checkpoint root)
		if now := agentLog(); now == answered {
			t.Errorf("no preflight query answered by the agents (%s before and after)", now)
		}
	})

	// What only the nodes' hosts can tell, asked of their berth probes (berth-probe-daemonset.yaml):
	// a hostPath present on the source node and missing on the destination. Each node's /var/log
	// is its own directory (kubenode.go), so the path exists on the source only.
	t.Run("preflight refuses a destination without a hostPath source", func(t *testing.T) {
		const hostDir = "/var/log/berth-pf-models"
		if err := os.MkdirAll(filepath.Join(c.Dir, src.Name, "varlog", filepath.Base(hostDir)), 0o755); err != nil {
			t.Fatal(err)
		}
		pod := kubePodYAML("pfbind", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}) +
			"    volumeMounts: [{name: models, mountPath: /models, readOnly: true}]\n" +
			"  volumes: [{name: models, hostPath: {path: " + hostDir + ", type: Directory}}]\n"
		defer func() { _, _ = c.Kubectl(context.Background(), "-n", ns, "delete", "pod", "pfbind", "--wait=false") }()
		assertRefusedMove(ctx, t, c, ns, "pfbind", pod,
			"node "+dst.Name+" volumes[models].hostPath.path (mounted at /models) is "+hostDir+" (missing)", "needs an existing path")
	})

	// hostPID: the container's PIDs must be free in the destination's PID namespace. This
	// machine's nodes share its PID namespace, so they never are: the probe says which.
	t.Run("preflight refuses host PIDs in use on the destination", func(t *testing.T) {
		pod := strings.Replace(kubePodYAML("pfpid", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}),
			"  runtimeClassName: berth\n", "  runtimeClassName: berth\n  hostPID: true\n", 1)
		defer func() { _, _ = c.Kubectl(context.Background(), "-n", ns, "delete", "pod", "pfpid", "--wait=false") }()
		_, id := kubeContainer(t, c, kubeRunPod(t, ctx, c, ns, "pfpid", pod))
		ins, err := src.Inspect(ctx, id)
		if err != nil || ins.PID == 0 {
			t.Fatalf("crictl inspect %s: pid %d, %v", id, ins.PID, err)
		}
		pid := ins.PID
		assertRefusedMove(ctx, t, c, ns, "pfpid", "",
			fmt.Sprintf("node %s PID %d is in use in the host's PID namespace, needs free", dst.Name, pid))
	})

	t.Run("ReplicaSet adopts the restored pod", func(t *testing.T) {
		pod := kubePodYAML("x", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name})
		spec := strings.Replace(pod[strings.Index(pod, "spec:\n")+len("spec:\n"):], "restartPolicy: Never", "restartPolicy: Always", 1)
		rs := fmt.Sprintf("apiVersion: apps/v1\nkind: ReplicaSet\nmetadata: {name: rsinfer, namespace: %s}\nspec:\n  replicas: 1\n"+
			"  selector: {matchLabels: {app: rsinfer}}\n  template:\n    metadata: {labels: {app: rsinfer}}\n    spec:\n", ns)
		for _, l := range strings.Split(strings.TrimRight(spec, "\n"), "\n") {
			rs += "    " + l + "\n"
		}
		if _, err := c.KubectlIn(ctx, strings.NewReader(rs), "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
		defer func() {
			_, _ = c.Kubectl(context.Background(), "-n", ns, "delete", "replicaset", "rsinfer", "--wait=false")
		}()
		if _, err := c.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", "app=rsinfer", "--timeout=120s"); err != nil {
			t.Fatal(err)
		}
		name, err := c.Kubectl(ctx, "-n", ns, "get", "pod", "-l", "app=rsinfer", "-o", "jsonpath={.items[0].metadata.name}")
		if err != nil {
			t.Fatal(err)
		}
		// every pod the ReplicaSet's selector ever selects during the move
		wctx, stop := context.WithCancel(ctx)
		watch := exec.CommandContext(wctx, c.Kube.Tool("kubectl"), "--kubeconfig", c.Kubeconfig, "-n", ns, "get", "pods", "-l", "app=rsinfer", "--watch", "-o", "name")
		var seen strings.Builder
		watch.Stdout = &seen
		if err := watch.Start(); err != nil {
			t.Fatal(err)
		}
		// stored mode: the kubelet's archive carries the pages, sent whole
		out, stderr, err := kubectlBerth(ctx, t, c, "move", "-n", ns, name, "--to", dst.Name, "--mode", "stored", "-o", "json")
		if err != nil {
			stop()
			_ = watch.Wait()
			t.Fatalf("move of a ReplicaSet's pod: %v\n%s%s", err, out, stderr)
		}
		var res kubeMoveResult
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatal(err)
		}
		if res.Mode != "stored" || res.PageBytes != 0 {
			t.Errorf("--mode stored move in mode %q with %d bytes of page stream", res.Mode, res.PageBytes)
		}
		if !slices.ContainsFunc(kubeTarNames(t, filepath.Join(src.CheckpointDir, filepath.Base(res.Archive))), func(n string) bool {
			return strings.HasPrefix(path.Base(n), "pages-")
		}) {
			t.Errorf("stored-mode archive %s holds no page image", res.Archive)
		}
		time.Sleep(3 * time.Second) // room for a ReplicaSet that would scale up or delete
		stop()
		_ = watch.Wait()
		names := map[string]bool{}
		for _, n := range strings.Fields(seen.String()) {
			names[strings.TrimPrefix(n, "pod/")] = true
		}
		if len(names) != 2 || !names[name] || !names[res.Restored] {
			t.Errorf("pods the ReplicaSet selected during the move: %v; want only %s and %s (no fresh replica)", names, name, res.Restored)
		}
		left, err := c.Kubectl(ctx, "-n", ns, "get", "pods", "-l", "app=rsinfer", "-o", `jsonpath={range .items[*]}{.metadata.name} {.metadata.ownerReferences[0].name} {.spec.nodeName} {.metadata.deletionTimestamp}{"\n"}{end}`)
		if err != nil {
			t.Fatal(err)
		}
		lines := []string{}
		for _, l := range strings.Split(strings.TrimSpace(left), "\n") {
			if f := strings.Fields(l); len(f) == 3 { // not being deleted
				lines = append(lines, l)
			}
		}
		if want := res.Restored + " rsinfer " + dst.Name; len(lines) != 1 || lines[0] != want {
			t.Errorf("pods of the ReplicaSet after the move: %q; want %q", left, want)
		}
		t.Logf("moved ReplicaSet pod %s -> %s on %s (phases %v)", name, res.Restored, dst.Name, res.Phases)
	})

	// before the mover: kube1's CPUs hold one such pod at a time
	t.Run("copy mode: destination agent killed mid page stream leaves the source", func(t *testing.T) {
		kubeMoveAgentKilled(t, ctx, c, ns)
	})

	srcPod := kubeRunPod(t, ctx, c, ns, "mover", kubePodYAML("mover", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}))
	st := client.Target{BaseURL: srcPod.Status.PodIP + ":8080"}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	const prompt = "kubectl berth move"
	first, err := client.Stream(ctx, st, client.Request{Session: "move", Prompt: prompt, N: 30})
	if err != nil {
		t.Fatal(err)
	}
	before, err := client.Stats(ctx, st)
	if err != nil {
		t.Fatal(err)
	}

	t.Run("failed move leaves the source", func(t *testing.T) {
		entries := func() []string {
			es, _ := os.ReadDir(dst.CheckpointRoot)
			var names []string
			for _, e := range es {
				names = append(names, e.Name())
			}
			return names
		}
		had := entries()
		_, stderr, err := kubectlBerth(ctx, t, c, "move", "-n", ns, "mover", "--to", dst.Name, "--name", "mover-failed", "--timeout", "1ms")
		if err == nil || !strings.Contains(stderr, "not Ready") {
			t.Fatalf("move with a 1ms wait: %v\n%s", err, stderr)
		}
		t.Logf("failed move: %s", strings.TrimSpace(stderr))
		if p := kubeGetPod(t, ctx, c, ns, "mover"); p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
			t.Errorf("source pod %s (deleting %v) after the failed move", p.Status.Phase, p.DeletionTimestamp)
		}
		if _, err := c.Kubectl(ctx, "-n", ns, "wait", "--for=delete", "pod/mover-failed", "--timeout=60s"); err != nil {
			t.Errorf("restore pod of the failed move still there: %v", err)
		}
		if now := entries(); len(now) != len(had) {
			t.Errorf("%s's checkpoint root after the failed move: %v, before %v", dst.Name, now, had)
		}
		if _, err := client.Stats(ctx, st); err != nil {
			t.Errorf("source workload after the failed move: %v", err)
		}
	})

	out, stderr, err := kubectlBerth(ctx, t, c, "move", "-n", ns, "mover", "-o", "json")
	if err != nil {
		t.Fatalf("kubectl berth move: %v\n%s%s", err, out, stderr)
	}
	var res kubeMoveResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("move -o json: %v\n%s", err, out)
	}
	if res.From != src.Name || res.To != dst.Name {
		t.Errorf("moved %s -> %s, want %s -> %s (the only other node whose labels match)", res.From, res.To, src.Name, dst.Name)
	}
	var b strings.Builder
	for _, p := range res.Phases {
		fmt.Fprintf(&b, "  %-32s %9.1f ms\n", p.Name, p.Ms)
	}
	t.Logf("kubectl berth move %s/%s %s -> %s as %s, archive %.1f MiB:\n%s  %-32s %9.1f ms", ns, res.Pod, res.From, res.To, res.Restored,
		float64(res.Bytes)/(1<<20), b.String(), "total", res.TotalMs)
	if _, err := c.Kubectl(ctx, "-n", ns, "get", "pod", "mover"); err == nil {
		if _, err := c.Kubectl(ctx, "-n", ns, "wait", "--for=delete", "pod/mover", "--timeout=60s"); err != nil {
			t.Errorf("source pod not deleted: %v", err)
		}
	}
	// the agents carried it: the destination's agent stored the archive as a directory (a
	// shared file system would have copied the .tar), its CRIU images and signature verified
	if fi, err := os.Stat(filepath.Join(dst.CheckpointRoot, res.Checkpoint, "checkpoint", "berth.json")); err != nil || strings.HasSuffix(res.Checkpoint, ".tar") {
		t.Errorf("checkpoint %s on %s: not the directory the agent stores (%v, %v)", res.Checkpoint, dst.Name, fi, err)
	}
	if res.Bytes <= 0 {
		t.Errorf("move reports %d bytes sent", res.Bytes)
	}
	// copy mode, the default with the agents: the pages went beside the archive, not in it
	if res.Mode != "copy" || res.PageBytes < 16<<20 {
		t.Errorf("move in mode %q with %d bytes of page stream; want the default, copy, with the 16 MiB of weights at least", res.Mode, res.PageBytes)
	}
	for _, n := range kubeTarNames(t, filepath.Join(src.CheckpointDir, filepath.Base(res.Archive))) {
		if strings.HasPrefix(path.Base(n), "pages-") {
			t.Errorf("the kubelet's archive %s holds page image %s in copy mode", res.Archive, n)
		}
	}
	if got, _ := filepath.Glob(filepath.Join(dst.CheckpointRoot, res.Checkpoint, "checkpoint", "pages-*.img")); len(got) == 0 {
		t.Errorf("no page images in %s on %s: the streamed pages were not adopted", res.Checkpoint, dst.Name)
	}
	rp := kubeGetPod(t, ctx, c, ns, res.Restored)
	if rp.Spec.NodeName != dst.Name || rp.Labels["app"] != "infer" {
		t.Errorf("restore pod on %s with labels %v", rp.Spec.NodeName, rp.Labels)
	}
	rt := client.Target{BaseURL: rp.Status.PodIP + ":8080"}
	rest, err := client.Stream(ctx, rt, client.Request{Session: "move", N: 60, From: 30})
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
	if after, err := client.Stats(ctx, rt); err != nil || after.Prefills != before.Prefills {
		t.Errorf("restored workload: prefills %+v (err %v), the source had %d", after, err, before.Prefills)
	}

	t.Run("gc DaemonSet", func(t *testing.T) {
		// The agent DaemonSet's collector runs on every node with the policy it ships with
		// (--keep=2 --max-bytes=20GiB --min-age=15m; every node.AgentGCInterval here). Give it
		// work: on the source node two older copies of mover's archive (the oldest is beyond the
		// newest 2); on the destination an older copy of the checkpoint in its root, 21 GiB long
		// (sparse), which puts the node over the byte budget while the restored checkpoint is
		// the newest of its container and must stay.
		es, err := os.ReadDir(src.CheckpointDir)
		if err != nil {
			t.Fatal(err)
		}
		var moverArchive string
		young := map[string]bool{}
		for _, e := range es {
			if strings.HasPrefix(e.Name(), "checkpoint-mover_") {
				moverArchive = filepath.Join(src.CheckpointDir, e.Name())
			}
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) < 10*time.Minute {
				young[filepath.Join(src.CheckpointDir, e.Name())] = true
			}
		}
		if moverArchive == "" {
			t.Fatalf("no archive of mover in %s: %v", src.CheckpointDir, es)
		}
		b, err := os.ReadFile(moverArchive)
		if err != nil {
			t.Fatal(err)
		}
		place := func(p string, age time.Duration, size int64) {
			t.Helper()
			if err := os.WriteFile(p, b, 0o600); err != nil {
				t.Fatal(err)
			}
			if size > 0 {
				if err := os.Truncate(p, size); err != nil {
					t.Fatal(err)
				}
			}
			then := time.Now().Add(-age)
			if err := os.Chtimes(p, then, then); err != nil {
				t.Fatal(err)
			}
		}
		oldest := filepath.Join(src.CheckpointDir, "checkpoint-mover_"+ns+"-infer-2000-01-01T00:00:00Z.tar")
		older := filepath.Join(src.CheckpointDir, "checkpoint-mover_"+ns+"-infer-2000-01-02T00:00:00Z.tar")
		place(oldest, 2*time.Hour, 0)
		place(older, time.Hour, 0)
		big := filepath.Join(dst.CheckpointRoot, ns+"-mover-old.tar")
		place(big, time.Hour, 21<<30)
		restored := filepath.Join(dst.CheckpointRoot, res.Checkpoint)

		exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
		deadline := time.Now().Add(30*node.AgentGCInterval + 30*time.Second)
		for (exists(oldest) || exists(big)) && time.Now().Before(deadline) {
			time.Sleep(node.AgentGCInterval / 2)
		}
		if exists(oldest) {
			t.Errorf("the collector kept %s, the third of mover's archives (--keep=2)", filepath.Base(oldest))
		}
		if exists(big) {
			t.Errorf("the collector kept %s: 21 GiB over --max-bytes=20GiB", filepath.Base(big))
		}
		if !exists(restored) {
			t.Errorf("the collector removed %s, the newest checkpoint of its container", restored)
		}
		for p := range young {
			if !exists(p) {
				t.Errorf("the collector removed %s, younger than --min-age=15m", filepath.Base(p))
			}
		}
		logs, _ := c.Kubectl(ctx, "-n", "berth-system", "logs", "-l", "app.kubernetes.io/name=berth-agent", "-c", "gc", "--tail=20", "--prefix")
		t.Logf("collector logs:\n%s", logs)
		_ = os.Remove(older)
	})
}

// kubeMoveAgentKilled moves a pod in copy mode (the default) and kills (SIGKILL) the
// destination node's agent once 4 MiB of its pages arrived there: the page stream breaks, CRIU's
// dump fails and the kubelet's checkpoint with it. The move fails; the source pod runs on (same
// container, no restart, still serving), no archive is left on the source, no restore pod is
// made, nothing is left armed on the source node, and once the agent runs again nothing of the
// stream is left in the destination's checkpoint root.
func kubeMoveAgentKilled(t *testing.T, ctx context.Context, c *node.KubeCluster, ns string) {
	src, dst := c.Nodes[0], c.Nodes[1]
	before := kubeRunPod(t, ctx, c, ns, "bigmover", kubePodYAML("bigmover", ns, nil, map[string]string{"kubernetes.io/hostname": src.Name}))
	defer func() { _, _ = c.Kubectl(context.Background(), "-n", ns, "delete", "pod", "bigmover", "--timeout=60s") }()
	st := client.Target{BaseURL: before.Status.PodIP + ":8080"}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	list := func(dir string) string {
		es, _ := os.ReadDir(dir)
		var names []string
		for _, e := range es {
			names = append(names, e.Name())
		}
		return strings.Join(names, " ")
	}
	stored, archives := list(dst.CheckpointRoot), list(src.CheckpointDir)
	agent := agentReceiverPID(t, dst.CheckpointRoot)
	mctx, stop := context.WithCancel(ctx)
	killed := make(chan int64, 1)
	go func() {
		var n int64
		for mctx.Err() == nil {
			if n = pagesReceived(dst.CheckpointRoot); n >= 4<<20 {
				_ = syscall.Kill(agent, syscall.SIGKILL)
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
		killed <- n
	}()
	out, stderr, err := kubectlBerth(mctx, t, c, "move", "-n", ns, "bigmover", "--to", dst.Name)
	stop()
	if n := <-killed; n < 4<<20 {
		t.Fatalf("the destination agent was not killed mid page stream (%d bytes of pages seen); move: %v\n%s%s", n, err, out, stderr)
	}
	t.Logf("copy-mode move with the destination agent killed mid page stream: %v\n%s", err, strings.TrimSpace(stderr))
	if err == nil {
		t.Errorf("copy-mode move whose destination agent was killed mid page stream succeeded\n%s", out)
	}
	after := kubeGetPod(t, ctx, c, ns, "bigmover")
	if after.Status.Phase != corev1.PodRunning || after.DeletionTimestamp != nil || len(after.Status.ContainerStatuses) != 1 ||
		after.Status.ContainerStatuses[0].ContainerID != before.Status.ContainerStatuses[0].ContainerID || after.Status.ContainerStatuses[0].RestartCount != 0 ||
		after.Status.ContainerStatuses[0].State.Running == nil {
		t.Errorf("source pod after the failed move: %s, containers %+v; before %+v", after.Status.Phase, after.Status.ContainerStatuses, before.Status.ContainerStatuses)
	}
	if _, err := client.Stats(ctx, st); err != nil {
		t.Errorf("source workload after the failed move: %v", err)
	}
	if pods, err := c.Kubectl(ctx, "-n", ns, "get", "pods", "-o", "name"); err != nil || strings.Contains(pods, "bigmover-m") {
		t.Errorf("pods after the failed move: %q (%v): a restore pod was made", pods, err)
	}
	if now := list(src.CheckpointDir); now != archives {
		t.Errorf("the kubelet's checkpoint directory on %s after the failed move: %q, before %q", src.Name, now, archives)
	}
	// the agent runs again (the kubelet restarts its container) before what it left is judged
	if pid := agentReceiverPID(t, dst.CheckpointRoot); pid == agent {
		t.Errorf("the destination agent %d still runs after SIGKILL", pid)
	}
	deadline := time.Now().Add(30 * time.Second)
	for list(dst.CheckpointRoot) != stored && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if now := list(dst.CheckpointRoot); now != stored {
		t.Errorf("%s's checkpoint root after the failed move: %q, before %q", dst.Name, now, stored)
	}
	srcArm := filepath.Join("/proc", strconv.Itoa(agentReceiverPID(t, src.CheckpointRoot)), "root", "run", "berth", "page-streams")
	deadline = time.Now().Add(15 * time.Second)
	for list(srcArm) != "" && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	if now := list(srcArm); now != "" {
		t.Errorf("armed page streams left on %s: %s", src.Name, now)
	}
	// the destination's agent answers execs again before the next move's preflight
	if _, err := c.Kubectl(ctx, "-n", "berth-system", "wait", "--for=condition=Ready", "pod", "-l", "app.kubernetes.io/name=berth-agent", "--timeout=120s"); err != nil {
		t.Fatalf("agents not Ready again: %v", err)
	}
}

// agentReceiverPID returns the pid of the berth agent's `berthctl receive` whose checkpoint
// root is root (a node's CheckpointRoot on this machine), found in /proc. The agent restarts
// when it is killed, so the pid is looked up anew each time.
func agentReceiverPID(t *testing.T, root string) int {
	t.Helper()
	want, err := os.Stat(root)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		procs, _ := os.ReadDir("/proc")
		for _, p := range procs {
			pid, err := strconv.Atoi(p.Name())
			if err != nil {
				continue
			}
			cmd, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
			if err != nil || !strings.HasPrefix(string(cmd), "/usr/local/bin/berthctl\x00receive\x00") {
				continue
			}
			if fi, err := os.Stat(filepath.Join("/proc", p.Name(), "root", "var", "lib", "berth", "checkpoints")); err == nil && os.SameFile(fi, want) {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no berth agent receiver with checkpoint root %s", root)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
