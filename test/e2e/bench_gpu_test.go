package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// BenchmarkGPUOverhead measures what berth's GPU steps add to a move: the same workload with its
// weights and KV caches in host memory, and in (fake) device memory, moved with berthctl migrate
// in one run; the checkpoint and restore times and their ratios are printed (never asserted).
// Size: BERTH_BENCH_GPU_MIB (default 1024, MiB of device memory).
func BenchmarkGPUOverhead(b *testing.B) {
	c := needCluster(b)
	mib := 1024
	if v := os.Getenv("BERTH_BENCH_GPU_MIB"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			b.Fatalf("BERTH_BENCH_GPU_MIB=%q: want MiB > 0", v)
		}
		mib = n
	}
	needResources(b, c, mib)
	src, dst := c.Nodes[0], c.Nodes[1]
	devs, err := src.GPU.Devices()
	if err != nil || len(devs) == 0 {
		b.Fatalf("fake GPUs of %s: %v", src.Name, err)
	}
	ctx := context.Background()
	work := b.TempDir()
	type result struct {
		wall                time.Duration
		checkpoint, restore time.Duration
		phases              []phase
	}
	run := func(gpuMode bool) result {
		id := fmt.Sprintf("bgpu-%v-%d", gpuMode, mib)
		destID := id + "-moved"
		ro := node.RunOptions{ID: id, Image: image.WorkloadRef, Args: inferArgs(mib), LogPath: filepath.Join(src.Dir, id+".log")}
		if gpuMode {
			ro.GPUs = []string{devs[0].UUID}
			ro.Args = append(ro.Args, "-gpu")
		}
		pid, err := src.Run(ctx, ro)
		if err != nil {
			b.Fatal(err)
		}
		defer func() {
			_ = src.Remove(context.Background(), id)
			_ = dst.Remove(context.Background(), destID)
			os.RemoveAll(filepath.Join(dst.CheckpointRoot, id+"-ckpt"))
		}()
		if err := waitHealthz(ctx, pid, 3*time.Minute); err != nil {
			b.Fatal(err)
		}
		wall, _, phases, _ := benchMigrate(ctx, b, c, src, dst, id, destID, id+"-ckpt", work)
		return result{wall: wall, checkpoint: phaseOf(phases, "checkpoint"), restore: phaseOf(phases, "restore"), phases: phases}
	}
	b.ResetTimer()
	host := run(false)
	dev := run(true)
	b.StopTimer()
	ratio := func(a, b time.Duration) float64 { return float64(a) / float64(b) }
	var steps []string
	for _, p := range dev.phases {
		if strings.Contains(p.name, "gpu-") {
			steps = append(steps, fmt.Sprintf("%s %d", p.name, p.d.Milliseconds()))
		}
	}
	fmt.Printf("\nGPU steps on a move of %d MiB (one run; fake GPU: device memory is a node-local file mapping)\n", mib)
	fmt.Printf("| | host memory | device memory | device/host |\n|---|---|---|---|\n")
	fmt.Printf("| checkpoint | %d ms | %d ms | %.2f |\n", host.checkpoint.Milliseconds(), dev.checkpoint.Milliseconds(), ratio(dev.checkpoint, host.checkpoint))
	fmt.Printf("| restore | %d ms | %d ms | %.2f |\n", host.restore.Milliseconds(), dev.restore.Milliseconds(), ratio(dev.restore, host.restore))
	fmt.Printf("| migrate wall | %d ms | %d ms | %.2f |\n", host.wall.Milliseconds(), dev.wall.Milliseconds(), ratio(dev.wall, host.wall))
	fmt.Printf("GPU steps (ms): %s\n", strings.Join(steps, ", "))
	b.ReportMetric(ratio(dev.checkpoint, host.checkpoint), "checkpoint-gpu/host")
	b.ReportMetric(ratio(dev.restore, host.restore), "restore-gpu/host")
}
