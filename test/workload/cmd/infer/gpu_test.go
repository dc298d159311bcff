package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
	"github.com/berth-dev/berth/test/workload/server"
)

// TestRunGPUMoves runs infer -gpu on a fake GPU of "node 1", checkpoints its device memory through
// the shim's driver, moves it to another GPU of "node 2" (by repointing the device directory, as
// the restored container's bind mount would) and checks that the stream continues exactly as an
// uninterrupted run.
func TestRunGPUMoves(t *testing.T) {
	spec := func(u string) fake.NodeSpec {
		return fake.NodeSpec{Driver: "580.65.06", CUDA: "12.8", GPUs: []fake.GPUSpec{{UUID: u, Name: "Fake H200", MemoryBytes: 1 << 30}}}
	}
	n1, err := fake.Setup(t.TempDir(), spec("GPU-one"))
	if err != nil {
		t.Fatal(err)
	}
	n2, err := fake.Setup(t.TempDir(), spec("GPU-two"))
	if err != nil {
		t.Fatal(err)
	}
	d1, _ := n1.Dir("GPU-one")
	d2, _ := n2.Dir("GPU-two")
	devRoot := filepath.Join(t.TempDir(), "berth-gpu")
	if err := os.Mkdir(devRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(d1, filepath.Join(devRoot, "0")); err != nil {
		t.Fatal(err)
	}
	sockDir, err := os.MkdirTemp("", "fc")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sockDir)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-listen", "127.0.0.1:0", "-weights-mib", "8", "-seed", "5", "-vocab", "99", "-delay-ms", "0",
			"-gpu", "-gpu-dev-root", devRoot, "-gpu-socket-dir", sockDir}, pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("read ready line: %v (run: %v)", err, <-done)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	fields := map[string]string{}
	for _, f := range strings.Fields(line)[2:] {
		k, v, _ := strings.Cut(f, "=")
		fields[k] = v
	}
	cfg := model.Config{WeightsMiB: 8, Seed: 5, VocabSize: 99}
	sum, _ := model.WeightsChecksum(cfg)
	if fields["gpus"] != "GPU-one" || fields["checksum"] != model.FormatChecksum(sum) {
		t.Fatalf("ready line %q", line)
	}
	want, err := model.Reference(cfg, "p", 60)
	if err != nil {
		t.Fatal(err)
	}
	target := client.Target{BaseURL: fields["listen"]}
	got, err := client.Stream(ctx, target, client.Request{Session: "main", Prompt: "p", N: 20})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, model.Words(want[:20])) {
		t.Fatalf("GPU stream differs from reference")
	}
	stats := func() server.Stats {
		t.Helper()
		resp, err := http.Get("http://" + strings.TrimPrefix(fields["listen"], "http://") + "/stats")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var st server.Stats
		if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := stats(); !st.GPU || st.GPUs != "GPU-one" || st.WeightsChecksum != model.FormatChecksum(sum) {
		t.Fatalf("stats %+v", st)
	}
	if devs, _ := n1.Devices(); devs[0].MemoryUsed < 8<<20 {
		t.Fatalf("weights are not in device memory: %d bytes used", devs[0].MemoryUsed)
	}

	drv := &fake.Driver{Node: n2, SocketDir: sockDir}
	pid := os.Getpid()
	if err := drv.Lock(pid, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := drv.Checkpoint(pid); err != nil {
		t.Fatal(err)
	}
	if devs, _ := n1.Devices(); devs[0].MemoryUsed != 0 {
		t.Fatalf("node 1 still holds %d bytes after checkpoint", devs[0].MemoryUsed)
	}
	// While checkpointed, generation blocks: a stream gets nothing.
	sctx, scancel := context.WithTimeout(ctx, 200*time.Millisecond)
	if _, err := client.Stream(sctx, target, client.Request{Session: "main", N: 21, From: 20}); err == nil {
		t.Errorf("stream while checkpointed succeeded")
	}
	scancel()
	// Move to node 2.
	if err := os.Remove(filepath.Join(devRoot, "0")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(d2, filepath.Join(devRoot, "0")); err != nil {
		t.Fatal(err)
	}
	if err := drv.Unlock(pid); err == nil {
		t.Fatalf("unlock before restore succeeded")
	}
	if err := drv.Restore(pid, []gpu.UUIDPair{{Old: "GPU-one", New: "GPU-two"}}); err != nil {
		t.Fatal(err)
	}
	if err := drv.Unlock(pid); err != nil {
		t.Fatal(err)
	}
	if devs, _ := n2.Devices(); devs[0].MemoryUsed < 8<<20 {
		t.Fatalf("node 2 holds only %d bytes after restore", devs[0].MemoryUsed)
	}
	got, err = client.Stream(ctx, target, client.Request{Session: "main", N: 60})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, model.Words(want)) {
		t.Fatalf("stream after the move differs from reference")
	}
	if st := stats(); !st.GPU || st.GPUs != "GPU-two" || st.WeightsChecksum != model.FormatChecksum(sum) {
		t.Fatalf("stats after the move %+v", st)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run after cancel: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("run did not return after cancel")
	}
	if f, _ := filepath.Glob(filepath.Join(d2, fakecuda.MemPrefix+"*")); len(f) != 0 {
		t.Errorf("device memory left after exit: %v", f)
	}
}
