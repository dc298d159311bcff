package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/scenario"
	"github.com/berth-dev/berth/test/workload/client"
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
	assertMovedInference(t, rep)
	if !strings.Contains(rep.MigrateOutput, "page-stream") {
		t.Errorf("migrate reported no page-stream phase:\n%s", rep.MigrateOutput)
	}
	// the source's checkpoint (kept with --keep-local) has no page images; the destination's has
	// them, and no staging directory is left
	srcPages, _ := filepath.Glob(filepath.Join(work, "*", "checkpoint", "pages-*.img"))
	if kept, _ := filepath.Glob(filepath.Join(work, "*", "berth.json")); len(kept) == 0 {
		t.Errorf("no checkpoint kept in %s (--keep-local)", work)
	} else if m, err := checkpoint.ReadManifest(filepath.Dir(kept[0])); err != nil {
		t.Error(err)
	} else if m.PageStream == nil || !strings.HasPrefix(m.PageStream.Digest, checkpoint.PageDigestBLAKE3+":") {
		// the digest the source signed and the destination matched is BLAKE3's, named
		t.Errorf("the signed manifest's pageStream = %+v, want a %s digest", m.PageStream, checkpoint.PageDigestBLAKE3)
	} else {
		// the summary counts the page stream (the weights at least), as the manifest sized it
		want := fmt.Sprintf("+ %.1f MiB pages streamed = ", float64(m.PageStream.Size)/(1<<20))
		if m.PageStream.Size < 64<<20 || !strings.Contains(rep.MigrateOutput, want) {
			t.Errorf("pageStream of %d bytes; migrate's summary should count it (%q):\n%s", m.PageStream.Size, want, rep.MigrateOutput)
		}
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

// TestMigrateRedisCopyMode is TestMigrateRedis in copy mode: every key, by Redis's own digest.
func TestMigrateRedisCopyMode(t *testing.T) { migrateRedis(t, "redis-copy", "--mode", "copy") }

// copyFaultWorkload starts the workload holding mib MiB on n, so that its page stream lasts long
// enough to be cut or lose its destination mid-way.
func copyFaultWorkload(t *testing.T, ctx context.Context, n *node.Node, id string, mib int) *fltWorkload {
	t.Helper()
	_ = n.Remove(ctx, id)
	pid, err := n.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, LogPath: filepath.Join(n.Dir, id+".log"),
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", fmt.Sprint(mib), "-seed", "7", "-delay-ms", "1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	w := &fltWorkload{n: n, id: id, pid: pid, target: client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := client.WaitReady(wctx, w.target, 50*time.Millisecond); err != nil {
		t.Fatalf("workload %s not ready: %v", id, err)
	}
	st, err := client.Stats(ctx, w.target)
	if err != nil {
		t.Fatal(err)
	}
	w.checksum = st.WeightsChecksum
	return w
}

// pagesReceived returns the bytes of page images in root's page-stream staging directories.
func pagesReceived(root string) int64 {
	var n int64
	files, _ := filepath.Glob(filepath.Join(root, transfer.StagingPrefix+"*", "pages-*.img"))
	for _, f := range files {
		if fi, err := os.Stat(f); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// TestCopyModeFaults breaks copy-mode moves while the memory pages stream: the link to the
// destination cut after 16 MiB of the page stream, and the destination's receiver killed once
// 16 MiB of pages arrived, and the source's CRIU (the page client) killed once 16 MiB arrived.
// In each the move fails saying so, the source resumes (same process, running, weights intact,
// still streaming; when its CRIU died, whose parasite was inside it, only not paused, and the
// error says it may be broken), its checkpoint directory is removed, and the
// destination holds no container and, once a receiver runs there again, nothing in its root.
func TestCopyModeFaults(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, root string, migrate func(receiver string) (string, error)) (string, error)
		want string
	}{
		{"link-cut", func(t *testing.T, root string, migrate func(string) (string, error)) (string, error) {
			rcv := fltStartReceive(t, ctx, c, root)
			return migrate(fltCutProxy(t, rcv.addr, 16<<20, nil))
		}, "page stream"},
		{"destination-killed", func(t *testing.T, root string, migrate func(string) (string, error)) (string, error) {
			rcv := fltStartReceive(t, ctx, c, root)
			go func() {
				for ctx.Err() == nil && pagesReceived(root) < 16<<20 {
					time.Sleep(5 * time.Millisecond)
				}
				rcv.kill()
			}()
			out, err := migrate(rcv.addr)
			// a receiver started again on the same root removes what the killed one left
			again := fltStartReceive(t, ctx, c, root)
			again.kill()
			return out, err
		}, "page stream"},
		{"source-criu-killed", func(t *testing.T, root string, migrate func(string) (string, error)) (string, error) {
			rcv := fltStartReceive(t, ctx, c, root)
			go func() {
				for ctx.Err() == nil && pagesReceived(root) < 16<<20 {
					time.Sleep(5 * time.Millisecond)
				}
				killSourceCRIU(t, "copyflt-source-criu-killed")
			}()
			return migrate(rcv.addr)
		}, "CRIU died during the dump"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "copyflt-" + tc.name
			w := copyFaultWorkload(t, ctx, src, id, 256)
			root := t.TempDir()
			work := t.TempDir()
			before := fltDstState(t, ctx, dst)
			target, name := id+"-moved", id+"-ck"
			out, err := tc.run(t, root, func(receiver string) (string, error) {
				return fltBerthctl(ctx, c, "migrate", "--mode", "copy", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
					"--receiver", receiver, "--id", target, "--work-dir", work, "--name", name, id)
			})
			fltRequireErr(t, "berthctl migrate", out, err, "migrate "+id, tc.want)
			if tc.name == "source-criu-killed" {
				// CRIU's parasite was inside the task when CRIU died: the source may be broken
				// (the error says so); berth only promises it is not left paused
				if pid, st, err := w.n.TaskPID(ctx, w.id); err != nil || st == containerd.Paused {
					t.Errorf("source %s after its CRIU died: pid %d status %q (%v), want not paused", w.id, pid, st, err)
				}
			} else {
				w.requireServing(t, ctx)
			}
			fltRequireEmptyDir(t, work)
			fltRequireDstClean(t, ctx, dst, before, []string{target}, name)
			if left := fltList(t, root); len(left) > 0 {
				t.Errorf("destination root %s holds %v after the failed move", root, left)
			}
		})
	}
}

// assertMovedInference fails t unless rep shows every session continuing exactly (identical
// tokens, no prefill recomputed, the weights' checksum unchanged) and the source task gone.
func assertMovedInference(t *testing.T, rep *scenario.InferenceReport) {
	t.Helper()
	if !rep.Continuous() {
		t.Errorf("sessions did not continue exactly: %d of %d match, prefills %d -> %d, weights %s -> %s",
			rep.MatchingSessions, len(rep.Streams), rep.PrefillsBefore, rep.PrefillsAfter, rep.WeightsChecksumBefore, rep.WeightsChecksumAfter)
	}
	if rep.SourceStatus != "" {
		t.Errorf("source task still exists (%s) after the move", rep.SourceStatus)
	}
}
