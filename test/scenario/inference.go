// Package scenario runs berth's end-to-end scenarios on a local cluster (package node) and
// reports what happened: the demo prints the report, the tests assert on it.
//
// What belongs here: multi-step scenarios over real nodes (run a workload, stream sessions, move
// it, check continuity). What does not: node lifecycle (package node) or berth's own logic.
package scenario

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// InferenceOptions configure MoveInference.
type InferenceOptions struct {
	// ID is the container id on the source; the destination's is ID+"-moved" (nodes on one
	// host share runc's state root and the cgroup tree, so ids must differ).
	ID string
	// WeightsMiB is the model's weight size in MiB.
	WeightsMiB int
	// Sessions is the number of concurrent streaming sessions; Tokens the tokens each streams.
	Sessions, Tokens int
	// MoveAfter is the number of tokens every session must have received before the move.
	MoveAfter int
	// DelayMs is the server's pause between tokens.
	DelayMs int
	// Out receives progress lines (may be io.Discard).
	Out io.Writer
	// MigrateArgs are extra berthctl migrate arguments (e.g. "--leave-running").
	MigrateArgs []string
	// GPU runs the workload in GPU mode on the source node's first fake GPU: its weights and KV
	// caches live in fake device memory, which only berth's GPU steps carry to the destination.
	GPU bool
}

// InferenceReport is what MoveInference observed.
type InferenceReport struct {
	// Streams[i] are the words session i received, across the move; Reference[i] what an
	// uninterrupted run emits.
	Streams, Reference [][]string
	// MatchingSessions counts sessions whose Streams equal Reference.
	MatchingSessions int
	// PrefillsBefore and PrefillsAfter are the source's and destination's prefill counters.
	PrefillsBefore, PrefillsAfter int64
	// WeightsChecksumBefore/After are the weight checksums reported by the source and destination.
	WeightsChecksumBefore, WeightsChecksumAfter string
	// MigrateOutput is berthctl migrate's stdout and stderr.
	MigrateOutput string
	// MigrateWall is the wall time of the berthctl migrate command.
	MigrateWall time.Duration
	// SourceStatus is the source task's status after the move ("" if it is gone).
	SourceStatus string
	// DestPID is the restored task's PID on the destination.
	DestPID uint32
	// GPUsBefore and GPUsAfter are the GPU UUIDs the workload reported on the source and on the
	// destination (GPU mode).
	GPUsBefore, GPUsAfter string
}

// Continuous reports whether every session continued exactly and nothing was recomputed.
func (r *InferenceReport) Continuous() bool {
	return r.MatchingSessions == len(r.Streams) && r.PrefillsAfter == r.PrefillsBefore &&
		r.WeightsChecksumBefore == r.WeightsChecksumAfter
}

// MoveInference runs the inference workload on src, streams o.Sessions sessions, moves the
// container to dst with `berthctl migrate` once every session received o.MoveAfter tokens, lets
// the sessions resume on dst, and compares every stream with an uninterrupted run.
func MoveInference(ctx context.Context, c *node.Cluster, src, dst *node.Node, o InferenceOptions) (*InferenceReport, error) {
	out := o.Out
	if out == nil {
		out = io.Discard
	}
	cfg := model.Config{WeightsMiB: o.WeightsMiB, Seed: 7}
	args := []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080",
		"-weights-mib", fmt.Sprint(o.WeightsMiB), "-seed", "7", "-delay-ms", fmt.Sprint(o.DelayMs)}
	ro := node.RunOptions{ID: o.ID, Image: image.WorkloadRef, Args: args, LogPath: filepath.Join(src.Dir, o.ID+".log")}
	if o.GPU {
		if src.GPU == nil {
			return nil, fmt.Errorf("node %s has no fake GPUs", src.Name)
		}
		devs, err := src.GPU.Devices()
		if err != nil || len(devs) == 0 {
			return nil, fmt.Errorf("fake GPUs of %s: %v", src.Name, err)
		}
		ro.GPUs = []string{devs[0].UUID}
		ro.Args = append(ro.Args, "-gpu")
	}
	pid, err := src.Run(ctx, ro)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "started %s on %s (pid %d, %d MiB of weights, GPU mode %v)\n", o.ID, src.Name, pid, o.WeightsMiB, o.GPU)
	srcT := client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := client.WaitReady(wctx, srcT, 100*time.Millisecond); err != nil {
		return nil, fmt.Errorf("workload on %s not ready: %w", src.Name, err)
	}
	before, err := client.Stats(ctx, srcT)
	if err != nil {
		return nil, err
	}

	rep := &InferenceReport{}
	var moveErr error
	destID := o.ID + "-moved"
	ss := streamSessions(ctx, srcT, o.Sessions, o.Tokens, o.MoveAfter)
	ss.waitPast()
	fmt.Fprintf(out, "%d sessions streaming, each past token %d: moving %s from %s to %s\n", o.Sessions, o.MoveAfter, o.ID, src.Name, dst.Name)
	cmdArgs := append([]string{"migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--root", dst.CheckpointRoot, "--id", destID, "--work-dir", filepath.Join(src.Dir, "outgoing"),
		"--log", filepath.Join(dst.Dir, destID+".log")}, o.MigrateArgs...)
	cmdArgs = append(cmdArgs, o.ID)
	var buf bytes.Buffer
	cmd := exec.CommandContext(ctx, c.Berthctl(), cmdArgs...)
	cmd.Stdout, cmd.Stderr = io.MultiWriter(&buf, out), io.MultiWriter(&buf, out)
	start := time.Now()
	moveErr = cmd.Run()
	rep.MigrateWall = time.Since(start)
	rep.MigrateOutput = buf.String()
	if moveErr != nil {
		moveErr = fmt.Errorf("berthctl %s: %w: %s", strings.Join(cmdArgs, " "), moveErr, buf.String())
	} else {
		rep.DestPID, _, moveErr = dst.TaskPID(ctx, destID)
	}
	dstT := client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(rep.DestPID))}
	err = ss.finish(dstT, moveErr)
	rep.Streams = ss.streams
	if err != nil {
		return rep, err
	}
	after, err := client.Stats(ctx, dstT)
	if err != nil {
		return rep, err
	}
	rep.PrefillsBefore, rep.PrefillsAfter = before.Prefills+int64(o.Sessions), after.Prefills
	rep.WeightsChecksumBefore, rep.WeightsChecksumAfter = before.WeightsChecksum, after.WeightsChecksum
	rep.GPUsBefore, rep.GPUsAfter = before.GPUs, after.GPUs
	if rep.Reference, rep.MatchingSessions, err = ss.compare(cfg, o.Tokens); err != nil {
		return rep, err
	}
	if _, st, err := src.TaskPID(ctx, o.ID); err == nil {
		rep.SourceStatus = string(st)
	}
	return rep, nil
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
