package plugin_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/placement"
	"github.com/berth-dev/berth/nri/plugin"
	"github.com/berth-dev/berth/oci"
)

// gather returns reg's metric families by name.
func gather(t *testing.T, reg prometheus.Gatherer) map[string]*dto.MetricFamily {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// metric returns the series of family name whose labels include every labels pair (name,
// value, name, value, ...), failing t when there is none.
func metric(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) *dto.Metric {
	t.Helper()
	for _, m := range fams[name].GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			match = match && have[labels[i]] == labels[i+1]
		}
		if match {
			return m
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return nil
}

// value is the counter's or gauge's value of the series metric finds.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	t.Helper()
	m := metric(t, fams, name, labels...)
	if m.GetCounter() != nil {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}

// gathered is value over a fresh Gather of reg.
func gathered(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	return value(t, gather(t, reg), name, labels...)
}

// scrape fetches url over HTTP and parses the Prometheus text format it answers with.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	rsp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer rsp.Body.Close()
	if rsp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(rsp.Body)
		t.Fatalf("GET %s: %s: %s", url, rsp.Status, b)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(rsp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return fams
}

// serve serves reg on a fresh listener on 127.0.0.1:0 and returns the /metrics URL and a function
// that stops the server and checks that ServeMetrics returned nil.
func serve(t *testing.T, reg prometheus.Gatherer) (string, func()) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- plugin.ServeMetrics(ctx, l, reg) }()
	return "http://" + l.Addr().String() + "/metrics", func() {
		t.Helper()
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("ServeMetrics after cancel: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("ServeMetrics did not return after cancel")
		}
	}
}

// stepClock is a clock that advances by step at every reading: every decision takes one step.
func stepClock(step time.Duration) func() time.Time {
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	return func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		now = now.Add(step)
		return now
	}
}

// held is what the per-NUMA gauges say about one NUMA node.
type held struct{ cpus, pool, gpus, mems float64 }

func heldOn(t *testing.T, fams map[string]*dto.MetricFamily, node string) held {
	t.Helper()
	return held{
		cpus: value(t, fams, plugin.MetricCPUsHeld, "numa_node", node),
		pool: value(t, fams, plugin.MetricSharedPoolCPUs, "numa_node", node),
		gpus: value(t, fams, plugin.MetricGPUsHeld, "numa_node", node),
		mems: value(t, fams, plugin.MetricMemoryBoundContainers, "numa_node", node),
	}
}

