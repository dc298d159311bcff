package e2e

// Restores that CRIU itself fails, on the real stack (issue 11, item 1): the error names the
// cause in one sentence with the fix, CRIU's restore log is kept where the error says, the
// checkpoint is left intact and nothing is half-created. Ids start with "xcc-".

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ctroci "github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/transfer"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestXccOpenShmFile: a container that shares the host's /dev/shm (a pod with hostIPC: its
// /dev/shm is no part of the container, so the shim does not carry it) holds a file there open;
// on a node without that file CRIU cannot reopen it. The restore says so with the fix, keeps
// CRIU's log, leaves the checkpoint intact and creates nothing; with the file back (control) the
// same checkpoint restores.
func TestXccOpenShmFile(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	shm := fmt.Sprintf("/dev/shm/xcc-shm-%d", os.Getpid())
	fltNoErr(t, os.WriteFile(shm, []byte("segment"), 0o600))
	t.Cleanup(func() { os.Remove(shm) })
	xccRun(t, ctx, src, "xcc-s-src", []string{"sh", "-c", "exec 3<>" + shm + "; exec sleep 100000"}, xccHostShm)
	dir, _ := xccCheckpoint(t, ctx, src, "xcc-s-src", dst, "xcc-s")
	sums := fltDigests(t, dir)
	fltNoErr(t, src.Remove(ctx, "xcc-s-src"))
	fltNoErr(t, os.Remove(shm)) // the destination's /dev/shm lacks it
	// without the mount, the restore is refused before anything is created, naming it
	out, err := gfltRestore(t, ctx, c, dst, "xcc-s-nomount", "xcc-s")
	fltRequireErr(t, "restore without the checkpoint's bind mount", out, err,
		"--mount type=bind,src=/dev/shm,dst=/dev/shm,options=rbind:rw")

	// the destination gives the host's /dev/shm too (a restore takes no mount from a checkpoint)
	hostShm := []string{"--mount", "type=bind,src=/dev/shm,dst=/dev/shm,options=rbind:rw"}
	out, err = gfltRestore(t, ctx, c, dst, "xcc-s-r", "xcc-s", hostShm...)
	fltRequireErr(t, "restore of a process holding a /dev/shm file the node lacks", out, err,
		"the checkpointed process holds "+shm+" open, and this container's /dev/shm has no such file",
		"have the workload keep no file open on /dev/shm when it is checkpointed",
		"CRIU says: ", "Can't open file "+strings.TrimPrefix(shm, "/")+": No such file or directory")
	xccRequireFailed(t, ctx, dst, "xcc-s-r", out, dir, sums, "Can't open file "+strings.TrimPrefix(shm, "/"), true)

	// control: with the file back, the same checkpoint restores
	fltNoErr(t, os.WriteFile(shm, []byte("segment"), 0o600))
	if out, err := gfltRestore(t, ctx, c, dst, "xcc-s-ok", "xcc-s", hostShm...); err != nil {
		t.Fatalf("control: restore with %s in place: %v\n%s", shm, err, out)
	}
}

// xccHostShm makes the container's /dev/shm the host's (as a pod with hostIPC has it).
func xccHostShm(_ context.Context, _ ctroci.Client, _ *containers.Container, s *specs.Spec) error {
	for i, m := range s.Mounts {
		if m.Destination == "/dev/shm" {
			s.Mounts[i] = specs.Mount{Destination: "/dev/shm", Source: "/dev/shm", Type: "bind", Options: []string{"rbind", "rw"}}
		}
	}
	return nil
}

// TestXccPIDInUse: a container that joined another's PID namespace (a pod's shared PID
// namespace) is restored into that namespace while its source still runs there, so its PID is
// taken: CRIU cannot create the process. The restore says which PID and the fix, keeps CRIU's
// log, leaves the checkpoint intact and creates nothing; once the source is gone (control) the
// same checkpoint restores into the namespace.
func TestXccPIDInUse(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	sleep := []string{"sleep", "100000"}
	holder := xccRun(t, ctx, src, "xcc-p-ns", sleep)
	pidns := fmt.Sprintf("/proc/%d/ns/pid", holder)
	srcPID := xccRun(t, ctx, src, "xcc-p-src", sleep, ctroci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.PIDNamespace, Path: pidns}))
	nsPID := xccNSPid(t, srcPID)
	dir, _ := xccCheckpoint(t, ctx, src, "xcc-p-src", dst, "xcc-p")
	sums := fltDigests(t, dir)

	// as a pod's container that shares its pod's PID namespace is created (berthctl restore does
	// not join a PID namespace by path: it would not exist on another node)
	joinNS := ctroci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.PIDNamespace, Path: pidns})
	err := xccRestoreWithSpec(t, ctx, dst, "xcc-p-r", "xcc-p", joinNS)
	fltRequireErr(t, "restore into a shared PID namespace where the checkpoint's PID is taken", errString(err), err,
		fmt.Sprintf("PID %d of the checkpoint is already taken in the PID namespace the container joins", nsPID),
		"restore into a container with a PID namespace of its own",
		"CRIU says: ", fmt.Sprintf("Can't fork for %d: File exists", nsPID))
	xccRequireFailed(t, ctx, dst, "xcc-p-r", errString(err), dir, sums, fmt.Sprintf("Can't fork for %d", nsPID), false)
	if err != nil && !errdefs.IsFailedPrecondition(err) {
		t.Errorf("error class: %v, want FailedPrecondition", err)
	}

	// control: with the source gone, its PID is free and the same checkpoint restores there
	fltNoErr(t, src.Remove(ctx, "xcc-p-src"))
	if err := xccRestoreWithSpec(t, ctx, dst, "xcc-p-ok", "xcc-p", joinNS); err != nil {
		t.Fatalf("control: restore with PID %d free: %v", nsPID, err)
	}
}

