package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/transfer"
	"github.com/berth-dev/berth/test/scenario"
)

// TestMigrateInferenceCopyMode moves the inference workload mid-stream in copy mode: CRIU sends
// the memory pages straight to a page server the receiver runs, the source writes only the
// non-memory images. Every session must continue with exactly the tokens of an uninterrupted
// run, no page image may be written on the source, and nothing of the page stream may be left
// in the destination's checkpoint root.
func TestMigrateInferenceCopyMode(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	work := filepath.Join(t.TempDir(), "outgoing")
	rep, err := scenario.MoveInference(ctx, c, src, dst, scenario.InferenceOptions{
		ID: "infer-copy", WeightsMiB: 64, Sessions: 3, Tokens: 120, MoveAfter: 30, DelayMs: 15, Out: os.Stderr,
		MigrateArgs: []string{"--mode", "copy", "--keep-local", "--work-dir", work},
	})
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), "infer-copy")
		_ = dst.Remove(context.Background(), "infer-copy-moved")
	})
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Continuous() {
		t.Errorf("sessions did not continue exactly: %d of %d match, prefills %d -> %d, weights %s -> %s",
			rep.MatchingSessions, len(rep.Streams), rep.PrefillsBefore, rep.PrefillsAfter, rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	}
	if rep.SourceStatus != "" {
		t.Errorf("source task still exists (%s) after the move", rep.SourceStatus)
	}
	if !strings.Contains(rep.MigrateOutput, "page-stream") {
		t.Errorf("migrate reported no page-stream phase:\n%s", rep.MigrateOutput)
	}
	// the source's checkpoint (kept with --keep-local) has no page images; the destination's has
	// them, and no staging directory is left
	srcPages, _ := filepath.Glob(filepath.Join(work, "*", "checkpoint", "pages-*.img"))
	if kept, _ := filepath.Glob(filepath.Join(work, "*", "berth.json")); len(kept) == 0 {
		t.Errorf("no checkpoint kept in %s (--keep-local)", work)
	}
	if len(srcPages) > 0 {
		t.Errorf("page images written on the source in copy mode: %v", srcPages)
	}
	dstPages, _ := filepath.Glob(filepath.Join(dst.CheckpointRoot, "*", "checkpoint", "pages-*.img"))
	if len(dstPages) == 0 {
		t.Errorf("no page images in the destination's checkpoint root %s", dst.CheckpointRoot)
	}
	left, _ := filepath.Glob(filepath.Join(dst.CheckpointRoot, transfer.StagingPrefix+"*"))
	if len(left) > 0 {
		t.Errorf("staging left in the destination's root: %v", left)
	}
	t.Logf("migrate (copy mode) took %v:\n%s", rep.MigrateWall, rep.MigrateOutput)
}
