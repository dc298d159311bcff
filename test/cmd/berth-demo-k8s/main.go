// Command berth-demo-k8s is `make demo-k8s`: the move story of `make demo` on a real two-node
// Kubernetes cluster (test/node's StartKube: etcd, the control plane and two kubelets over two
// containerd nodes with berth's shim, RuntimeClass berth, berth-nri, NFD labels). It runs the
// inference workload as a pod of RuntimeClass berth on kube1, streams a few sessions from it,
// moves it mid-stream to kube2 with `kubectl berth move` (the kubelet checkpoint API, a restore
// pod, the source pod deleted), and prints the per-phase times and the continuity verdict.
//
// It needs root, the stack (`make deps`) and the Kubernetes binaries (`make deps-k8s`).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/scenario"
)

func main() {
	weights := flag.Int("weights-mib", 256, "model weights held in memory, MiB")
	sessions := flag.Int("sessions", 4, "concurrent streaming sessions")
	tokens := flag.Int("tokens", 400, "tokens per session (they must outlast the move: the source streams until it is deleted)")
	delay := flag.Int("delay-ms", 100, "the workload's pause between tokens, ms")
	moveAfter := flag.Int("move-after", 40, "move once every session received this many tokens")
	dir := flag.String("dir", "/var/tmp/berth-demo-k8s", "directory for the cluster's files (keep it short: unix socket paths)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dir, scenario.PodOptions{Namespace: "berth-demo", Pod: "infer", WeightsMiB: *weights,
		Sessions: *sessions, Tokens: *tokens, MoveAfter: *moveAfter, DelayMs: *delay, Out: os.Stdout}); err != nil {
		fmt.Fprintln(os.Stderr, "berth-demo-k8s:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dir string, o scenario.PodOptions) error {
	if err := node.RequireKube(); err != nil {
		return err
	}
	if err := scenario.PrepareDir(dir, "berth-demo-k8s"); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	fmt.Printf("starting a two-node Kubernetes cluster under %s ...\n", dir)
	t0 := time.Now()
	c, err := node.StartKube(ctx, node.KubeOptions{Dir: dir, Nodes: 2, Log: os.Stdout})
	if err != nil {
		return err
	}
	defer c.Stop(context.WithoutCancel(ctx))
	fmt.Printf("cluster up in %.1f s: nodes %s and %s, RuntimeClass berth, berth-nri on both\n\n", time.Since(t0).Seconds(), c.Nodes[0].Name, c.Nodes[1].Name)

	rep, err := scenario.MovePod(ctx, c, c.Nodes[0], c.Nodes[1], o)
	if err != nil {
		return err
	}
	fmt.Printf("\nkubectl berth move wall time: %v\n", rep.MigrateWall.Round(time.Millisecond))
	fmt.Printf("sessions identical to an uninterrupted run: %d of %d\n", rep.MatchingSessions, len(rep.Streams))
	for i, at := range rep.ResumedAt {
		if at < 0 {
			fmt.Printf("  session s%d ended on %s before the move finished (raise -tokens)\n", i, rep.From)
		} else {
			fmt.Printf("  session s%d: tokens 0-%d from %s/%s, %d-%d from %s/%s\n", i, at-1, rep.From, o.Pod, at, o.Tokens-1, rep.To, rep.Restored)
		}
	}
	fmt.Printf("prefills: %d before the move, %d after (equal: no context recomputed)\n", rep.PrefillsBefore, rep.PrefillsAfter)
	fmt.Printf("weights checksum: %s before, %s after\n", rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	fmt.Printf("source pod %s/%s deleted: %v\n", o.Namespace, o.Pod, rep.SourceDeleted)
	if !rep.Continuous() {
		return fmt.Errorf("verdict: NOT continuous")
	}
	fmt.Printf("verdict: CONTINUOUS: every session went on at the next token in pod %s on %s\n", rep.Restored, rep.To)
	return nil
}
