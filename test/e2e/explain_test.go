package e2e

// Moves that fail before they pause, restores that name their cause, and a killed move that
// never strands its source (issue 11, items 1, 2 and 5). Ids start with "xpl-".

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ctroci "github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// TestXplKilledMigrateSourceResumes SIGKILLs berthctl migrate while its source is paused (the
// receiver stalls), in stored mode once its checkpoint, the source's memory, lies in the work
// directory, and in copy mode while CRIU streams the memory to the stalled receiver: the source
// runs again (the shim resumes it by itself once the pause lease ends; stored: it removes that
// checkpoint with the lease; copy: the dump failed with the page stream) and nothing of the
// checkpoint is left in the work directory; a rerun meanwhile says how to see
// and resume the paused task (stored mode).
func TestXplKilledMigrateSourceResumes(t *testing.T) {
	c := needCluster(t)
	for _, mode := range []string{"stored", "copy"} {
		t.Run(mode, func(t *testing.T) { xplKilledMigrate(t, c, mode) })
	}
}

func xplKilledMigrate(t *testing.T, c *node.Cluster, mode string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	w := fltStart(t, ctx, src, "xpl-k-src-"+mode)
	const lease = 6 * time.Second
	work := t.TempDir()
	args := []string{"migrate", "--mode", mode, "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--root", dst.CheckpointRoot, "--id", "xpl-k-moved", "--work-dir", work, "--name", "xpl-k",
		"--receiver", fltFakeReceiver(t, 0, true), "--pause-lease", lease.String(), w.id}
	ev := fltWatch(t, ctx, src, w.id)
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, c.Berthctl(), args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	fltNoErr(t, cmd.Start())
	// the pause's event: in copy mode the shim answers no status while CRIU's dump waits on
	// the stalled page stream (fltEvents.waitFor)
	ev.waitFor(t, "/tasks/paused", 30*time.Second)
	if mode == "stored" {
		// killed once the source's checkpoint (its memory) is in the work directory
		pages := filepath.Join(work, "xpl-k", fltPages)
		for start := time.Now(); ; time.Sleep(50 * time.Millisecond) {
			if _, err := os.Stat(filepath.Join(work, "xpl-k", checkpoint.ManifestFile)); err == nil {
				break
			}
			if time.Since(start) > time.Minute {
				t.Fatalf("no checkpoint in %s a minute after the pause:\n%s", work, out.String())
			}
		}
		if fltFileSize(t, pages) < fltWeightsMiB<<20 {
			t.Fatalf("%s holds less than the workload's weights", pages)
		}
	} else {
		// CRIU streams the memory into the stalled receiver: killed while the dump waits on it
		time.Sleep(2 * time.Second)
		if slices.Contains(ev.seen(), "/tasks/resumed") {
			t.Fatalf("source resumed before migrate was killed:\n%s", out.String())
		}
	}
	fltNoErr(t, cmd.Process.Signal(syscall.SIGKILL))
	killed := time.Now()
	_ = cmd.Wait()

	if mode == "stored" {
		// a rerun while it is paused: refused before anything, saying how to resume it
		rerun, err := fltBerthctl(ctx, c, "migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
			"--root", dst.CheckpointRoot, "--id", "xpl-k-moved", "--work-dir", t.TempDir(), w.id)
		fltRequireErr(t, "migrate of a paused source", rerun, err, "task is paused", "tasks resume "+w.id, "pause lease")
	}

	deadline := killed.Add(lease + 15*time.Second)
	for {
		_, st, err := src.TaskPID(ctx, w.id)
		if err == nil && st == containerd.Running {
			t.Logf("source resumed %v after migrate was killed (lease %v)", time.Since(killed).Round(100*time.Millisecond), lease)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("source %s still %q %v after migrate was SIGKILLed with a %v pause lease", w.id, st, time.Since(killed), lease)
		}
		time.Sleep(100 * time.Millisecond)
	}
	w.requireServing(t, ctx)
	// the checkpoint the killed migrate left, the source's memory in stored mode, is gone
	for start := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(work, "xpl-k")); os.IsNotExist(err) {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Errorf("the killed migrate's checkpoint %s is still there %v after the source resumed: %v",
				filepath.Join(work, "xpl-k"), time.Since(start).Round(time.Millisecond), fltList(t, filepath.Join(work, "xpl-k")))
			break
		}
	}
	if left := fltList(t, dst.CheckpointRoot); len(left) > 0 {
		for _, l := range left {
			if strings.Contains(l, "xpl-k") {
				t.Errorf("destination checkpoint root holds %s after the killed migrate", l)
			}
		}
	}
}

