package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestCtrRestoreOfMovedContainer: a container that berthctl migrate moved (its spec carries the
// berth.dev/restore-from annotation of that move) is checkpointed with ctr on its new node and
// restored there with `ctr containers restore`, as the README documents; the restore is
// containerd's checkpoint, not the one the annotation names, and the session continues.
func TestCtrRestoreOfMovedContainer(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n1, n2 := c.Nodes[0], c.Nodes[1]
	const id, moved, rid, ref = "doc-ctr-0", "doc-ctr-1", "doc-ctr-2", "localhost/berth/ckpt/doc-ctr:1"
	ns := []string{"-n", node.Namespace}
	t.Cleanup(func() {
		bg := context.Background()
		_ = n1.Remove(bg, id)
		_ = n2.Remove(bg, moved)
		_ = n2.Remove(bg, rid)
		_, _ = n2.Ctr(bg, append(ns, "images", "rm", ref)...)
	})
	pid, err := n1.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	tgt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	if err := client.WaitReady(ctx, tgt, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Stream(ctx, tgt, client.Request{Session: "d", Prompt: "doc", N: 10}); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.CommandContext(ctx, c.Berthctl(), "migrate", "--from", n1.Socket, "--to", n2.Socket,
		"-n", node.Namespace, "--root", n2.CheckpointRoot, "--id", moved,
		"--work-dir", filepath.Join(n1.Dir, "outgoing"), id).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	if out, err := n2.Ctr(ctx, append(ns, "containers", "checkpoint", "--task", "--rw", "--image", moved, ref)...); err != nil {
		t.Fatalf("ctr containers checkpoint of the moved container: %v %s", err, out)
	}
	if err := n2.Remove(ctx, moved); err != nil { // its cgroup path would be taken
		t.Fatal(err)
	}
	if out, err := n2.Ctr(ctx, append(ns, "containers", "restore", "--live", "--rw", rid, ref)...); err != nil {
		t.Fatalf("ctr containers restore of a moved container: %v %s", err, out)
	}
	rpid, st, err := n2.TaskPID(ctx, rid)
	if err != nil || st != "running" {
		t.Fatalf("restored task: %q %v", st, err)
	}
	rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(rpid))}
	if _, err := client.Stream(ctx, rt, client.Request{Session: "d", N: 20, From: 10}); err != nil {
		t.Fatal(err)
	}
	if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
		t.Errorf("restored: %d prefills (%v), want 1", s.Prefills, err)
	}
}