// xccNSPid returns the PID that process pid (in the host's PID namespace) has in its own PID
// namespace (the last NSpid of /proc/PID/status).
func xccNSPid(t *testing.T, pid uint32) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	fltNoErr(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "NSpid:" {
			n, err := strconv.Atoi(f[len(f)-1])
			fltNoErr(t, err)
			return n
		}
	}
	t.Fatalf("/proc/%d/status has no NSpid", pid)
	return 0
}

// TestXccOOMUnderLimit: a memory limit equal to the checkpoint's pages passes the shim's own
// check (it refuses only a limit below them), but runc puts CRIU into the container's cgroup
// while it restores, and CRIU needs more than the pages: the cgroup's OOM killer kills either
// the process CRIU is restoring (CRIU logs "killed by signal 9", seen with 64 MiB of weights) or
// CRIU itself (its log ends without its verdict and runc reads EOF, seen with 8 MiB). Either way
// the restore says so with the limit, the pages and the limit to set, keeps CRIU's log, leaves
// the checkpoint intact and creates nothing; under the advised limit (control) it restores.
func TestXccOOMUnderLimit(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, mib := range []int{8, 64} {
		id, name := fmt.Sprintf("xcc-m%d-src", mib), fmt.Sprintf("xcc-m%d", mib)
		xccStartWorkload(t, ctx, src, id, mib)
		dir, need := xccCheckpoint(t, ctx, src, id, dst, name)
		sums := fltDigests(t, dir)
		fltNoErr(t, src.Remove(ctx, id))
		if need < int64(mib)<<20 {
			t.Fatalf("checkpoint %s holds %d bytes of pages, want the workload's %d MiB of weights in them", name, need, mib)
		}

		rid := name + "-r"
		err := xccRestoreWithSpec(t, ctx, dst, rid, name, ctroci.WithMemoryLimit(uint64(need)))
		fltRequireErr(t, fmt.Sprintf("restore of %s under a memory limit equal to its pages", name), errString(err), err,
			"killed", "the cgroup's OOM killer",
			fmt.Sprintf("linux.resources.memory.limit) is %d bytes, not enough above the %d bytes of memory pages", need, need),
			fmt.Sprintf("raise the limit to at least %d bytes", need+16<<20), "CRIU says: ")
		xccRequireFailed(t, ctx, dst, rid, errString(err), dir, sums, "Error (", false)
		if err != nil && !errdefs.IsResourceExhausted(err) {
			t.Errorf("error class: %v, want ResourceExhausted", err)
		}

		// control: under the limit the error advises, the same checkpoint restores
		if err := xccRestoreWithSpec(t, ctx, dst, name+"-ok", name, ctroci.WithMemoryLimit(uint64(need+16<<20))); err != nil {
			t.Fatalf("control: restore of %s under the advised limit: %v", name, err)
		}
		fltNoErr(t, dst.Remove(ctx, name+"-ok"))
	}
}

