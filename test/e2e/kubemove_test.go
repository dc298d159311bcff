package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// kubeMoveResult is what `berthctl move -o json` prints.
type kubeMoveResult struct {
	Pod, Restored, From, To, Archive, Checkpoint string
	Bytes                                        int64
	Phases                                       []struct {
		Name string
		Ms   float64
	}
	TotalMs float64
}

// kubeMoveArgs are the flags that tell berthctl move where this machine sees each node's
// directories (the nodes run here), with {node} for the node's name.
func kubeMoveArgs(c *node.KubeCluster) []string {
	return []string{
		"--checkpoint-root", filepath.Join(c.Dir, "{node}", "checkpoints"),
		"--kubelet-checkpoints", filepath.Join(c.Dir, "{node}", "kubelet", "checkpoints"),
	}
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

// TestKubeMove moves a running inference pod to the other node with `kubectl berth move` (no
// node named: the one whose labels match its checkpoint), through the kubelet checkpoint API; the
// session continues with the tokens of an uninterrupted run. Before, a move that cannot finish
// (the restore pod's wait times out) leaves the source running and nothing on the destination,
// and a pod a controller owns is refused. After, `berthctl checkpoint gc` collects the archives.
func TestKubeMove(t *testing.T) {
	c := needKube(t)
	src, dst := c.Nodes[0], c.Nodes[1]
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	const ns = "berth-move"
	if _, err := c.Kubectl(ctx, "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = c.Kubectl(context.Background(), "delete", "namespace", ns, "--wait=false") })

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
		_, _ = c.Kubectl(ctx, "-n", ns, "delete", "pod", "owned", "--wait=false")
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
		args := append([]string{"move", "-n", ns, "mover", "--to", dst.Name, "--name", "mover-failed", "--timeout", "1ms"}, kubeMoveArgs(c)...)
		_, stderr, err := kubectlBerth(ctx, t, c, args...)
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

	args := append([]string{"move", "-n", ns, "mover", "-o", "json"}, kubeMoveArgs(c)...)
	out, stderr, err := kubectlBerth(ctx, t, c, args...)
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

	t.Run("gc", func(t *testing.T) {
		gc := func(n *node.KubeNode, args ...string) []map[string]any {
			out, err := exec.CommandContext(ctx, c.Berthctl(), append([]string{"checkpoint", "gc", "-o", "json",
				"--kubelet-dir", n.CheckpointDir, "--root", n.CheckpointRoot}, args...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("checkpoint gc on %s: %v\n%s", n.Name, err, out)
			}
			var v []map[string]any
			if err := json.Unmarshal(out, &v); err != nil {
				t.Fatalf("gc -o json: %v\n%s", err, out)
			}
			return v
		}
		count := func(dir string) int {
			es, _ := os.ReadDir(dir)
			return len(es)
		}
		// The kubelet wrote an archive of mover on kube1 for each move, but it names archives by
		// the second, so two checkpoints within one second leave one file. An older copy of the
		// move's archive (another name, an mtime a minute back) makes sure mover has two.
		es, err := os.ReadDir(src.CheckpointDir)
		if err != nil {
			t.Fatal(err)
		}
		var moverArchive string
		for _, e := range es {
			if strings.HasPrefix(e.Name(), "checkpoint-mover_") {
				moverArchive = filepath.Join(src.CheckpointDir, e.Name())
			}
		}
		if moverArchive == "" {
			t.Fatalf("no archive of mover in %s: %v", src.CheckpointDir, es)
		}
		b, err := os.ReadFile(moverArchive)
		if err != nil {
			t.Fatal(err)
		}
		older := filepath.Join(src.CheckpointDir, "checkpoint-mover_"+ns+"-infer-2000-01-01T00:00:00Z.tar")
		if err := os.WriteFile(older, b, 0o600); err != nil {
			t.Fatal(err)
		}
		then := time.Now().Add(-time.Minute)
		if err := os.Chtimes(older, then, then); err != nil {
			t.Fatal(err)
		}
		if n := count(src.CheckpointDir); n < 2 {
			t.Fatalf("%d archives in %s", n, src.CheckpointDir)
		}
		if gone := gc(src, "--keep", "2"); len(gone) != 0 {
			t.Errorf("gc --keep 2 (default min-age) removed %v", gone)
		}
		gone := gc(src, "--keep", "1", "--min-age", "0")
		for _, g := range gone {
			if !strings.Contains(g["container"].(string), "/mover/") && !strings.Contains(g["container"].(string), "/infer/") {
				t.Errorf("gc removed %v", g)
			}
		}
		if len(gone) == 0 {
			t.Error("gc --keep 1 removed nothing")
		}
		if _, err := os.Stat(older); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("gc --keep 1 kept mover's older archive %s: %v", older, err)
		}
		if _, err := os.Stat(moverArchive); err != nil {
			t.Errorf("gc --keep 1 removed mover's newest archive: %v", err)
		}
		t.Logf("gc --keep 1 on %s removed %d archives; %d left", src.Name, len(gone), count(src.CheckpointDir))
		gc(dst, "--max-bytes", "1", "--min-age", "0")
		if out, err := exec.CommandContext(ctx, c.Berthctl(), "checkpoint", "ls", "--kubelet-dir", src.CheckpointDir, "--root", dst.CheckpointRoot).CombinedOutput(); err != nil {
			t.Errorf("checkpoint ls: %v\n%s", err, out)
		} else {
			t.Logf("berthctl checkpoint ls:\n%s", out)
		}
	})
}
