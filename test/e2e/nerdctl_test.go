package e2e

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestNerdctlCheckpoint: nerdctl's checkpoint commands on a berth container, as the README
// describes them: `checkpoint create` writes a checkpoint (berth's container keeps running
// without --leave-running, since nerdctl asks a runtime not named io.containerd.runc.v2 for no
// exit), `checkpoint ls` lists it, and once the container is stopped, `start --checkpoint`
// restores it through berth's shim, which verifies it: the session continues without a second
// prefill.
func TestNerdctlCheckpoint(t *testing.T) {
	c := needCluster(t)
	n := c.Nodes[0]
	if n.NerdctlPath() == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("no nerdctl in the stack: run make deps")
		}
		t.Skip("no nerdctl in the stack: run make deps")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const name = "nerd-e2e"
	ns := node.Namespace
	t.Cleanup(func() { _, _ = n.Nerdctl(context.Background(), ns, "rm", "-f", name) })
	// docker's semantics: the arguments follow the image's entrypoint, the workload
	id, err := n.Nerdctl(ctx, ns, "run", "-d", "--pull", "never", "--net", "none", "--runtime", "io.containerd.berth.v2",
		"--name", name, image.WorkloadRef, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0")
	if err != nil {
		t.Fatalf("nerdctl run: %v %s", err, id)
	}
	pid, _, err := n.TaskPID(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	tgt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	defer wcancel()
	if err := client.WaitReady(wctx, tgt, 100*time.Millisecond); err != nil {
		logs, _ := n.Nerdctl(ctx, ns, "logs", name)
		t.Fatalf("%v; its log: %s", err, logs)
	}
	if _, err := client.Stream(ctx, tgt, client.Request{Session: "n", Prompt: "nerd", N: 10}); err != nil {
		t.Fatal(err)
	}
	if out, err := n.Nerdctl(ctx, ns, "checkpoint", "create", name, "ck1"); err != nil || out != "ck1" {
		t.Fatalf("nerdctl checkpoint create: %q %v", out, err)
	}
	// without --leave-running runc's container would stop; berth's keeps running (README)
	if p, st, err := n.TaskPID(ctx, id); err != nil || st != "running" || p != pid {
		t.Errorf("after nerdctl checkpoint create: pid %d %q %v; want %d still running", p, st, err, pid)
	}
	out, err := n.Nerdctl(ctx, ns, "checkpoint", "ls", name)
	if err != nil || !strings.Contains(out, "ck1") {
		t.Errorf("nerdctl checkpoint ls: %q %v; want ck1 listed", out, err)
	}
	if _, err := client.Stream(ctx, tgt, client.Request{Session: "other", Prompt: "x", N: 3}); err != nil {
		t.Fatal(err)
	}
	if out, err := n.Nerdctl(ctx, ns, "stop", "-t", "0", name); err != nil {
		t.Fatalf("nerdctl stop: %v %s", err, out)
	}
	if out, err := n.Nerdctl(ctx, ns, "start", "--checkpoint", "ck1", name); err != nil {
		t.Fatalf("nerdctl start --checkpoint: %v %s", err, out)
	}
	rpid, st, err := n.TaskPID(ctx, id)
	if err != nil || st != "running" {
		t.Fatalf("restored task: %q %v", st, err)
	}
	rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(rpid))}
	if _, err := client.Stream(ctx, rt, client.Request{Session: "n", N: 20, From: 10}); err != nil {
		t.Fatal(err)
	}
	// the checkpoint's state: one prefill (session n), not the later session "other"
	if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
		t.Errorf("restored from ck1: %d prefills (%v), want 1", s.Prefills, err)
	}
}
