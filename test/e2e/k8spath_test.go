package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// k8sGPUContainer creates (not starts) the inference workload in GPU mode in pod, on n's fake GPU
// uuid as a device plugin would hand it out (bind mount at /dev/berth-gpu/0 and
// BERTH_FAKE_GPUS), with one exclusive CPU (limit == request == 1 CPU) for berth-nri to pin.
func k8sGPUContainer(t *testing.T, ctx context.Context, n *node.Node, dir, pod, podName, uuid string, annotations map[string]string) string {
	t.Helper()
	gpuDir, err := n.GPU.Dir(uuid)
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{
		"metadata":    map[string]any{"name": "infer"},
		"image":       map[string]any{"image": image.WorkloadRef},
		"command":     []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "16", "-delay-ms", "0", "-gpu"},
		"envs":        []map[string]string{{"key": fake.EnvGPUs, "value": uuid}},
		"mounts":      []map[string]any{{"container_path": fake.ContainerDevicePath(0), "host_path": gpuDir}},
		"annotations": annotations,
		"log_path":    "infer.log",
		"linux": map[string]any{
			"resources":        map[string]any{"cpu_period": 100000, "cpu_quota": 100000, "cpu_shares": 1024},
			"security_context": map[string]any{"namespace_options": map[string]any{"pid": 1}},
		},
	}
	b, _ := json.Marshal(cfg)
	p := filepath.Join(dir, podName+"-ctr.json")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	id, err := n.Crictl(ctx, "create", pod, p, filepath.Join(dir, podName+".json"))
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestKubernetesPathGPU is the Kubernetes walkthrough end to end: node1 runs the inference
// workload on a fake GPU in a pod of the berth runtime handler, streaming a session; the kubelet's
// checkpoint call (crictl checkpoint --export) writes a CRI archive; `berthctl push` signs and
// pushes it to a registry on loopback; on node2, with berth-nri running, a pod of the berth handler
// whose container names the checkpoint as berth.dev/restore-from=oci://... comes up restored
// (the shim pulls, verifies and maps node1's GPU onto node2's), pinned by berth-nri, and the
// session continues with the tokens of an uninterrupted run. A registry outside the shim's
// allowed_registries and a node whose GPU driver differs are refused with errors naming why.
func TestKubernetesPathGPU(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	if src.GPU == nil || dst.GPU == nil {
		t.Skip("the cluster's nodes have no fake GPUs")
	}
	for _, n := range c.Nodes {
		if err := n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]); err != nil {
			t.Fatal(err)
		}
	}
	dir := t.TempDir()

	reg, err := node.StartRegistry(c.Stack.Tool("registry"), filepath.Join(dir, "registry"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(reg.Stop)
	restoreCfg, err := dst.AppendShimConfig(fmt.Sprintf("allowed_registries = [%q]\nregistry_plain_http = [%q]\n", reg.Addr, reg.Addr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = restoreCfg() })

	// berth-nri on node2, over a fake GPU inventory mapped onto CPUs 0 and 1
	bin := filepath.Join(dir, "berth-nri")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/berth-nri")
	build.Dir = node.RepoRoot()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build berth-nri: %v\n%s", err, out)
	}
	devRoot := filepath.Join(dir, "dev")
	if err := os.MkdirAll(devRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "topo.txt"), []byte(nriTopology), 0o644); err != nil {
		t.Fatal(err)
	}
	nriCfg := filepath.Join(dir, "nri.toml")
	if err := os.WriteFile(nriCfg, []byte("socket = \""+dst.NRISocket+"\"\nplugin_name = \"berth-k8s\"\ngpu_source = \"file\"\n"+
		"topology_file = \""+filepath.Join(dir, "topo.txt")+"\"\ngpu_uuids = [\"GPU-nri-e2e-0\", \"GPU-nri-e2e-1\"]\n"+
		"dev_root = \""+devRoot+"\"\nrefresh_seconds = 0\nrecord_key_file = \""+filepath.Join(dir, "nri-state", "record.key")+"\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	plugin, line := startNRI(t, bin, nriCfg, filepath.Join(dir, "nri.log"))
	t.Log(line)

	// node1: the workload on GPU-node1-0, one session streamed
	srcGPU := "GPU-" + src.Name + "-0"
	pod1 := criPod(t, ctx, src, dir, "k8s-src", "default")
	cid := k8sGPUContainer(t, ctx, src, dir, pod1, "k8s-src", srcGPU, nil)
	if _, err := src.Crictl(ctx, "start", cid); err != nil {
		t.Fatal(err)
	}
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, src, cid))}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	first, err := client.Stream(ctx, st, client.Request{Session: "k", Prompt: "kubelet gpu", N: 30})
	if err != nil {
		t.Fatal(err)
	}
	before, err := client.Stats(ctx, st)
	if err != nil || !before.GPU || before.GPUs != srcGPU {
		t.Fatalf("source workload: %+v %v; want GPU mode on %s", before, err, srcGPU)
	}

	// kubelet checkpoint API -> CRI archive
	archive := filepath.Join(dir, "k8s-ck.tar")
	t0 := time.Now()
	if out, err := src.Crictl(ctx, "checkpoint", "--export="+archive, cid); err != nil {
		t.Fatalf("crictl checkpoint: %v %s", err, out)
	}
	tCheckpoint := time.Since(t0)
	if out, err := src.Crictl(ctx, "stop", "-t", "0", cid); err != nil {
		t.Fatalf("stop source: %v %s", err, out)
	}
	fi, err := os.Stat(archive)
	if err != nil {
		t.Fatal(err)
	}

	// berthctl checkpoint push: signs the CRI archive and pushes it over plain HTTP
	ref := reg.Ref("berth/k8s-infer:v1")
	t0 = time.Now()
	var pushed pushResult
	if err := berthctlJSON(ctx, c, &pushed, "checkpoint", "push", "--plain-http", archive, ref); err != nil {
		t.Fatal(err)
	}
	tPush := time.Since(t0)
	if !regexp.MustCompile(`^sha256:[0-9a-f]{64}$`).MatchString(pushed.Digest) {
		t.Fatalf("berthctl checkpoint push reported no digest: %+v", pushed)
	}

	// node2: restore from the registry reference
	var restoredID string
	t.Run("restore", func(t *testing.T) {
		pod2 := criPod(t, ctx, dst, dir, "k8s-dst", "default")
		dstGPU := "GPU-" + dst.Name + "-0"
		t0 := time.Now()
		rid := k8sGPUContainer(t, ctx, dst, dir, pod2, "k8s-dst", dstGPU, map[string]string{"berth.dev/restore-from": "oci://" + ref})
		if out, err := dst.Crictl(ctx, "start", rid); err != nil {
			t.Fatalf("start restored container: %v %s", err, out)
		}
		tRestore := time.Since(t0)
		restoredID = rid
		rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, dst, rid))}
		rest, err := client.Stream(ctx, rt, client.Request{Session: "k", N: 60, From: 30})
		if err != nil {
			t.Fatal(err)
		}
		want, err := model.Reference(model.Config{WeightsMiB: 16, Seed: 1}, "kubelet gpu", 60)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := strings.Join(append(first, rest...), " "), strings.Join(model.Words(want), " "); got != want {
			t.Errorf("session across the registry move:\n got %s\nwant %s", got, want)
		}
		after, err := client.Stats(ctx, rt)
		if err != nil || after.Prefills != before.Prefills || !after.GPU || after.GPUs != dstGPU {
			t.Errorf("restored workload: %+v %v; want %d prefills, GPU mode on %s", after, err, before.Prefills, dstGPU)
		}
		// berth-nri placed it: one exclusive CPU (CPU 0 of the fake inventory's NUMA node 0)
		p := nriInspect(t, ctx, dst, rid)
		t.Logf("placement of the restored container: %+v", p)
		if p.cpus != "0" || p.mems != "0" || (p.cgCPUs != "" && p.cgCPUs != "0") || !strings.Contains(p.record, `"exclusive":true`) {
			t.Errorf("restored container not pinned by berth-nri: spec cpus %q mems %q, cgroup %q, placement %q", p.cpus, p.mems, p.cgCPUs, p.record)
		}
		pulled := filepath.Join(dst.CheckpointRoot, ".oci", strings.Replace(pushed.Digest, ":", "-", 1))
		if _, err := os.Stat(filepath.Join(pulled, "berth.json")); err != nil {
			t.Errorf("pulled checkpoint not at %s: %v", pulled, err)
		}
		pullMs := "?"
		if b, err := os.ReadFile(dst.Log); err == nil {
			if m := regexp.MustCompile(`checkpoint pulled and verified.*?ms=([0-9.]+)`).FindAllSubmatch(b, -1); len(m) > 0 {
				pullMs = string(m[len(m)-1][1])
			}
		}
		t.Logf("Kubernetes path, GPU inference (16 MiB weights, fake GPU), archive %.1f MiB:\n"+
			"  CRI checkpoint (crictl checkpoint --export)  %8.1f ms\n"+
			"  berthctl push (sign + upload)                %8.1f ms\n"+
			"  create + start restored (pull+verify+restore)%8.1f ms (of which pull+verify %s ms)",
			float64(fi.Size())/(1<<20), tCheckpoint.Seconds()*1000, tPush.Seconds()*1000, tRestore.Seconds()*1000, pullMs)
	})
	if restoredID != "" {
		_, _ = dst.Crictl(ctx, "stop", "-t", "0", restoredID)
		_, _ = dst.Crictl(ctx, "rm", restoredID)
	}

	t.Run("registry not allowed", func(t *testing.T) {
		pod := criPod(t, ctx, dst, dir, "k8s-noreg", "default")
		other := "127.0.0.2:5999/berth/k8s-infer:v1"
		rid := k8sGPUContainer(t, ctx, dst, dir, pod, "k8s-noreg", "GPU-"+dst.Name+"-0", map[string]string{"berth.dev/restore-from": "oci://" + other})
		_, err := dst.Crictl(ctx, "start", rid)
		if err == nil || !strings.Contains(err.Error(), "registry 127.0.0.2:5999 is not in allowed_registries") {
			t.Fatalf("restore from a registry outside allowed_registries: %v", err)
		}
		t.Logf("refused: %s", nriLastLine(err.Error()))
		_, _ = dst.Crictl(ctx, "rm", "-f", rid)
	})

	t.Run("GPU driver mismatch", func(t *testing.T) {
		inv := filepath.Join(dst.GPU.Root(), fake.InventoryFile)
		b, err := os.ReadFile(inv)
		if err != nil {
			t.Fatal(err)
		}
		var spec fake.NodeSpec
		if err := json.Unmarshal(b, &spec); err != nil {
			t.Fatal(err)
		}
		orig := spec
		spec.Driver = "590.10.01"
		if _, err := fake.Setup(dst.GPU.Root(), spec); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := fake.Setup(dst.GPU.Root(), orig); err != nil {
				t.Error(err)
			}
		}()
		pod := criPod(t, ctx, dst, dir, "k8s-driver", "default")
		rid := k8sGPUContainer(t, ctx, dst, dir, pod, "k8s-driver", "GPU-"+dst.Name+"-0",
			map[string]string{"berth.dev/restore-from": "oci://" + reg.Addr + "/berth/k8s-infer@" + pushed.Digest})
		_, err = dst.Crictl(ctx, "start", rid)
		if err == nil || !strings.Contains(err.Error(), "gpu.driver") || !strings.Contains(err.Error(), "590.10.01") {
			t.Fatalf("restore onto another GPU driver: %v; want a mismatch naming gpu.driver", err)
		}
		t.Logf("refused: %s", nriLastLine(err.Error()))
		_, _ = dst.Crictl(ctx, "rm", "-f", rid)
	})
	plugin.stop()
}
