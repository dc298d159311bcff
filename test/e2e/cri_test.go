package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// criPod runs a pod sandbox with the berth runtime handler on n and returns its id.
func criPod(t *testing.T, ctx context.Context, n *node.Node, dir, name, ns string) string {
	t.Helper()
	cfg := fmt.Sprintf(`{"metadata": {"name": %q, "namespace": %q, "uid": "%s-uid", "attempt": 0}, "log_directory": %q, "linux": {}}`,
		name, ns, name, filepath.Join(dir, name+"-logs"))
	p := filepath.Join(dir, name+".json")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	id, err := n.Crictl(ctx, "runp", "--runtime", "berth", p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		bg := context.Background()
		_, _ = n.Crictl(bg, "stopp", id)
		_, _ = n.Crictl(bg, "rmp", "-f", id)
	})
	return id
}

// criContainer creates (not starts) the workload container in pod and returns its id.
func criContainer(t *testing.T, ctx context.Context, n *node.Node, dir, pod, podName string, annotations map[string]string) string {
	t.Helper()
	ann, _ := json.Marshal(annotations)
	cfg := fmt.Sprintf(`{"metadata": {"name": "infer"}, "image": {"image": %q},
 "command": [%q, "-listen", "127.0.0.1:8080", "-weights-mib", "16", "-delay-ms", "0"],
 "annotations": %s, "log_path": "infer.log",
 "linux": {"security_context": {"namespace_options": {"pid": 1}}}}`, image.WorkloadRef, image.WorkloadBinary, ann)
	p := filepath.Join(dir, podName+"-ctr.json")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	id, err := n.Crictl(ctx, "create", pod, p, filepath.Join(dir, podName+".json"))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func criPID(t *testing.T, ctx context.Context, n *node.Node, id string) int {
	t.Helper()
	out, err := n.Crictl(ctx, "inspect", id)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Info struct {
			Pid int `json:"pid"`
		} `json:"info"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil || v.Info.Pid == 0 {
		t.Fatalf("crictl inspect %s: pid %d, %v", id, v.Info.Pid, err)
	}
	return v.Info.Pid
}

// TestCRICheckpointRestore is the kubelet's path: CRI CheckpointContainer (crictl checkpoint
// --export, what POST /checkpoint/{ns}/{pod}/{container} calls) on a container of the berth
// runtime handler, then, on the other node, an ordinary pod with the berth handler whose container
// carries berth.dev/restore-from: it comes up restored, CRI manages it as usual (ps, logs, exec,
// stop, rm), and its session continues. A checkpoint from another Kubernetes namespace and a
// tampered archive are refused.
func TestCRICheckpointRestore(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		if err := n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]); err != nil {
			t.Fatal(err)
		}
	}
	dir := t.TempDir()

	pod1 := criPod(t, ctx, src, dir, "cri-src", "default")
	cid := criContainer(t, ctx, src, dir, pod1, "cri-src", nil)
	if _, err := src.Crictl(ctx, "start", cid); err != nil {
		t.Fatal(err)
	}
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, src, cid))}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	first, err := client.Stream(ctx, st, client.Request{Session: "k", Prompt: "kubelet", N: 30})
	if err != nil {
		t.Fatal(err)
	}

	archive := filepath.Join(dst.CheckpointRoot, "cri-ck.tar")
	if _, err := src.Crictl(ctx, "checkpoint", "--export="+archive, cid); err != nil {
		t.Fatalf("crictl checkpoint: %v", err)
	}
	// the kubelet keeps the container running after a checkpoint
	if out, err := src.Crictl(ctx, "inspect", "-o", "go-template", "--template", "{{.status.state}}", cid); err != nil || out != "CONTAINER_RUNNING" {
		t.Errorf("source after CRI checkpoint: %q %v", out, err)
	}
	if out, err := src.Crictl(ctx, "stop", "-t", "0", cid); err != nil {
		t.Fatalf("stop source: %v %s", err, out)
	}

	t.Run("restore", func(t *testing.T) {
		pod2 := criPod(t, ctx, dst, dir, "cri-dst", "default")
		rid := criContainer(t, ctx, dst, dir, pod2, "cri-dst", map[string]string{"berth.dev/restore-from": "cri-ck.tar"})
		if out, err := dst.Crictl(ctx, "start", rid); err != nil {
			t.Fatalf("start restored container: %v %s", err, out)
		}
		ps, err := dst.Crictl(ctx, "ps", "-q", "--state", "running")
		if err != nil || !strings.Contains(ps, rid) {
			t.Errorf("crictl ps does not list %s as running: %q %v", rid, ps, err)
		}
		rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, dst, rid))}
		rest, err := client.Stream(ctx, rt, client.Request{Session: "k", N: 60, From: 30})
		if err != nil {
			t.Fatal(err)
		}
		ref, err := model.Reference(model.Config{WeightsMiB: 16, Seed: 1}, "kubelet", 60)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := strings.Join(append(first, rest...), " "), strings.Join(model.Words(ref), " "); got != want {
			t.Errorf("session across the CRI move:\n got %s\nwant %s", got, want)
		}
		if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
			t.Errorf("restored container counts %d prefills (%v), want 1", s.Prefills, err)
		}
		if out, err := dst.Crictl(ctx, "exec", rid, "cat", "/proc/1/cmdline"); err != nil || !strings.Contains(out, "infer") {
			t.Errorf("crictl exec in the restored container: %q %v", out, err)
		}
		if _, err := dst.Crictl(ctx, "logs", rid); err != nil {
			t.Errorf("crictl logs: %v", err)
		}
		if _, err := dst.Crictl(ctx, "stop", "-t", "0", rid); err != nil {
			t.Errorf("crictl stop: %v", err)
		}
		if _, err := dst.Crictl(ctx, "rm", rid); err != nil {
			t.Errorf("crictl rm: %v", err)
		}
	})

	t.Run("other namespace refused", func(t *testing.T) {
		pod3 := criPod(t, ctx, dst, dir, "cri-other", "other")
		rid := criContainer(t, ctx, dst, dir, pod3, "cri-other", map[string]string{"berth.dev/restore-from": "cri-ck.tar"})
		_, err := dst.Crictl(ctx, "start", rid)
		if err == nil || !strings.Contains(err.Error(), "may not be restored into namespace") || !strings.Contains(err.Error(), "default") || !strings.Contains(err.Error(), "other") {
			t.Fatalf("restore into another namespace: %v; want a refusal naming both namespaces", err)
		}
		_, _ = dst.Crictl(ctx, "rm", "-f", rid)
	})

	t.Run("tampered archive refused", func(t *testing.T) {
		tampered := filepath.Join(dst.CheckpointRoot, "cri-tampered.tar")
		b, err := os.ReadFile(archive)
		if err != nil {
			t.Fatal(err)
		}
		// flip a byte inside checkpoint/pages-1.img's content (past its tar header)
		i := strings.Index(string(b), "checkpoint/pages-1.img")
		if i < 0 {
			t.Fatal("no pages-1.img in the archive")
		}
		b[i+512+4096] ^= 0xff
		if err := os.WriteFile(tampered, b, 0o600); err != nil {
			t.Fatal(err)
		}
		pod4 := criPod(t, ctx, dst, dir, "cri-tamper", "default")
		rid := criContainer(t, ctx, dst, dir, pod4, "cri-tamper", map[string]string{"berth.dev/restore-from": "cri-tampered.tar"})
		_, err = dst.Crictl(ctx, "start", rid)
		if err == nil || !strings.Contains(err.Error(), "digest mismatch") {
			t.Fatalf("restore of a tampered archive: %v; want a digest mismatch", err)
		}
		_, _ = dst.Crictl(ctx, "rm", "-f", rid)
		if left, _ := filepath.Glob(filepath.Join(dst.CheckpointRoot, ".restore-*")); len(left) > 0 {
			t.Errorf("extraction left behind: %v", left)
		}
	})
}
