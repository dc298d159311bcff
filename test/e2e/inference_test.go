package e2e

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/scenario"
)

// TestMigrateInferenceMidStream moves the inference workload between nodes while sessions stream,
// and checks that every session continues with exactly the tokens of an uninterrupted run, that
// nothing was prefilled again, and that the source was stopped only after the restore.
func TestMigrateInferenceMidStream(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	rep, err := scenario.MoveInference(ctx, c, src, dst, scenario.InferenceOptions{
		ID: "infer-e2e", WeightsMiB: 64, Sessions: 3, Tokens: 120, MoveAfter: 30, DelayMs: 15, Out: os.Stderr,
	})
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), "infer-e2e")
		_ = dst.Remove(context.Background(), "infer-e2e-moved")
	})
	if err != nil {
		if os.Getenv("BERTH_E2E_KEEP") != "" {
			t.Logf("keeping containers 60s for inspection (dest pid %d)", rep.DestPID)
			time.Sleep(60 * time.Second)
		}
		t.Fatal(err)
	}
	for i := range rep.Streams {
		if len(rep.Streams[i]) != len(rep.Reference[i]) {
			t.Errorf("session %d: got %d tokens, want %d", i, len(rep.Streams[i]), len(rep.Reference[i]))
			continue
		}
		for j := range rep.Streams[i] {
			if rep.Streams[i][j] != rep.Reference[i][j] {
				t.Errorf("session %d: token %d is %q, an uninterrupted run emits %q", i, j, rep.Streams[i][j], rep.Reference[i][j])
				break
			}
		}
	}
	if rep.PrefillsAfter != rep.PrefillsBefore {
		t.Errorf("destination counts %d prefills, the source had %d: context was recomputed", rep.PrefillsAfter, rep.PrefillsBefore)
	}
	if rep.WeightsChecksumAfter != rep.WeightsChecksumBefore {
		t.Errorf("weights checksum %s after the move, %s before", rep.WeightsChecksumAfter, rep.WeightsChecksumBefore)
	}
	if rep.SourceStatus != "" {
		t.Errorf("source task still exists (%s) after a move without --leave-running", rep.SourceStatus)
	}
	t.Logf("migrate took %v:\n%s", rep.MigrateWall, rep.MigrateOutput)
}

// TestMigrateGPUInference moves the workload in GPU mode: weights and KV caches in (fake) device
// memory on node1's GPU, which exists only on node1. The shim locks and checkpoints the CUDA
// state into host memory before CRIU, and on node2 maps the GPU to node2's own and restores it.
func TestMigrateGPUInference(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), "gpu-e2e")
		_ = dst.Remove(context.Background(), "gpu-e2e-moved")
	})
	rep, err := scenario.MoveInference(ctx, c, src, dst, scenario.InferenceOptions{
		ID: "gpu-e2e", WeightsMiB: 32, Sessions: 2, Tokens: 100, MoveAfter: 25, DelayMs: 15, Out: os.Stderr, GPU: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if rep.MatchingSessions != len(rep.Streams) {
		t.Errorf("%d of %d sessions continued exactly", rep.MatchingSessions, len(rep.Streams))
	}
	if rep.PrefillsAfter != rep.PrefillsBefore || rep.WeightsChecksumAfter != rep.WeightsChecksumBefore {
		t.Errorf("prefills %d -> %d, weights %s -> %s", rep.PrefillsBefore, rep.PrefillsAfter, rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	}
	if rep.GPUsBefore != "GPU-node1-0" || rep.GPUsAfter != "GPU-node2-0" {
		t.Errorf("workload GPUs %q before, %q after; want GPU-node1-0 -> GPU-node2-0", rep.GPUsBefore, rep.GPUsAfter)
	}
	t.Logf("migrate:\n%s", rep.MigrateOutput)
}
