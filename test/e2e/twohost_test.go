package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestSeparateEnds runs the move as it would go between two hosts, one berthctl command at a
// time: `checkpoint create` on the source (which keeps running), `receive` on the destination
// (only verified checkpoints land in its root), `send` from the source, and an explicit
// `restore` on the destination. The session continues on the restored copy.
func TestSeparateEnds(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const id, rid = "sep-e2e", "sep-e2e-restored"
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), id)
		_ = dst.Remove(context.Background(), rid)
	})
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "16", "-delay-ms", "0"}})
	if err != nil {
		t.Fatal(err)
	}
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Stream(ctx, st, client.Request{Session: "x", Prompt: "two hosts", N: 25}); err != nil {
		t.Fatal(err)
	}

	berthctl := func(args ...string) string {
		t.Helper()
		out, err := exec.CommandContext(ctx, c.Berthctl(), args...).CombinedOutput()
		if err != nil {
			t.Fatalf("berthctl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	dir := filepath.Join(src.Dir, "sep-ckpt")
	t.Log(berthctl("checkpoint", "create", "-a", src.Socket, "-n", node.Namespace, id, dir))
	if _, status, err := src.TaskPID(ctx, id); err != nil || status != "running" {
		t.Fatalf("source after checkpoint create: %q %v (want running)", status, err)
	}
	t.Log(berthctl("checkpoint", "inspect", "--verify", dir))

	rcv := exec.CommandContext(ctx, c.Berthctl(), "receive", "--listen", "127.0.0.1:0", "--root", dst.CheckpointRoot, "-o", "json")
	stdout, err := rcv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := rcv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rcv.Process.Signal(os.Interrupt); _ = rcv.Wait() })
	sc := bufio.NewScanner(stdout)
	var addr string
	if sc.Scan() {
		// {"event": "listening", "address": ADDR, "root": ROOT}
		var ev struct{ Event, Address string }
		if json.Unmarshal(sc.Bytes(), &ev) == nil && ev.Event == "listening" {
			addr = ev.Address
		}
	}
	if addr == "" {
		t.Fatalf("berthctl receive printed no address: %q", sc.Text())
	}
	go func() {
		for sc.Scan() {
			t.Log("receive:", sc.Text())
		}
	}()
	t.Log(berthctl("send", "--name", "sep1", dir, addr))
	if _, err := os.Stat(filepath.Join(dst.CheckpointRoot, "sep1", "berth.json")); err != nil {
		t.Fatalf("received checkpoint not in the destination root: %v", err)
	}
	if ids, _ := dst.Containers(ctx); len(ids) != 0 {
		t.Fatalf("receiving created containers on the destination: %v", ids)
	}
	t.Log(berthctl("restore", "-a", dst.Socket, "-n", node.Namespace, "--root", dst.CheckpointRoot, "--id", rid, "sep1"))
	rpid, status, err := dst.TaskPID(ctx, rid)
	if err != nil || status != "running" {
		t.Fatalf("restored task: %q %v", status, err)
	}
	rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(rpid))}
	got, err := client.Stream(ctx, rt, client.Request{Session: "x", N: 50, From: 25})
	if err != nil {
		t.Fatal(err)
	}
	want, err := client.Stream(ctx, st, client.Request{Session: "x", N: 50, From: 25})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("restored copy continues with %v, the source (left running) with %v", got, want)
	}
	if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
		t.Errorf("restored copy: %d prefills (%v), want 1", s.Prefills, err)
	}
}