// TestXplMigratePreflight: a destination that cannot take the container refuses before the
// source is paused, naming the field, the value and the limit (a bind source missing on the
// destination, an image the destination lacks); nothing is left on the destination.
func TestXplMigratePreflight(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	bindDir := t.TempDir()
	const id = "xpl-p-src"
	xplRun(t, ctx, src, id, bindDir, 0)
	// the destination is this host: the bind source goes away (a node that lacks it)
	fltNoErr(t, os.RemoveAll(bindDir))
	before := fltDstState(t, ctx, dst)
	ev := fltWatch(t, ctx, src, id)
	out, err := fltBerthctl(ctx, c, "migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--root", dst.CheckpointRoot, "--id", "xpl-p-moved", "--work-dir", t.TempDir(), "--name", "xpl-p", id)
	fltRequireErr(t, "migrate with a bind source missing on the destination", out, err,
		"nothing was paused", "mounts[", "(destination /xpl-data) is "+bindDir+" (missing), needs an existing path")
	ev.requireUntouched(t)
	fltRequireDstClean(t, ctx, dst, before, []string{"xpl-p-moved"}, "xpl-p")
}

// TestXplRemoteReceiverPreflight: with --receiver (a 'berthctl receive' on the destination
// node), the checks that need the destination host are answered by the receiver before the
// source is paused: a bind source missing there refuses the move, naming the field, the value
// and the limit; the source is never paused and nothing reaches the destination.
func TestXplRemoteReceiverPreflight(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	bindDir := t.TempDir()
	const id = "xpl-r-src"
	xplRun(t, ctx, src, id, bindDir, 0)
	fltNoErr(t, os.RemoveAll(bindDir)) // the receiving node lacks it
	rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
	before := fltDstState(t, ctx, dst)
	ev := fltWatch(t, ctx, src, id)
	out, err := fltBerthctl(ctx, c, "migrate", "--from", src.Socket, "--to", dst.Socket, "-n", node.Namespace,
		"--receiver", rcv.addr, "--id", "xpl-r-moved", "--work-dir", t.TempDir(), "--name", "xpl-r", id)
	fltRequireErr(t, "migrate to a receiver whose node lacks a bind source", out, err,
		"nothing was paused", "mounts[", "(destination /xpl-data) is "+bindDir+" (missing), needs an existing path")
	if strings.Contains(out, "warning:") {
		t.Errorf("the receiver did not answer the preflight:\n%s", out)
	}
	ev.requireUntouched(t)
	fltRequireDstClean(t, ctx, dst, before, []string{"xpl-r-moved"}, "xpl-r")
}

