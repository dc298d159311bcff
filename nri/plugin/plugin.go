package plugin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/nri/pkg/api"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/oci"
)

// Plugin handles NRI events for one node. Create it with New; it is safe for concurrent use
// (every event takes one mutex, held only for the in-memory decision).
type Plugin struct {
	cfg      Config
	policy   alloc.Policy
	reserved []int
	devInfo  DeviceInfo
	updater  func([]*api.ContainerUpdate)
	now      func() time.Time
	reg      prometheus.Registerer
	metrics  *metrics
	held     atomic.Pointer[[]alloc.Held] // the state's HeldByNUMA after the last change
	// recordKey authenticates berth.dev/placement records (Config.RecordKeyFile).
	recordKey []byte

	mu       sync.Mutex
	node     *node.Node
	state    *alloc.State
	devPaths map[string]int // GPU device node path -> GPU index
}

// Option configures a Plugin.
type Option func(*Plugin)

// WithDeviceInfo replaces the host device lookup (default HostDevices(cfg.DevRoot)).
func WithDeviceInfo(f DeviceInfo) Option { return func(p *Plugin) { p.devInfo = f } }

// WithUpdater sets the function that sends unsolicited container updates (the stub's
// UpdateContainers), used when a release on RemoveContainer changes shared cpusets; it is called
// on its own goroutine. Without it such updates wait for the next event that can return them.
func WithUpdater(f func([]*api.ContainerUpdate)) Option { return func(p *Plugin) { p.updater = f } }

// WithRegisterer registers the plugin's metrics (see MetricPlacements and the names beside it)
// with r, one registry per plugin. Without it they are kept but exported nowhere.
func WithRegisterer(r prometheus.Registerer) Option { return func(p *Plugin) { p.reg = r } }

// WithClock replaces the clock that times decisions for MetricDecisionDuration (default
// time.Now).
func WithClock(now func() time.Time) Option { return func(p *Plugin) { p.now = now } }

// New returns a plugin for node n with configuration cfg (validated here). Errors name the
// configuration key.
func New(cfg Config, n *node.Node, opts ...Option) (*Plugin, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("berth-nri config: %w", err)
	}
	pol, _ := alloc.ParsePolicy(cfg.Policy)
	var err error
	p := &Plugin{cfg: cfg, policy: pol, reserved: cfg.Reserved(), devInfo: HostDevices(cfg.DevRoot), now: time.Now, metrics: newMetrics()}
	for _, o := range opts {
		o(p)
	}
	if p.recordKey, err = loadRecordKey(cfg.RecordKeyFile); err != nil {
		return nil, err
	}
	if err := p.setNode(n); err != nil {
		return nil, err
	}
	p.publish()
	if p.reg != nil {
		if err := p.register(p.reg); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func (p *Plugin) setNode(n *node.Node) error {
	st, err := alloc.New(n, p.reserved)
	if err != nil {
		return fmt.Errorf("reserved_cpus: %w", err)
	}
	p.node, p.state = n, st
	p.devPaths = map[string]int{}
	for g := range n.NumGPUs() {
		for _, path := range n.GPUDevicePaths(g) {
			p.devPaths[path] = g
		}
	}
	return nil
}

// SetNode replaces the node model (its inputs changed) and re-books every container on the new
// model; containers whose CPUs or GPUs no longer exist or now collide are kept as unmanaged and
// logged. No container is re-pinned.
func (p *Plugin) SetNode(ctx context.Context, n *node.Node) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.state
	if err := p.setNode(n); err != nil {
		return err
	}
	old.Each(func(pl alloc.Placement, managed bool) {
		p.adopt(ctx, pl, managed)
	})
	p.publish()
	log.G(ctx).WithField("containers", p.state.Len()).Info("berth-nri: node model rebuilt")
	return nil
}

