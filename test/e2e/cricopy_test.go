package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// TestCRICheckpointCopyMode is copy mode for a checkpoint the kubelet asks for, without the
// cluster's agents (whose image has no CRIU for the destination's page server): `berthctl
// send-pages` arms the source node's shim (its page_stream_dir) for the container and carries the
// pages to a `berthctl receive` with CRIU; then CRI CheckpointContainer (crictl checkpoint
// --export, what the kubelet checkpoint API calls) streams the memory through the shim's relay
// while it writes an archive without a page image (another crictl checkpoint before it, without
// the armed call's timeout, and a ctr one, without a deadline, are ordinary ones and leave the
// stream armed); `berthctl send` brings the archive to the same
// receiver, which adopts the pages once the digest the shim signed matches; a pod on the other
// node restored from it continues the session with identical tokens and no prefill recomputed.
func TestCRICheckpointCopyMode(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		if err := n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]); err != nil {
			t.Fatal(err)
		}
	}
	arm := filepath.Join(src.Dir, "page-streams-cricopy")
	if err := os.MkdirAll(arm, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(arm) })
	restore, err := src.AppendShimConfig("page_stream_dir = " + `"` + arm + `"` + "\n")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = restore() })
	dir := t.TempDir()
	rcv := fltStartReceive(t, ctx, c, dst.CheckpointRoot)
	const name = "cri-copy"
	t.Cleanup(func() { os.RemoveAll(filepath.Join(dst.CheckpointRoot, name)) })

	pod1 := criPod(t, ctx, src, dir, "cricopy-src", "default")
	cid := criContainer(t, ctx, src, dir, pod1, "cricopy-src", nil)
	if _, err := src.Crictl(ctx, "start", cid); err != nil {
		t.Fatal(err)
	}
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, src, cid))}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	first, err := client.Stream(ctx, st, client.Request{Session: "k", Prompt: "copy mode", N: 30})
	if err != nil {
		t.Fatal(err)
	}

	cpTimeout, err := checkpoint.NewCheckpointTimeout()
	if err != nil {
		t.Fatal(err)
	}
	sp := exec.CommandContext(ctx, c.Berthctl(), "send-pages", "--container", cid, "--name", name, "--dir", arm, "--expire", "60s", rcv.addr)
	sp.Stdin = strings.NewReader(strconv.FormatInt(cpTimeout, 10) + "\n")
	stdout, err := sp.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var spErr strings.Builder
	sp.Stderr = &spErr
	if err := sp.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "armed" {
		_ = sp.Wait()
		t.Fatalf("send-pages did not arm: %q %s", lines.Text(), spErr.String())
	}
	// another operator's checkpoint of the container while it is armed (crictl's own timeout,
	// not the armed one) is an ordinary one, page images included, and leaves the stream armed
	other := filepath.Join(dir, "other.tar")
	if out, err := src.Crictl(ctx, "checkpoint", "--export="+other, cid); err != nil {
		t.Fatalf("another crictl checkpoint while armed: %v %s", err, out)
	}
	if !slices.ContainsFunc(kubeTarNames(t, other), func(n string) bool { return strings.HasPrefix(path.Base(n), "pages-") }) {
		t.Errorf("another party's checkpoint while a page stream was armed holds no page image: it took the stream")
	}
	// and so is one through containerd's API, which carries no deadline at all (ctr)
	imgs := filepath.Join(dir, "ctr-images")
	if out, err := src.Ctr(ctx, "-n", "k8s.io", "tasks", "checkpoint", "--image-path", imgs, cid); err != nil {
		t.Fatalf("ctr tasks checkpoint while armed: %v %s", err, out)
	}
	if got, _ := filepath.Glob(filepath.Join(imgs, "pages-*.img")); len(got) == 0 {
		t.Errorf("a ctr checkpoint while a page stream was armed holds no page image in %s: it took the stream", imgs)
	}
	// ctr leaves a checkpoint image (containerd.io/checkpoint/ID:TIME, to the second) for a
	// runtime other than runc's; the CRI checkpoint below, within the same second, would collide
	if out, err := src.Ctr(ctx, "-n", "k8s.io", "images", "ls", "-q"); err == nil {
		for _, ref := range strings.Fields(out) {
			if strings.HasPrefix(ref, "containerd.io/checkpoint/"+cid+":") {
				_, _ = src.Ctr(ctx, "-n", "k8s.io", "images", "rm", "--sync", ref)
			}
		}
	}
	if _, err := os.Stat(filepath.Join(arm, cid+".json")); err != nil {
		t.Errorf("the armed request after other parties' checkpoints: %v", err)
	}
	archive := filepath.Join(dir, name+".tar")
	// the checkpoint call the stream was armed for: its timeout (the kubelet API's ?timeout=)
	if out, err := src.Crictl(ctx, fmt.Sprintf("--timeout=%ds", cpTimeout), "checkpoint", "--export="+archive, cid); err != nil {
		t.Fatalf("crictl checkpoint: %v %s", err, out)
	}
	var sent struct{ Bytes int64 }
	var result strings.Builder // the JSON result, over several lines
	for lines.Scan() {
		result.WriteString(lines.Text() + "\n")
	}
	if err := json.Unmarshal([]byte(result.String()), &sent); err != nil {
		t.Errorf("send-pages result: %v: %q", err, result.String())
	}
	if err := sp.Wait(); err != nil {
		t.Fatalf("send-pages: %v %s", err, spErr.String())
	}
	if sent.Bytes < 16<<20 {
		t.Errorf("page stream of %d bytes; want the 16 MiB of weights at least", sent.Bytes)
	}
	var pages []string
	for _, n := range kubeTarNames(t, archive) {
		if strings.HasPrefix(path.Base(n), "pages-") {
			pages = append(pages, n)
		}
	}
	if len(pages) > 0 {
		t.Errorf("the CRI archive holds page images in copy mode: %v", pages)
	}
	if fi, err := os.Stat(archive); err == nil {
		t.Logf("copy mode: %.1f MiB of pages streamed, the CRI archive %.1f MiB", float64(sent.Bytes)/(1<<20), float64(fi.Size())/(1<<20))
	}
	if ents, _ := os.ReadDir(arm); len(ents) != 0 {
		t.Errorf("left in the page stream directory: %v", ents)
	}
	if out, err := src.Crictl(ctx, "stop", "-t", "0", cid); err != nil {
		t.Fatalf("stop source: %v %s", err, out)
	}
	if out, err := fltBerthctl(ctx, c, "send", "--name", name, archive, rcv.addr); err != nil {
		t.Fatalf("berthctl send: %v\n%s", err, out)
	}
	if got, _ := filepath.Glob(filepath.Join(dst.CheckpointRoot, name, "checkpoint", "pages-*.img")); len(got) == 0 {
		t.Fatalf("the received checkpoint holds no page images: the page stream was not adopted")
	}

	pod2 := criPod(t, ctx, dst, dir, "cricopy-dst", "default")
	rid := criContainer(t, ctx, dst, dir, pod2, "cricopy-dst", map[string]string{"berth.dev/restore-from": name})
	if out, err := dst.Crictl(ctx, "start", rid); err != nil {
		t.Fatalf("start restored container: %v %s", err, out)
	}
	rt := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(criPID(t, ctx, dst, rid))}
	rest, err := client.Stream(ctx, rt, client.Request{Session: "k", N: 60, From: 30})
	if err != nil {
		t.Fatal(err)
	}
	ref, err := model.Reference(model.Config{WeightsMiB: 16, Seed: 1}, "copy mode", 60)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(append(first, rest...), " "), strings.Join(model.Words(ref), " "); got != want {
		t.Errorf("session across the copy-mode CRI move:\n got %s\nwant %s", got, want)
	}
	if s, err := client.Stats(ctx, rt); err != nil || s.Prefills != 1 {
		t.Errorf("restored container counts %d prefills (%v), want 1", s.Prefills, err)
	}
	_, _ = dst.Crictl(ctx, "stop", "-t", "0", rid)
	_, _ = dst.Crictl(ctx, "rm", rid)
}