// TestXplCheckpointCheck: `berthctl checkpoint check` accepts a checkpoint the destination can
// take and refuses, field by field, one whose image it lacks (another namespace), then the shim
// itself refuses a restore under a memory limit below the checkpoint and one whose bind source
// is missing, before CRIU runs, naming the field, the value and the limit.
func TestXplCheckpointCheck(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	w := fltStart(t, ctx, src, "xpl-c-src")
	dir := fltMakeCheckpoint(t, ctx, w, dst, "xpl-c")

	out, err := fltBerthctl(ctx, c, "-n", node.Namespace, "checkpoint", "check", "--on", dst.Socket, "--root", dst.CheckpointRoot, dir)
	if err != nil || !strings.Contains(out, "ok: ") {
		t.Errorf("checkpoint check of a checkpoint the destination can take: %v\n%s", err, out)
	}
	archive := fltWriteArchive(t, dir, filepath.Join(t.TempDir(), "xpl-c.tar"))
	out, err = fltBerthctl(ctx, c, "-n", "xpl-elsewhere", "checkpoint", "check", "--on", dst.Socket, "--root", dst.CheckpointRoot, archive)
	fltRequireErr(t, "checkpoint check on a namespace without the image", out, err, "refused: ", "image is absent, needs "+image.WorkloadRef)

	// the shim's own refusals, before CRIU: memory limit, bind source
	err = xplRestoreWithSpec(t, ctx, dst, "xpl-c-mem", "xpl-c", ctroci.WithMemoryLimit(1<<20))
	fltRequireErr(t, "restore under a 1 MiB memory limit", errString(err), err,
		"linux.resources.memory.limit is 1048576 bytes, below the", "bytes of memory pages", "raise the limit to at least")
	missing := filepath.Join(t.TempDir(), "gone")
	err = xplRestoreWithSpec(t, ctx, dst, "xpl-c-bind", "xpl-c", ctroci.WithMounts([]specs.Mount{{Destination: "/xpl-data", Source: missing, Type: "bind", Options: []string{"rbind"}}}))
	fltRequireErr(t, "restore with a missing bind source", errString(err), err,
		"(destination /xpl-data): bind source "+missing, "no such file or directory", "create it on this node")
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// xplRun runs the workload as id on n with dir bind-mounted at /xpl-data.
func xplRun(t *testing.T, ctx context.Context, n *node.Node, id, dir string, _ int64) {
	t.Helper()
	_ = n.Remove(ctx, id)
	cl, err := n.Client()
	fltNoErr(t, err)
	defer cl.Close()
	ctx = namespaces.WithNamespace(ctx, node.Namespace)
	img, err := cl.GetImage(ctx, image.WorkloadRef)
	fltNoErr(t, err)
	ctr, err := cl.NewContainer(ctx, id, containerd.WithImage(img), containerd.WithNewSnapshot(id, img),
		containerd.WithRuntime(oci.RuntimeName, nil), containerd.WithNewSpec(ctroci.WithImageConfig(img),
			ctroci.WithProcessArgs(image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8"),
			ctroci.WithMounts([]specs.Mount{{Destination: "/xpl-data", Source: dir, Type: "bind", Options: []string{"rbind"}}})))
	fltNoErr(t, err)
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	task, err := ctr.NewTask(ctx, cio.NullIO)
	fltNoErr(t, err)
	fltNoErr(t, task.Start(ctx))
}

// xplRestoreWithSpec creates id on n restored from checkpoint name (berth.dev/restore-from) with
// the workload image's spec changed by opts, as a pod's spec would be, and returns the error of
// its task's creation or start; nothing of it is left.
func xplRestoreWithSpec(t *testing.T, ctx context.Context, n *node.Node, id, name string, opts ...ctroci.SpecOpts) error {
	t.Helper()
	_ = n.Remove(ctx, id)
	cl, err := n.Client()
	fltNoErr(t, err)
	defer cl.Close()
	ctx = namespaces.WithNamespace(ctx, node.Namespace)
	img, err := cl.GetImage(ctx, image.WorkloadRef)
	fltNoErr(t, err)
	all := append([]ctroci.SpecOpts{ctroci.WithImageConfig(img), ctroci.WithAnnotations(map[string]string{oci.AnnotationRestoreFrom: name})}, opts...)
	ctr, err := cl.NewContainer(ctx, id, containerd.WithImage(img), containerd.WithNewSnapshot(id, img),
		containerd.WithRuntime(oci.RuntimeName, nil), containerd.WithNewSpec(all...))
	fltNoErr(t, err)
	defer func() { _ = n.Remove(context.Background(), id) }()
	task, err := ctr.NewTask(ctx, cio.NullIO)
	if err != nil {
		return err
	}
	return task.Start(ctx)
}