// xccStartWorkload runs the inference workload as id on n with mib MiB of weights and waits
// until it serves (its weights are then in its memory).
func xccStartWorkload(t *testing.T, ctx context.Context, n *node.Node, id string, mib int) {
	t.Helper()
	_ = n.Remove(ctx, id)
	pid, err := n.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef, LogPath: filepath.Join(n.Dir, id+".log"),
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", strconv.Itoa(mib)}})
	fltNoErr(t, err)
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := client.WaitReady(wctx, client.Target{BaseURL: "http://127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}, 50*time.Millisecond); err != nil {
		t.Fatalf("workload %s not ready: %v", id, err)
	}
}

// xccRestoreWithSpec is xplRestoreWithSpec that also checks, after a failed start, that the
// shim left no task and no runc state of id behind, before it removes the container.
func xccRestoreWithSpec(t *testing.T, ctx context.Context, n *node.Node, id, name string, opts ...ctroci.SpecOpts) error {
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
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	task, err := ctr.NewTask(ctx, cio.NullIO)
	if err != nil {
		return err
	}
	if err = task.Start(ctx); err == nil {
		return nil
	}
	// containerd's client deletes nothing after a failed Start: the caller deletes the task
	if st, serr := task.Status(ctx); serr == nil && st.Status == containerd.Running {
		t.Errorf("task %s is running after its failed restore", id)
	}
	if _, derr := task.Delete(ctx, containerd.WithProcessKill); derr != nil && !errdefs.IsNotFound(derr) {
		t.Errorf("delete task %s after its failed restore: %v", id, derr)
	}
	return err
}

// xccRequireFailed checks what a failed restore of id from checkpoint dir left: the error (out)
// names where CRIU's restore log is kept, that file exists and holds logLine; the checkpoint
// still verifies with the digests sums it had; no task, container or runc state of id is left
// on n (no container either when berthctl restore made it: viaBerthctl).
func xccRequireFailed(t *testing.T, ctx context.Context, n *node.Node, id, out, dir string, sums map[string]string, logLine string, viaBerthctl bool) {
	t.Helper()
	m := regexp.MustCompile(`CRIU's restore log is kept at (\S+);`).FindStringSubmatch(out)
	if m == nil {
		t.Errorf("restore %s: the error does not say where CRIU's restore log is kept:\n%s", id, out)
	} else if b, err := os.ReadFile(m[1]); err != nil {
		t.Errorf("restore %s: CRIU's kept restore log: %v", id, err)
	} else if !strings.Contains(string(b), logLine) {
		t.Errorf("restore %s: CRIU's kept restore log %s does not say %q", id, m[1], logLine)
	} else if want := dir + ".restore-" + id + ".log"; m[1] != want {
		t.Errorf("restore %s: log kept at %s, want beside the checkpoint at %s", id, m[1], want)
	}
	gfltRequireIntact(t, dir, sums)
	if _, st, err := n.TaskPID(ctx, id); err == nil {
		t.Errorf("restore %s: a task (%s) is left on %s", id, st, n.Name)
	}
	if _, err := os.Stat(filepath.Join(fltRuncRoot, node.Namespace, id)); err == nil {
		t.Errorf("restore %s: runc state left on %s", id, n.Name)
	}
	if ids, err := n.Containers(ctx); err == nil && slices.Contains(ids, id) && viaBerthctl {
		// berthctl restore removes the container it made; a client's own container stays its own
		t.Errorf("restore %s: container left on %s", id, n.Name)
	}
}

// xccRun runs a container id on n from the workload image with args and spec changes opts, and
// returns its init's PID (in the host's PID namespace). The container is removed at cleanup.
func xccRun(t *testing.T, ctx context.Context, n *node.Node, id string, args []string, opts ...ctroci.SpecOpts) uint32 {
	t.Helper()
	_ = n.Remove(ctx, id)
	cl, err := n.Client()
	fltNoErr(t, err)
	defer cl.Close()
	ctx = namespaces.WithNamespace(ctx, node.Namespace)
	img, err := cl.GetImage(ctx, image.WorkloadRef)
	fltNoErr(t, err)
	all := append([]ctroci.SpecOpts{ctroci.WithImageConfig(img), ctroci.WithProcessArgs(args...)}, opts...)
	ctr, err := cl.NewContainer(ctx, id, containerd.WithImage(img), containerd.WithNewSnapshot(id, img),
		containerd.WithRuntime(oci.RuntimeName, nil), containerd.WithNewSpec(all...))
	fltNoErr(t, err)
	t.Cleanup(func() { _ = n.Remove(context.Background(), id) })
	task, err := ctr.NewTask(ctx, cio.NullIO)
	fltNoErr(t, err)
	fltNoErr(t, task.Start(ctx))
	return task.Pid()
}

// xccCheckpoint checkpoints id on n (signed with n's key, the task resumed) and stores it in
// dst's checkpoint root as name; it returns its path there and the memory it holds
// (Manifest.MemoryBytes).
func xccCheckpoint(t *testing.T, ctx context.Context, n *node.Node, id string, dst *node.Node, name string) (string, int64) {
	t.Helper()
	cl, err := n.Client()
	fltNoErr(t, err)
	defer cl.Close()
	dir := filepath.Join(t.TempDir(), name)
	ck, err := move.Checkpoint(ctx, cl, move.CheckpointOptions{Namespace: node.Namespace, ID: id, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.Sign(ctx, dir); err != nil {
		t.Fatal(err)
	}
	fltNoErr(t, ck.Resume(namespaces.WithNamespace(ctx, node.Namespace)))
	done := make(chan error, 1)
	addr := fltInProcessReceiver(t, ctx, dst.CheckpointRoot, done)
	conn, err := net.Dial("tcp", addr)
	fltNoErr(t, err)
	defer conn.Close()
	res, err := transfer.Send(ctx, conn, dir, name, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.RemoveAll(res.Path)
		logs, _ := filepath.Glob(res.Path + ".restore-*.log")
		for _, l := range logs {
			os.Remove(l)
		}
	})
	return res.Path, ck.Manifest.MemoryBytes()
}
