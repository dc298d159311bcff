package plugin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/berth-dev/berth/nri/alloc"
)

// The metrics berth-nri exports (Prometheus text format, see ServeMetrics). Label values come from
// fixed sets: never container ids or message text.
const (
	// MetricPlacements counts CreateContainer decisions, labelled result ("placed" or
	// "refused") and policy (the container's NUMA policy: none, best-effort, restricted,
	// single-numa-node, or "unknown" when its berth.dev/numa-policy annotation names none).
	MetricPlacements = "berth_nri_placements_total"
	// MetricRefusals counts refused containers, labelled reason (one of the Reason* values).
	MetricRefusals = "berth_nri_refusals_total"
	// MetricDecisionDuration is a histogram of the time from a CreateContainer request's arrival
	// to its answer, waiting for the plugin's mutex included, in seconds. NRI gives a plugin 2 s.
	MetricDecisionDuration = "berth_nri_decision_duration_seconds"
	// MetricCPUsHeld is the number of a NUMA node's CPUs that containers hold exclusively
	// (label numa_node). Containers without exclusive CPUs hold none: they share the pool.
	MetricCPUsHeld = "berth_nri_cpus_held"
	// MetricSharedPoolCPUs is the number of a NUMA node's CPUs in the shared pool (held
	// exclusively by nobody, reserved CPUs included; label numa_node).
	MetricSharedPoolCPUs = "berth_nri_shared_pool_cpus"
	// MetricGPUsHeld is the number of GPUs close to a NUMA node that containers hold (label
	// numa_node; "unknown" for GPUs whose NUMA affinity is unknown or spans nodes).
	MetricGPUsHeld = "berth_nri_gpus_held"
	// MetricMemoryBoundContainers is the number of containers whose cpuset.mems includes a NUMA
	// node (label numa_node). Memory is aligned, not sized: berth-nri tracks no byte counts.
	MetricMemoryBoundContainers = "berth_nri_memory_bound_containers"
	// MetricGPUsMisaligned counts containers placed with GPUs someone else gave them (the
	// kubelet's device plugin or DRA) that fall short, labelled reason: gpu_links (not the
	// best-connected set of that size this node has: not one NVLink island where it has one) or
	// gpu_numa (the GPUs hang off more than one NUMA node). A container can count under both.
	MetricGPUsMisaligned = "berth_nri_gpus_misaligned_total"
)

// The values of MetricRefusals' reason label, from the sentinel error a refusal wraps.
const (
	// ReasonBadAnnotation: a berth annotation's value cannot be used (ErrBadAnnotation).
	ReasonBadAnnotation = "bad_annotation"
	// ReasonUnknownPolicy: berth.dev/numa-policy names no policy (alloc.ErrUnknownPolicy).
	ReasonUnknownPolicy = "unknown_policy"
	// ReasonInvalidRequest: the request means nothing (alloc.ErrInvalidRequest).
	ReasonInvalidRequest = "invalid_request"
	// ReasonUnplaceable: valid, but it cannot be placed now under its policy
	// (alloc.ErrUnplaceable).
	ReasonUnplaceable = "unplaceable"
	// ReasonConflict: a resource or the container id is already held (alloc.ErrConflict).
	ReasonConflict = "conflict"
	// ReasonGPUsNotGranted: berth.dev/gpus asked for GPUs where the kubelet gives them
	// (ErrGPUsNotGranted).
	ReasonGPUsNotGranted = "gpus_not_granted"
	// ReasonOther: any other error.
	ReasonOther = "other"
)

// refusalReasons returns every value of the reason label.
func refusalReasons() []string {
	return []string{ReasonBadAnnotation, ReasonUnknownPolicy, ReasonInvalidRequest, ReasonUnplaceable, ReasonConflict, ReasonGPUsNotGranted, ReasonOther}
}

// policyUnknown is the policy label of a container whose policy annotation names no policy.
const policyUnknown = "unknown"

// decisionBuckets returns the upper bounds of MetricDecisionDuration's buckets, in seconds:
// from 100 µs (a typical decision) to NRI's 2 s deadline.
func decisionBuckets() []float64 {
	return []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2}
}

// RefusalReason classifies an error of CreateContainer as one of the Reason* values, by the
// sentinel error it wraps (never by its message).
func RefusalReason(err error) string {
	switch {
	case errors.Is(err, ErrBadAnnotation):
		return ReasonBadAnnotation
	case errors.Is(err, ErrGPUsNotGranted):
		return ReasonGPUsNotGranted
	case errors.Is(err, alloc.ErrUnknownPolicy): // before ErrInvalidRequest, which it wraps
		return ReasonUnknownPolicy
	case errors.Is(err, alloc.ErrInvalidRequest):
		return ReasonInvalidRequest
	case errors.Is(err, alloc.ErrUnplaceable):
		return ReasonUnplaceable
	case errors.Is(err, alloc.ErrConflict):
		return ReasonConflict
	}
	return ReasonOther
}