// adopt books pl; on a conflict it keeps the container as unmanaged and shared, without the
// resources that collide, and logs why.
func (p *Plugin) adopt(ctx context.Context, pl alloc.Placement, managed bool) {
	err := p.state.Adopt(pl, managed)
	if err == nil {
		return
	}
	log.G(ctx).WithError(err).WithField("id", pl.ID).Warn("berth-nri: cannot re-book container; keeping it unmanaged")
	var cpus []int
	for _, c := range pl.CPUs {
		if _, ok := p.node.CPU(c); ok {
			cpus = append(cpus, c)
		}
	}
	if err := p.state.Adopt(alloc.Placement{ID: pl.ID, CPUs: cpus}, false); err != nil {
		log.G(ctx).WithError(err).WithField("id", pl.ID).Warn("berth-nri: container not tracked")
	}
}

// Synchronize rebuilds the allocation state from the containers the runtime reports (on every
// connect, so also after berth-nri restarts). Containers with a berth.dev/placement annotation
// get back exactly what it records (exclusive CPUs, GPUs); others are booked with the GPUs found
// in them and their current cpuset, as shared. It returns no updates: nothing is re-pinned.
func (p *Plugin) Synchronize(ctx context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.setNode(p.node); err != nil {
		return nil, err
	}
	live := slices.DeleteFunc(slices.Clone(ctrs), func(c *api.Container) bool {
		s := c.GetState()
		return s != api.ContainerState_CONTAINER_CREATED && s != api.ContainerState_CONTAINER_RUNNING &&
			s != api.ContainerState_CONTAINER_PAUSED
	})
	managedFirst := func(a, b *api.Container) int {
		_, ra := a.GetAnnotations()[oci.AnnotationPlacement]
		_, rb := b.GetAnnotations()[oci.AnnotationPlacement]
		if ra != rb {
			if ra {
				return -1
			}
			return 1
		}
		return cmp.Or(cmp.Compare(a.GetCreatedAt(), b.GetCreatedAt()), cmp.Compare(a.GetId(), b.GetId()))
	}
	slices.SortFunc(live, managedFirst)
	namespaces := map[string]string{} // pod sandbox ID: Kubernetes namespace
	for _, pod := range pods {
		namespaces[pod.GetId()] = pod.GetNamespace()
	}
	managed := 0
	for _, c := range live {
		pl, isManaged := p.observe(ctx, namespaces[c.GetPodSandboxId()], c)
		p.adopt(ctx, pl, isManaged)
		if isManaged {
			managed++
		}
	}
	p.publish()
	log.G(ctx).WithField("containers", len(live)).WithField("placed-by-berth", managed).
		WithField("free", p.freeSummary()).Info("berth-nri: synchronized")
	return nil, nil
}

// observe reads what a running container of Kubernetes namespace ns holds: its placement record
// when it has one, otherwise its GPUs (containerGPUs) and current cpuset.
func (p *Plugin) observe(ctx context.Context, ns string, c *api.Container) (alloc.Placement, bool) {
	current, err := topology.ParseIDList(c.GetLinux().GetResources().GetCpu().GetCpus())
	if err != nil || len(current) == 0 {
		current = nil
		for _, cpu := range p.node.CPUs {
			current = append(current, cpu.ID)
		}
	}
	gpus, _ := p.containerGPUs(ns, c)
	if v, ok := c.GetAnnotations()[oci.AnnotationPlacement]; ok {
		pl, err := p.decodeRecord(c.GetId(), v)
		if err == nil {
			err = recordHolds(pl, current, gpus)
		}
		if err == nil {
			if !pl.Exclusive {
				pl.CPUs = current // the pool may have changed since creation
			}
			return pl, true
		}
		log.G(ctx).WithError(err).WithField("id", c.GetId()).Warn("berth-nri: placement record not believed; booking what the container holds, as unmanaged")
	}
	return alloc.Placement{ID: c.GetId(), CPUs: current, GPUs: gpus}, false
}

