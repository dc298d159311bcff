package plugin_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"

	"github.com/berth-dev/berth/nri/plugin"
	"github.com/berth-dev/berth/oci"
)

func benchContainer(id string, gpus, cpus int, sharedMilli int64) (*api.PodSandbox, *api.Container) {
	pod := &api.PodSandbox{Id: "pod-" + id, Name: "pod-" + id, Namespace: "bench"}
	c := &api.Container{Id: id, Name: "main", Annotations: map[string]string{},
		Linux: &api.LinuxContainer{Resources: &api.LinuxResources{Cpu: &api.LinuxCPU{}}}}
	if gpus > 0 {
		c.Annotations[oci.AnnotationGPUs] = fmt.Sprint(gpus)
	}
	cpu := c.Linux.Resources.Cpu
	switch {
	case cpus > 0:
		cpu.Period, cpu.Quota, cpu.Shares = api.UInt64(uint64(100000)), api.Int64(int64(cpus)*100000), api.UInt64(uint64(cpus)*1024)
	case sharedMilli > 0:
		cpu.Period, cpu.Quota, cpu.Shares = api.UInt64(uint64(100000)), api.Int64(sharedMilli*100), api.UInt64(uint64(sharedMilli)*1024/1000/2)
	}
	return pod, c
}

// loadedPlugin returns a plugin on the DGX H100 model (8 GPUs, 2 sockets, 224 CPUs) holding 200
// running containers: 7 with one GPU and 4 exclusive CPUs, 100 with 1 exclusive CPU, 93 shared.
func loadedPlugin(tb testing.TB) *plugin.Plugin {
	p, err := plugin.New(cfg(), dgxNode, plugin.WithDeviceInfo(fakeDevices))
	if err != nil {
		tb.Fatal(err)
	}
	ctx := context.Background()
	for i := range 200 {
		var pod *api.PodSandbox
		var c *api.Container
		switch {
		case i < 7:
			pod, c = benchContainer(fmt.Sprint("gpu-", i), 1, 4, 0)
		case i < 107:
			pod, c = benchContainer(fmt.Sprint("excl-", i), 0, 1, 0)
		default:
			pod, c = benchContainer(fmt.Sprint("shared-", i), 0, 0, 500)
		}
		if _, _, err := p.CreateContainer(ctx, pod, c); err != nil {
			tb.Fatalf("container %d: %v", i, err)
		}
	}
	return p
}

// TestCreateContainerLatency measures CreateContainer's decision latency (request parsing, the
// policy decision, the adjustment and the shared-pool updates, everything but the NRI transport)
// on the DGX H100 model with 200 running containers, for three kinds of request, and prints
// p50/p99. Each measured container is stopped and removed again (not measured) so the node stays
// at 200. It fails only when a CreateContainer, StopContainer or RemoveContainer call returns an
// error; the latencies are printed, never asserted (the target is p99 < 1 ms): these machines are
// shared and noisy, so speed is shown by BenchmarkCreateContainer and the log, not by a timed
// assertion.
func TestCreateContainerLatency(t *testing.T) {
	p := loadedPlugin(t)
	ctx := context.Background()
	kinds := []struct {
		name       string
		gpus, cpus int
	}{{"1 GPU + 4 exclusive CPUs", 1, 4}, {"2 exclusive CPUs", 0, 2}, {"shared", 0, 0}}
	const rounds = 2000
	var all []time.Duration
	for _, k := range kinds {
		lat := make([]time.Duration, 0, rounds)
		for i := range rounds {
			pod, c := benchContainer(fmt.Sprintf("m-%s-%d", k.name, i), k.gpus, k.cpus, 250)
			start := time.Now()
			_, _, err := p.CreateContainer(ctx, pod, c)
			lat = append(lat, time.Since(start))
			if err != nil {
				t.Fatalf("%s: %v", k.name, err)
			}
			if _, err := p.StopContainer(ctx, pod, c); err != nil {
				t.Fatal(err)
			}
			if err := p.RemoveContainer(ctx, pod, c); err != nil {
				t.Fatal(err)
			}
		}
		p50, p99 := percentile(lat, 50), percentile(lat, 99)
		t.Logf("CreateContainer, 8 GPUs, 224 CPUs, 200 running, %-24s p50 %8v  p99 %8v", k.name+":", p50, p99)
		all = append(all, lat...)
	}
	p50, p99 := percentile(all, 50), percentile(all, 99)
	// printed, never asserted: these machines are shared and noisy (BENCHMARKS.md)
	t.Logf("CreateContainer, all kinds (%d calls): p50 %v, p99 %v (target p99 < 1ms)", len(all), p50, p99)
}

func percentile(d []time.Duration, pct int) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*pct/100)]
}

// BenchmarkCreateContainer: one GPU + 4 exclusive CPUs on the loaded DGX H100 model.
func BenchmarkCreateContainer(b *testing.B) {
	p := loadedPlugin(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := range b.N {
		pod, c := benchContainer(fmt.Sprint("b-", i), 1, 4, 0)
		if _, _, err := p.CreateContainer(ctx, pod, c); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		_, _ = p.StopContainer(ctx, pod, c)
		b.StartTimer()
	}
}