// metrics are one plugin's counters and histogram; the per-NUMA gauges are read from the
// plugin's snapshot by heldCollector when scraped.
type metrics struct {
	placements *prometheus.CounterVec
	refusals   *prometheus.CounterVec
	duration   prometheus.Histogram
	gpuMisal   *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricPlacements,
			Help: "CreateContainer decisions by result (placed, refused) and NUMA policy.",
		}, []string{"result", "policy"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricRefusals,
			Help: "Containers refused, by reason: " + fmt.Sprint(refusalReasons()) + ".",
		}, []string{"reason"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    MetricDecisionDuration,
			Help:    "Time from a CreateContainer request's arrival to its answer, lock wait included, in seconds (NRI's deadline: 2 s).",
			Buckets: decisionBuckets(),
		}),
		gpuMisal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricGPUsMisaligned,
			Help: "Containers placed with GPUs given by the kubelet that are not the best-connected set (gpu_links) or span NUMA nodes (gpu_numa).",
		}, []string{"reason"}),
	}
	m.gpuMisal.WithLabelValues(alloc.MisalignedLinks)
	m.gpuMisal.WithLabelValues(alloc.MisalignedNUMA)
	// Every series of a fixed label set exists from the start, so that rates see the first event.
	for _, pol := range []alloc.Policy{alloc.PolicyNone, alloc.PolicyBestEffort, alloc.PolicyRestricted, alloc.PolicySingleNUMANode} {
		m.placements.WithLabelValues("placed", string(pol))
		m.placements.WithLabelValues("refused", string(pol))
	}
	m.placements.WithLabelValues("refused", policyUnknown)
	for _, r := range refusalReasons() {
		m.refusals.WithLabelValues(r)
	}
	return m
}

// decided records one CreateContainer answer: err nil (placed) or the refusal, under policy,
// started at start and answered at end.
func (m *metrics) decided(policy string, err error, start, end time.Time) {
	m.duration.Observe(end.Sub(start).Seconds())
	if err == nil {
		m.placements.WithLabelValues("placed", policy).Inc()
		return
	}
	m.placements.WithLabelValues("refused", policy).Inc()
	m.refusals.WithLabelValues(RefusalReason(err)).Inc()
}

// misaligned counts one placement's Misaligned reasons.
func (m *metrics) misaligned(reasons []string) {
	for _, r := range reasons {
		m.gpuMisal.WithLabelValues(r).Inc()
	}
}

// heldCollector exports the plugin's latest HeldByNUMA snapshot as gauges. It reads an atomic
// pointer, never the plugin's mutex: a scrape cannot delay a decision.
type heldCollector struct {
	p                             *Plugin
	cpus, pool, gpus, memBoundCtr *prometheus.Desc
}

func newHeldCollector(p *Plugin) *heldCollector {
	label := []string{"numa_node"}
	return &heldCollector{
		p:           p,
		cpus:        prometheus.NewDesc(MetricCPUsHeld, "CPUs of the NUMA node held exclusively by containers.", label, nil),
		pool:        prometheus.NewDesc(MetricSharedPoolCPUs, "CPUs of the NUMA node in the shared pool (held exclusively by nobody, reserved CPUs included).", label, nil),
		gpus:        prometheus.NewDesc(MetricGPUsHeld, "GPUs close to the NUMA node held by containers (numa_node=\"unknown\": affinity unknown or spanning nodes).", label, nil),
		memBoundCtr: prometheus.NewDesc(MetricMemoryBoundContainers, "Containers whose cpuset.mems includes the NUMA node.", label, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *heldCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.cpus
	ch <- c.pool
	ch <- c.gpus
	ch <- c.memBoundCtr
}

// Collect implements prometheus.Collector.
func (c *heldCollector) Collect(ch chan<- prometheus.Metric) {
	held := c.p.held.Load()
	if held == nil {
		return
	}
	for _, h := range *held {
		if h.NUMA < 0 {
			ch <- prometheus.MustNewConstMetric(c.gpus, prometheus.GaugeValue, float64(h.GPUs), "unknown")
			continue
		}
		node := strconv.Itoa(h.NUMA)
		ch <- prometheus.MustNewConstMetric(c.cpus, prometheus.GaugeValue, float64(h.ExclusiveCPUs), node)
		ch <- prometheus.MustNewConstMetric(c.pool, prometheus.GaugeValue, float64(h.SharedCPUs), node)
		ch <- prometheus.MustNewConstMetric(c.gpus, prometheus.GaugeValue, float64(h.GPUs), node)
		ch <- prometheus.MustNewConstMetric(c.memBoundCtr, prometheus.GaugeValue, float64(h.MemContainers), node)
	}
}

// register adds the plugin's metrics to r.
func (p *Plugin) register(r prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{p.metrics.placements, p.metrics.refusals, p.metrics.duration, p.metrics.gpuMisal, newHeldCollector(p)} {
		if err := r.Register(c); err != nil {
			return fmt.Errorf("register metrics: %w", err)
		}
	}
	return nil
}

// publish stores what the state holds per NUMA node for the gauges; the caller holds p.mu.
func (p *Plugin) publish() {
	held := p.state.HeldByNUMA()
	p.held.Store(&held)
}

// metricsShutdownTimeout bounds how long ServeMetrics waits for scrapes in flight on shutdown.
const metricsShutdownTimeout = 5 * time.Second

// ServeMetrics serves g in the Prometheus text format at /metrics on l until ctx is done, then
// closes l and returns nil; any other error of the server is returned. Scrapes are bounded: 5 s
// to read a request's headers, 10 s to gather, 30 s to write the answer.
func ServeMetrics(ctx context.Context, l net.Listener, g prometheus.Gatherer) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{
		ErrorLog:      errorLog{ctx},
		ErrorHandling: promhttp.ContinueOnError,
		Timeout:       10 * time.Second,
	}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, WriteTimeout: 30 * time.Second}
	served := make(chan struct{})
	defer close(served)
	go func() {
		select {
		case <-ctx.Done():
		case <-served:
			return
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), metricsShutdownTimeout)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	err := srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("serve metrics on %s: %w", l.Addr(), err)
}

// errorLog sends promhttp's errors (a metric that could not be gathered) to the context's log.
type errorLog struct{ ctx context.Context }

// Println implements promhttp.Logger.
func (e errorLog) Println(v ...any) { log.G(e.ctx).Warn("berth-nri: metrics: " + fmt.Sprint(v...)) }