// TestCRICheckpointCopyModeReceiverKilled breaks TestCRICheckpointCopyMode's page stream: the
// receiver is killed once 16 MiB of a 256 MiB container's pages arrived. The CRI checkpoint fails,
// the container runs on (same process, still serving), send-pages ends, nothing stays armed, and
// a receiver started again on the same root leaves nothing there.
func TestCRICheckpointCopyModeReceiverKilled(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src := c.Nodes[0]
	if err := src.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]); err != nil {
		t.Fatal(err)
	}
	arm := filepath.Join(src.Dir, "page-streams-cricopy-killed")
	if err := os.MkdirAll(arm, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(arm) })
	restore, err := src.AppendShimConfig("page_stream_dir = " + `"` + arm + `"` + "\n")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = restore() })
	dir, root := t.TempDir(), t.TempDir()
	rcv := fltStartReceive(t, ctx, c, root)

	pod := criPod(t, ctx, src, dir, "cricopyk-src", "default")
	cfg := fmt.Sprintf(`{"metadata": {"name": "infer"}, "image": {"image": %q},
 "command": [%q, "-listen", "127.0.0.1:8080", "-weights-mib", "256", "-delay-ms", "0"],
 "log_path": "infer.log", "linux": {"security_context": {"namespace_options": {"pid": 1}}}}`, image.WorkloadRef, image.WorkloadBinary)
	cfgPath := filepath.Join(dir, "cricopyk-ctr.json")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	cid, err := src.Crictl(ctx, "create", pod, cfgPath, filepath.Join(dir, "cricopyk-src.json"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Crictl(ctx, "start", cid); err != nil {
		t.Fatal(err)
	}
	pid := criPID(t, ctx, src, cid)
	st := client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(pid)}
	if err := client.WaitReady(ctx, st, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}

	cpTimeout, err := checkpoint.NewCheckpointTimeout()
	if err != nil {
		t.Fatal(err)
	}
	sp := exec.CommandContext(ctx, c.Berthctl(), "send-pages", "--container", cid, "--name", "cri-copy-killed", "--dir", arm, "--expire", "60s", rcv.addr)
	sp.Stdin = strings.NewReader(strconv.FormatInt(cpTimeout, 10) + "\n")
	stdout, err := sp.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var spErr strings.Builder
	sp.Stderr = &spErr
	if err := sp.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "armed" {
		_ = sp.Wait()
		t.Fatalf("send-pages did not arm: %q %s", lines.Text(), spErr.String())
	}
	killed := make(chan bool, 1)
	go func() {
		for ctx.Err() == nil && pagesReceived(root) < 16<<20 {
			time.Sleep(5 * time.Millisecond)
		}
		rcv.kill()
		killed <- ctx.Err() == nil
	}()
	out, err := src.Crictl(ctx, fmt.Sprintf("--timeout=%ds", cpTimeout), "checkpoint", "--export="+filepath.Join(dir, "killed.tar"), cid)
	if !<-killed {
		t.Fatalf("the receiver was not killed mid-stream; checkpoint: %v %s", err, out)
	}
	t.Logf("crictl checkpoint with its receiver killed mid page stream: %v", err)
	if err == nil {
		t.Errorf("crictl checkpoint succeeded although its page stream was cut")
	}
	_, _ = io.Copy(io.Discard, stdout)
	_ = sp.Wait() // it ends either way; its verdict is the shim's and the receiver's
	t.Logf("send-pages: %s", strings.TrimSpace(spErr.String()))
	if state, err := src.Crictl(ctx, "inspect", "-o", "go-template", "--template", "{{.status.state}}", cid); err != nil || state != "CONTAINER_RUNNING" {
		t.Errorf("source after the failed checkpoint: %q %v", state, err)
	}
	if now := criPID(t, ctx, src, cid); now != pid {
		t.Errorf("source pid %d after the failed checkpoint, was %d", now, pid)
	}
	if _, err := client.Stats(ctx, st); err != nil {
		t.Errorf("source workload after the failed checkpoint: %v", err)
	}
	if ents, _ := os.ReadDir(arm); len(ents) != 0 {
		t.Errorf("left in the page stream directory: %v", ents)
	}
	again := fltStartReceive(t, ctx, c, root) // removes what the killed one left
	again.kill()
	if ents, _ := os.ReadDir(root); len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("left in the receiver's root: %v", names)
	}
}