// TestRuntimeMetrics drives the plugin through a real NRI runtime (placements, refusals, a stop
// and removal, a restart that synchronizes) and scrapes /metrics over HTTP from ServeMetrics on
// 127.0.0.1: the counters, the decision histogram and the per-NUMA gauges follow every event.
func TestRuntimeMetrics(t *testing.T) {
	rt := startRuntime(t)
	reg := prometheus.NewRegistry()
	const step = 2 * time.Millisecond
	_, _, stop := rt.connect(cfg(), plugin.WithRegisterer(reg), plugin.WithClock(stepClock(step)))
	url, stopServing := serve(t, reg)

	fams := scrape(t, url)
	empty := held{pool: 112}
	for _, node := range []string{"0", "1"} {
		if got := heldOn(t, fams, node); got != empty {
			t.Errorf("before any container, node %s: %+v, want %+v", node, got, empty)
		}
	}
	if got := value(t, fams, plugin.MetricPlacements, "result", "placed", "policy", "best-effort"); got != 0 {
		t.Errorf("placements before any container: %v", got)
	}

	single := map[string]string{oci.AnnotationGPUs: "4", oci.AnnotationNUMAPolicy: "single-numa-node"}
	for _, c := range []struct {
		pod string
		cs  ctrSpec
		ok  bool
	}{
		{"infer", ctrSpec{name: "a", annotations: gpus(2), cpus: 4}, true},                                        // node 0
		{"infer2", ctrSpec{name: "b", annotations: single, cpus: 8}, true},                                        // node 1: node 0 has 2 free GPUs
		{"web", ctrSpec{name: "web"}, true},                                                                       // shared, unaligned
		{"big", ctrSpec{name: "big", annotations: gpus(9)}, false},                                                // unplaceable
		{"typo", ctrSpec{name: "typo", annotations: map[string]string{oci.AnnotationNUMAPolicy: "tight"}}, false}, // unknown policy
	} {
		if _, _, err := rt.create(c.pod, c.cs); (err == nil) != c.ok {
			t.Fatalf("create %s: %v, want success %v", c.cs.name, err, c.ok)
		}
	}

	fams = scrape(t, url)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{plugin.MetricPlacements, []string{"result", "placed", "policy", "best-effort"}, 2},
		{plugin.MetricPlacements, []string{"result", "placed", "policy", "single-numa-node"}, 1},
		{plugin.MetricPlacements, []string{"result", "placed", "policy", "restricted"}, 0},
		{plugin.MetricPlacements, []string{"result", "refused", "policy", "best-effort"}, 1},
		{plugin.MetricPlacements, []string{"result", "refused", "policy", "unknown"}, 1},
		{plugin.MetricRefusals, []string{"reason", plugin.ReasonUnplaceable}, 1},
		{plugin.MetricRefusals, []string{"reason", plugin.ReasonUnknownPolicy}, 1},
		{plugin.MetricRefusals, []string{"reason", plugin.ReasonBadAnnotation}, 0},
	} {
		if got := value(t, fams, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	h := metric(t, fams, plugin.MetricDecisionDuration).GetHistogram()
	if h.GetSampleCount() != 5 || h.GetSampleSum() < 5*step.Seconds()-1e-9 || h.GetSampleSum() > 5*step.Seconds()+1e-9 {
		t.Errorf("decision histogram: %d decisions, %v s; want 5 and %v s", h.GetSampleCount(), h.GetSampleSum(), 5*step.Seconds())
	}
	largest := 0.0
	for _, b := range h.GetBucket() {
		want := uint64(0) // every decision took 2 ms
		if b.GetUpperBound() >= step.Seconds() {
			want = 5
		}
		if b.GetCumulativeCount() != want {
			t.Errorf("decision histogram bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), want)
		}
		if !math.IsInf(b.GetUpperBound(), 1) {
			largest = max(largest, b.GetUpperBound())
		}
	}
	if largest != 2 {
		t.Errorf("largest finite bucket %v s, want NRI's 2 s deadline", largest)
	}
	if got, want := heldOn(t, fams, "0"), (held{cpus: 4, pool: 108, gpus: 2, mems: 1}); got != want {
		t.Errorf("node 0 with a: %+v, want %+v", got, want)
	}
	if got, want := heldOn(t, fams, "1"), (held{cpus: 8, pool: 104, gpus: 4, mems: 1}); got != want {
		t.Errorf("node 1 with b: %+v, want %+v", got, want)
	}

	// Stopping and removing a gives node 0 back; b keeps node 1; counters do not move.
	rt.stop("a")
	fams = scrape(t, url)
	if got := heldOn(t, fams, "0"); got != empty {
		t.Errorf("node 0 after a was removed: %+v, want %+v", got, empty)
	}
	if got, want := heldOn(t, fams, "1"), (held{cpus: 8, pool: 104, gpus: 4, mems: 1}); got != want {
		t.Errorf("node 1 after a was removed: %+v, want %+v", got, want)
	}
	if got := value(t, fams, plugin.MetricPlacements, "result", "placed", "policy", "best-effort"); got != 2 {
		t.Errorf("placements after a removal: %v, want 2", got)
	}
	stop()
	stopServing()
	if _, err := http.Get(url); err == nil {
		t.Error("the metrics listener still answers after ServeMetrics returned")
	}

	// A restarted plugin (its own registry) rebuilds the gauges from the runtime's containers.
	reg2 := prometheus.NewRegistry()
	_, _, stop2 := rt.connect(cfg(), plugin.WithRegisterer(reg2))
	defer stop2()
	url2, stopServing2 := serve(t, reg2)
	defer stopServing2()
	fams = scrape(t, url2)
	if got, want := heldOn(t, fams, "1"), (held{cpus: 8, pool: 104, gpus: 4, mems: 1}); got != want {
		t.Errorf("node 1 after Synchronize: %+v, want %+v", got, want)
	}
	if got := heldOn(t, fams, "0"); got != empty {
		t.Errorf("node 0 after Synchronize: %+v, want %+v", got, empty)
	}
	if got := metric(t, fams, plugin.MetricDecisionDuration).GetHistogram().GetSampleCount(); got != 0 {
		t.Errorf("a fresh plugin reports %d decisions", got)
	}
}

// TestRefusalReason: errors are classified by the sentinel they wrap, never by their text.
func TestRefusalReason(t *testing.T) {
	tests := []struct {
		err  error
		want string
	}{
		{fmt.Errorf("berth-nri: container x: %w: berth.dev/gpus=\"two\"", plugin.ErrBadAnnotation), plugin.ReasonBadAnnotation},
		{fmt.Errorf("berth.dev/numa-policy: %w \"tight\"", alloc.ErrUnknownPolicy), plugin.ReasonUnknownPolicy},
		{fmt.Errorf("%w: no container id", alloc.ErrInvalidRequest), plugin.ReasonInvalidRequest},
		{fmt.Errorf("berth-nri: %w container x: it asks for 9 GPUs", alloc.ErrUnplaceable), plugin.ReasonUnplaceable},
		{fmt.Errorf("%w x: %w", alloc.ErrUnplaceable, placement.ErrTooManyGPUs), plugin.ReasonUnplaceable},
		{fmt.Errorf("place x: %w: container x is already placed", alloc.ErrConflict), plugin.ReasonConflict},
		{errors.New("cannot place: already allocated: bad annotation"), plugin.ReasonOther}, // the words, no sentinel
		{context.DeadlineExceeded, plugin.ReasonOther},
	}
	for _, tt := range tests {
		if got := plugin.RefusalReason(tt.err); got != tt.want {
			t.Errorf("RefusalReason(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
}

// TestMetricsNames: the metrics pass Prometheus' naming lint (units and _total suffixes, help),
// all carry the berth_nri_ prefix, and one registry cannot hold two plugins.
func TestMetricsNames(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := plugin.New(cfg(), dgxNode, plugin.WithRegisterer(reg)); err != nil {
		t.Fatal(err)
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("%s: %s", p.Metric, p.Text)
	}
	fams := gather(t, reg)
	for _, name := range []string{plugin.MetricPlacements, plugin.MetricRefusals, plugin.MetricDecisionDuration, plugin.MetricCPUsHeld,
		plugin.MetricSharedPoolCPUs, plugin.MetricGPUsHeld, plugin.MetricMemoryBoundContainers, plugin.MetricGPUsMisaligned} {
		if fams[name] == nil {
			t.Errorf("%s is not exported", name)
		}
	}
	for name := range fams {
		if !strings.HasPrefix(name, "berth_nri_") {
			t.Errorf("metric %s lacks the berth_nri_ prefix", name)
		}
	}
	if len(fams[plugin.MetricRefusals].GetMetric()) != 7 {
		t.Errorf("%s has %d series before any refusal, want one per reason (7)", plugin.MetricRefusals, len(fams[plugin.MetricRefusals].GetMetric()))
	}
	if _, err := plugin.New(cfg(), dgxNode, plugin.WithRegisterer(reg)); err == nil {
		t.Error("a second plugin registered its metrics on the same registry")
	}
}