// recordHolds checks a berth-nri record pl against what the runtime says the container holds:
// its cpuset (current) and GPUs. A record is believed only for what the container really has:
// every recorded GPU, and for exclusive CPUs exactly its cpuset.
func recordHolds(pl alloc.Placement, current, gpus []int) error {
	for _, g := range pl.GPUs {
		if !slices.Contains(gpus, g) {
			return fmt.Errorf("%w: %s: records GPU %d, which the container does not have (it has %s)",
				ErrBadAnnotation, oci.AnnotationPlacement, g, topology.FormatIDList(gpus))
		}
	}
	if pl.Exclusive && !slices.Equal(pl.CPUs, current) {
		return fmt.Errorf("%w: %s: records exclusive CPUs %s, but the container's cpuset is %s",
			ErrBadAnnotation, oci.AnnotationPlacement, topology.FormatIDList(pl.CPUs), topology.FormatIDList(current))
	}
	return nil
}

// CreateContainer places the container and answers with its adjustment and the cpuset updates
// of shared containers whose pool shrank. Any error leaves the state unchanged, returns no
// adjustment and fails the creation with a message that says why in node terms.
func (p *Plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, c *api.Container) (_ *api.ContainerAdjustment, _ []*api.ContainerUpdate, retErr error) {
	start := p.now()
	ctx = log.WithLogger(ctx, log.G(ctx).WithField("id", c.GetId()).WithField("pod", pod.GetNamespace()+"/"+pod.GetName()).
		WithField("container", c.GetName()))
	p.mu.Lock()
	defer p.mu.Unlock()
	r, notes, err := p.request(pod, c)
	policy := string(r.Policy)
	if errors.Is(err, alloc.ErrUnknownPolicy) {
		policy = policyUnknown
	}
	defer func() { p.metrics.decided(policy, retErr, start, p.now()) }()
	for _, n := range notes {
		log.G(ctx).Warn("berth-nri: " + n)
	}
	if err != nil {
		log.G(ctx).WithError(err).Error("berth-nri: refused")
		return nil, nil, fmt.Errorf("berth-nri: container %s: %w", containerName(pod, c), err)
	}
	pl, err := p.state.Decide(r)
	if err != nil {
		log.G(ctx).WithError(err).Error("berth-nri: refused")
		return nil, nil, fmt.Errorf("berth-nri: %w", err)
	}
	adj := p.adjustment(pl)
	ups := p.state.Commit(pl)
	p.publish()
	p.metrics.misaligned(pl.Misaligned)
	for _, w := range pl.Warnings {
		log.G(ctx).Warn("berth-nri: " + w)
	}
	log.G(ctx).WithField("cpus", topology.FormatIDList(pl.CPUs)).WithField("gpus", topology.FormatIDList(pl.GPUs)).
		WithField("updates", len(ups)).Info("berth-nri: placed: " + pl.Reason)
	return adj, updates(ups), nil
}

// StopContainer releases what the container held and returns the cpuset updates of shared
// containers whose pool grew.
func (p *Plugin) StopContainer(ctx context.Context, pod *api.PodSandbox, c *api.Container) ([]*api.ContainerUpdate, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ups, ok := p.state.Release(c.GetId())
	if ok {
		log.G(ctx).WithField("id", c.GetId()).WithField("updates", len(ups)).Info("berth-nri: released")
		p.publish()
	}
	return updates(ups), nil
}

// RemoveContainer releases what the container still holds (normally StopContainer already did).
func (p *Plugin) RemoveContainer(ctx context.Context, pod *api.PodSandbox, c *api.Container) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ups, ok := p.state.Release(c.GetId())
	if ok {
		log.G(ctx).WithField("id", c.GetId()).Info("berth-nri: released on remove")
		p.publish()
	}
	if len(ups) > 0 && p.updater != nil {
		go p.updater(updates(ups))
	}
	return nil
}

// Placement returns the placement the plugin holds for container id (for tests and tools).
func (p *Plugin) Placement(id string) (alloc.Placement, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.state.Placement(id)
}

// freeSummary is the free resources per NUMA node, for logs.
func (p *Plugin) freeSummary() string {
	var parts []string
	for _, f := range p.state.FreeByNUMA() {
		parts = append(parts, fmt.Sprintf("node %d: GPUs [%s], %d CPUs", f.NUMA, topology.FormatIDList(f.GPUs), f.ExclusiveCPUs))
	}
	return fmt.Sprint(parts)
}
