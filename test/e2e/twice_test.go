package e2e

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// TestMigrateThereAndBack moves a container to node2 and back to node1 (a restored task must be
// as movable as a fresh one: its standard streams are pipes, not the host's /dev/null), and the
// session continues across both moves.
func TestMigrateThereAndBack(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n1, n2 := c.Nodes[0], c.Nodes[1]
	ids := []string{"hop-0", "hop-1", "hop-2"}
	t.Cleanup(func() {
		_ = n1.Remove(context.Background(), ids[0])
		_ = n2.Remove(context.Background(), ids[1])
		_ = n1.Remove(context.Background(), ids[2])
	})
	pid, err := n1.Run(ctx, node.RunOptions{ID: ids[0], Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	tgt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	if err := client.WaitReady(ctx, tgt, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	var got []string
	toks, err := client.Stream(ctx, tgt, client.Request{Session: "h", Prompt: "hop", N: 10})
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, toks...)
	hops := []struct {
		from, to  *node.Node
		id, to_id string
	}{{n1, n2, ids[0], ids[1]}, {n2, n1, ids[1], ids[2]}}
	for i, h := range hops {
		out, err := exec.CommandContext(ctx, c.Berthctl(), "migrate", "--from", h.from.Socket, "--to", h.to.Socket,
			"-n", node.Namespace, "--root", h.to.CheckpointRoot, "--id", h.to_id,
			"--work-dir", filepath.Join(h.from.Dir, "outgoing"), h.id).CombinedOutput()
		if err != nil {
			t.Fatalf("move %d (%s -> %s): %v\n%s", i+1, h.from.Name, h.to.Name, err, out)
		}
		p, _, err := h.to.TaskPID(ctx, h.to_id)
		if err != nil {
			t.Fatal(err)
		}
		tgt = client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(p))}
		toks, err := client.Stream(ctx, tgt, client.Request{Session: "h", N: 10 * (i + 2), From: 10 * (i + 1)})
		if err != nil {
			t.Fatalf("after move %d: %v", i+1, err)
		}
		got = append(got, toks...)
	}
	ref, err := model.Reference(model.Config{WeightsMiB: 8, Seed: 1}, "hop", 30)
	if err != nil {
		t.Fatal(err)
	}
	if g, w := strings.Join(got, " "), strings.Join(model.Words(ref), " "); g != w {
		t.Errorf("session across two moves:\n got %s\nwant %s", g, w)
	}
	if s, err := client.Stats(ctx, tgt); err != nil || s.Prefills != 1 {
		t.Errorf("after two moves: %d prefills (%v), want 1", s.Prefills, err)
	}
}
