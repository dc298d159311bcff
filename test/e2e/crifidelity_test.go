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
)

// fidPod runs a pod of the berth handler with its own network and UTS namespaces and the kernel
// hostname name (what the kubelet sets: the pod's name).
func fidPod(t *testing.T, ctx context.Context, n *node.Node, dir, name string) string {
	t.Helper()
	cfg := fmt.Sprintf(`{"metadata": {"name": %q, "namespace": "default", "uid": "%s-uid", "attempt": 0}, "hostname": %q, "log_directory": %q, "linux": {}}`,
		name, name, name, filepath.Join(dir, name+"-logs"))
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

// fidContainer creates and starts container name in pod (config podName.json under dir) running
// command, with its own PID namespace, and returns its id.
func fidContainer(t *testing.T, ctx context.Context, n *node.Node, dir, pod, podName, name string, annotations map[string]string, command ...string) string {
	t.Helper()
	ann, _ := json.Marshal(annotations)
	cmd, _ := json.Marshal(command)
	cfg := fmt.Sprintf(`{"metadata": {"name": %q}, "image": {"image": %q}, "command": %s, "annotations": %s, "log_path": "%s.log",
 "linux": {"security_context": {"namespace_options": {"pid": 1}}}}`, name, image.WorkloadRef, cmd, ann, name)
	p := filepath.Join(dir, podName+"-"+name+".json")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	id, err := n.Crictl(ctx, "create", pod, p, filepath.Join(dir, podName+".json"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := n.Crictl(ctx, "start", id); err != nil {
		t.Fatalf("start %s: %v %s", name, err, out)
	}
	return id
}

// TestCRIRestoreFidelity: a CRI container restored into a new pod gets back what it kept on its
// pod's /dev/shm (a tmpfs runc hands CRIU as an external mount, whose contents CRIU does not
// dump: the shim carries them, signed, beside the images), and the new pod keeps its own kernel
// hostname, in the restored container and in a sidecar that shares the pod's UTS namespace (CRIU
// restores the old pod's into it); the sidecar keeps running untouched.
func TestCRIRestoreFidelity(t *testing.T) {
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
	bb := "/bin/busybox"
	infer := []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "16", "-delay-ms", "0"}

	pod1 := fidPod(t, ctx, src, dir, "fid-src")
	_ = fidContainer(t, ctx, src, dir, pod1, "fid-src", "side", nil, bb, "sleep", "100000")
	cid := fidContainer(t, ctx, src, dir, pod1, "fid-src", "infer", nil, infer...)
	if out, err := src.Crictl(ctx, "exec", cid, bb, "sh", "-c", "echo kept-in-shm > /dev/shm/note && mkdir /dev/shm/d && echo nested > /dev/shm/d/f"); err != nil {
		t.Fatalf("write /dev/shm: %v %s", err, out)
	}
	if out, err := src.Crictl(ctx, "exec", cid, bb, "hostname"); err != nil || out != "fid-src" {
		t.Fatalf("source hostname %q %v", out, err)
	}
	archive := filepath.Join(dst.CheckpointRoot, "fid-ck.tar")
	if out, err := src.Crictl(ctx, "checkpoint", "--export="+archive, cid); err != nil {
		t.Fatalf("crictl checkpoint: %v %s", err, out)
	}
	if out, err := src.Crictl(ctx, "stop", "-t", "0", cid); err != nil {
		t.Fatalf("stop source: %v %s", err, out)
	}

	pod2 := fidPod(t, ctx, dst, dir, "fid-dst")
	side := fidContainer(t, ctx, dst, dir, pod2, "fid-dst", "side", nil, bb, "sleep", "100000")
	sidePID := criPID(t, ctx, dst, side)
	rid := fidContainer(t, ctx, dst, dir, pod2, "fid-dst", "infer", map[string]string{"berth.dev/restore-from": "fid-ck.tar"}, infer...)

	for _, tc := range []struct{ ctr, what, want string }{
		{rid, "cat /dev/shm/note", "kept-in-shm"},
		{rid, "cat /dev/shm/d/f", "nested"},
		{side, "cat /dev/shm/note", "kept-in-shm"}, // the pod's /dev/shm, shared
		{rid, "hostname", "fid-dst"},
		{side, "hostname", "fid-dst"},
	} {
		out, err := dst.Crictl(ctx, append([]string{"exec", tc.ctr, bb}, strings.Fields(tc.what)...)...)
		if err != nil || strings.TrimSpace(out) != tc.want {
			who := "restored container"
			if tc.ctr == side {
				who = "sidecar"
			}
			t.Errorf("%s: %s = %q (%v), want %q", who, tc.what, out, err, tc.want)
		}
	}
	if got := criPID(t, ctx, dst, side); got != sidePID {
		t.Errorf("sidecar pid %d became %d across the restore", sidePID, got)
	}
	if out, err := dst.Crictl(ctx, "inspect", "-o", "go-template", "--template", "{{.status.state}}", side); err != nil || out != "CONTAINER_RUNNING" {
		t.Errorf("sidecar after the restore: %q %v", out, err)
	}
}
