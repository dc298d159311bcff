package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-dev/berth/cmd/berthctl/move"
)

// The node probes: the berth-probe DaemonSet of contrib/kubernetes runs, on every node, a
// container that sees what the agents must not: the host's PID namespace (hostPID) and the
// host's / read-only at /host, and, where configured ($BERTH_GPU), the node's GPU backend. It
// runs `berthctl probe` (waits, listens on nothing); Probes reaches it, as Agents reaches the
// agents, only through the API server's pods/exec, to run `berthctl checkpoint need` on the
// source node and `berthctl checkpoint check --host-root` on the destination: the same checks
// as migrate's and a receiver's (move.Preflight), with the host's paths under /host.

// Probe defaults: where contrib/kubernetes/berth-probe-daemonset.yaml runs the probes.
const (
	DefaultProbeSelector  = "app.kubernetes.io/name=berth-probe"
	DefaultProbeContainer = "probe"
	// DefaultProbeHostRoot is where the probe's container mounts the host's /.
	DefaultProbeHostRoot = "/host"
)

// ErrNoProbe: no running, ready probe pod on the node (the DaemonSet is missing, or its pod is
// not ready there).
var ErrNoProbe = errors.New("no berth probe on the node")

// NodeProbe is what the preflight asks of a node's own view (Options.Probe): what the source
// container holds there, and whether the destination's host can take it.
type NodeProbe interface {
	// Source returns what container containerID (the ID of the pod status's containerID,
	// without its runtime prefix) holds on node: its processes' host PIDs and, where the node's
	// probe has a GPU backend, the device memory they hold on each GPU (move.Need's PIDs and
	// GPU; nothing else is set). podUID is the UID of the container's pod: only processes in
	// a cgroup below that pod's count (move.Anchor).
	Source(ctx context.Context, node, containerID, podUID string) (move.Need, error)
	// Check checks need against node's host (bind sources, PIDs when need.Spec shares the host's
	// PID namespace, GPU device memory) and returns its refusals (none: it can take it).
	Check(ctx context.Context, node string, need move.Need) ([]move.Refusal, error)
}

// Probes is the NodeProbe through the berth-probe pods, by pods/exec.
type Probes struct {
	Client kubernetes.Interface
	// Config is the REST configuration exec requests are made with (the clientset's).
	Config *rest.Config
	// Namespace, Labels (a label selector), Container and HostRoot find the probe's container
	// and where it mounts the host's / (defaults: DefaultAgentNamespace and the above).
	Namespace, Labels, Container, HostRoot string
}

func (p *Probes) defaults() {
	if p.Namespace == "" {
		p.Namespace = DefaultAgentNamespace
	}
	if p.Labels == "" {
		p.Labels = DefaultProbeSelector
	}
	if p.Container == "" {
		p.Container = DefaultProbeContainer
	}
	if p.HostRoot == "" {
		p.HostRoot = DefaultProbeHostRoot
	}
}

// pod returns the running, ready probe pod on node.
func (p *Probes) pod(ctx context.Context, node string) (*corev1.Pod, error) {
	p.defaults()
	return nodePod(ctx, p.Client, p.Namespace, p.Labels, node, "berth probe", "berth-probe-daemonset.yaml", ErrNoProbe)
}

// Source runs `berthctl checkpoint need --host-root ROOT --container ID --pod-uid UID -o json` in
// node's probe: what the CRI container containerID of the pod with UID podUID holds there (only
// processes in a cgroup below that pod's count, move.ContainerPIDs).
func (p *Probes) Source(ctx context.Context, node, containerID, podUID string) (move.Need, error) {
	var need move.Need
	pod, err := p.pod(ctx, node)
	if err != nil {
		return need, err
	}
	out, err := execIn(ctx, p.Client, p.Config, pod, p.Container, "berth probe", agentBerthctl,
		"checkpoint", "need", "-o", "json", "--host-root", p.HostRoot, "--container", containerID, "--pod-uid", podUID)
	if err != nil {
		return need, err
	}
	if err := json.Unmarshal(out, &need); err != nil {
		return need, fmt.Errorf("checkpoint need in %s/%s: %w: %.200q", pod.Namespace, pod.Name, err, out)
	}
	return need, nil
}

// Check runs `berthctl checkpoint check --host-root ROOT --need JSON -o json` in node's probe.
// Errors: ErrNoProbe, or a check that gave no answer, naming the probe pod.
func (p *Probes) Check(ctx context.Context, node string, need move.Need) ([]move.Refusal, error) {
	pod, err := p.pod(ctx, node)
	if err != nil {
		return nil, err
	}
	q, err := json.Marshal(need)
	if err != nil {
		return nil, err
	}
	out, err := execIn(ctx, p.Client, p.Config, pod, p.Container, "berth probe", agentBerthctl,
		"checkpoint", "check", "-o", "json", "--host-root", p.HostRoot, "--need", string(q))
	// a refusal exits non-zero with the answer on stdout
	var res struct {
		Refusals []move.Refusal `json:"refusals"`
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil || res.Refusals == nil {
		if err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("checkpoint check in %s/%s: %v: no answer in %.200q", pod.Namespace, pod.Name, jerr, out)
	}
	return res.Refusals, nil
}

// containerID returns the ID of container name in p's status ("containerd://ID" without its
// runtime prefix); "" when the status has none yet.
func containerID(p *corev1.Pod, name string) string {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == name {
			if _, id, ok := strings.Cut(cs.ContainerID, "://"); ok {
				return id
			}
			return cs.ContainerID
		}
	}
	return ""
}
