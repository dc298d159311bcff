// Command berth-demo is `make demo`: it starts two local containerd nodes with berth's shim,
// runs the inference workload on node1 with a few streaming sessions, moves it to node2
// mid-stream with `berthctl migrate`, and prints the per-phase timings and the continuity verdict.
//
// It needs root and the stack (`make deps`). Flags size the workload; -keep keeps the two nodes
// after the move, with the moved workload running on node2, and prints how to use them by hand
// until Ctrl-C stops and removes them.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/scenario"
)

func main() {
	weights := flag.Int("weights-mib", 256, "model weights held in memory, MiB")
	sessions := flag.Int("sessions", 4, "concurrent streaming sessions")
	tokens := flag.Int("tokens", 200, "tokens per session")
	moveAfter := flag.Int("move-after", 60, "move once every session received this many tokens")
	dir := flag.String("dir", "/var/tmp/berth-demo", "directory for the two nodes' files")
	gpuMode := flag.Bool("gpu", true, "run the workload on a fake GPU (weights and KV caches in device memory that only exists on node1)")
	keep := flag.Bool("keep", false, "keep the two nodes after the move (the workload running on node2) and print how to use them by hand; Ctrl-C stops and removes them")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dir, *weights, *sessions, *tokens, *moveAfter, *gpuMode, *keep); err != nil {
		fmt.Fprintln(os.Stderr, "berth-demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dir string, weights, sessions, tokens, moveAfter int, gpuMode, keep bool) error {
	if err := node.Require(); err != nil {
		return err
	}
	if err := scenario.PrepareDir(dir, "berth-demo"); err != nil {
		return err
	}
	fmt.Printf("starting two containerd nodes under %s ...\n", dir)
	c, err := node.StartClusterWith(ctx, dir, 2, node.Options{FakeGPUs: 2})
	if err != nil {
		return err
	}
	// berthctl signs the move with the cluster's operator key, which both nodes trust
	os.Setenv(node.EnvShimConfig, c.BerthctlConfig)
	defer func() {
		c.Stop(context.WithoutCancel(ctx))
		os.RemoveAll(dir)
	}()
	rep, err := scenario.MoveInference(ctx, c, c.Nodes[0], c.Nodes[1], scenario.InferenceOptions{
		ID: "demo-infer", WeightsMiB: weights, Sessions: sessions, Tokens: tokens, MoveAfter: moveAfter,
		DelayMs: 20, Out: os.Stdout, GPU: gpuMode,
	})
	if err != nil {
		return err
	}
	fmt.Printf("\nberthctl migrate wall time: %v\n", rep.MigrateWall.Round(1e6))
	fmt.Printf("sessions identical to an uninterrupted run: %d of %d\n", rep.MatchingSessions, len(rep.Streams))
	fmt.Printf("prefills: %d before the move, %d after (equal: no context recomputed)\n", rep.PrefillsBefore, rep.PrefillsAfter)
	fmt.Printf("weights checksum: %s before, %s after\n", rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	if gpuMode {
		fmt.Printf("GPU: %s on node1 -> %s on node2 (device memory checkpointed, moved and restored by berth's GPU steps)\n", rep.GPUsBefore, rep.GPUsAfter)
	}
	if !rep.Continuous() {
		return fmt.Errorf("verdict: NOT continuous")
	}
	fmt.Println("verdict: CONTINUOUS: every session went on at the next token on node2")
	if keep {
		printKept(c)
		<-ctx.Done()
		fmt.Println("\nstopping and removing the two nodes ...")
	}
	return nil
}

// printKept says how to use the cluster's nodes by hand: their sockets, berthctl's
// configuration, and a move of the workload back to node1 (copy and lazy mode).
func printKept(c *node.Cluster) {
	n1, n2 := c.Nodes[0], c.Nodes[1]
	fmt.Printf(`
the two nodes keep running until Ctrl-C (they share this host; containers are in namespace %[1]s):
  node1: containerd %[2]s, checkpoint root %[3]s, log %[4]s
  node2: containerd %[5]s, checkpoint root %[6]s, log %[7]s
the workload demo-infer-moved runs on node2. In another shell, from the repository:
  export PATH=$PWD/_output/bin:$PWD/_output/stack/bin:$PATH %[8]s=%[9]s
  ctr -a %[5]s -n %[1]s tasks ls
  berthctl migrate --from %[5]s --to %[2]s -n %[1]s --root %[3]s --id demo-infer-back demo-infer-moved
lazy mode (--lazy) needs fs.pipe-max-size >= %[10]d here first: sysctl -w fs.pipe-max-size=%[10]d (put it back afterwards)
`, node.Namespace, n1.Socket, n1.CheckpointRoot, n1.Log, n2.Socket, n2.CheckpointRoot, n2.Log,
		node.EnvShimConfig, c.BerthctlConfig, criu.MinLazyPipeMaxSize)
}
