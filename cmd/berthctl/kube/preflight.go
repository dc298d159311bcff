package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/distribution/reference"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	resourcehelper "k8s.io/component-helpers/resource"
	schedhelper "k8s.io/component-helpers/scheduling/corev1"
	"k8s.io/klog/v2"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// The destination preflight of a Kubernetes move, run before the kubelet checkpoint API (which
// freezes the container while CRIU dumps it): each refusal names the field, its value and the
// limit (move.Refusal, as migrate's and `berthctl checkpoint check`'s), and on any refusal
// nothing has been checkpointed, sent or created.
//
// Its facts come from what Kubernetes already publishes, read through the API server:
//   - the source container's memory (rssBytes, else workingSetBytes) and its writable layer
//     (rootfs usedBytes) from the source kubelet's stats summary
//     (/api/v1/nodes/NODE/proxy/stats/summary): their sum is the checkpoint size estimate (CRIU's
//     pages are the resident memory; the archive adds the rootfs diff);
//   - the destination Node object: conditions Ready, MemoryPressure, DiskPressure, PIDPressure,
//     spec.unschedulable and taints the pod does not tolerate (the restore pod would stay
//     Pending), status.images (the image, when imagePullPolicy is Never: the kubelet would answer
//     ErrImageNeverPull), allocatable minus the requests of the pods bound there (the restore pod
//     must be scheduled: cpu, memory, nvidia.com/gpu and any other requested resource), and the
//     berth fingerprint labels (the restore pod's nodeSelector) against the source node's;
//   - the destination kubelet's stats summary: node.memory.availableBytes against the container's
//     memory (not its limit: a pod limited to 16Gi that holds 1Gi needs 1Gi), node.fs.
//     availableBytes against the estimate; the source's node.fs.availableBytes too (the kubelet
//     writes the archive into its checkpoint directory on that file system first).
//
// What only the destination node can tell (the free disk of berth's checkpoint root, which may be
// another file system than the kubelet's) is asked of the
// destination's berth agent with the receive protocol's own preflight query (move.RemotePreflight):
// Agents.Preflight runs `berthctl checkpoint check --receiver` in that agent, which sends the query
// to its own receiver, so the answer is the receiver's, with the root and GPU backend it will use.
// The agent's container is not given the host's file system or PID namespace (least privilege).
// What only the nodes' hosts can tell is asked of their berth probes (Options.Probe, Probes: a
// DaemonSet of its own with hostPID and the host's / read-only, reached by pods/exec only):
//   - on the source node, `berthctl checkpoint need`: the container's host PIDs (by its cgroup)
//     and, with the probe's GPU backend, the device memory they hold on each GPU
//     (move.GPUNeedOfSource, as migrate asks it);
//   - on the destination, `berthctl checkpoint check --host-root` with that need and a spec of
//     the pod's hostPath volumes and PID namespace (hostNeed): move.Preflight, the code of
//     migrate's and a receiver's preflight, refuses a missing hostPath (but DirectoryOrCreate and
//     FileOrCreate), with hostPID a PID in use there, and a GPU model missing or short of the
//     device memory the container holds (devicemap, as the shim will map it), with the
//     destination probe's own GPU backend.
// Without a probe (Options.Probe nil) these are not checked; the shim still refuses a missing
// bind source before CRIU runs, after the checkpoint (the move then rolls back, the source
// still running).

// NodePreflight is what Options.Preflight is: the destination node's own answer to need (its
// berth agent's receiver), for the checkpoint name the move will send. It returns that node's
// refusals (none: it can take the container); an error when the node could not be asked.
type NodePreflight func(ctx context.Context, node, name string, need move.Need) ([]move.Refusal, error)

// StatsFunc returns the kubelet stats summary of node (kubelet's /stats/summary).
type StatsFunc func(ctx context.Context, node string) (*statsapi.Summary, error)

// KubeletStats returns StatsFunc through the API server's node proxy
// (GET /api/v1/nodes/NODE/proxy/stats/summary, RBAC nodes/proxy: what the checkpoint API needs).
func KubeletStats(cs kubernetes.Interface) StatsFunc {
	return func(ctx context.Context, node string) (*statsapi.Summary, error) {
		raw, err := cs.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes", node, "proxy", "stats", "summary").Do(ctx).Raw()
		if err != nil {
			return nil, fmt.Errorf("kubelet stats summary of %s: %w", node, err)
		}
		var s statsapi.Summary
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, fmt.Errorf("kubelet stats summary of %s: %w", node, err)
		}
		return &s, nil
	}
}

// maxNodeImages is the kubelet's default --node-status-max-images: a node's status.images holds
// at most this many images, so an image absent from a full list may still be there.
const maxNodeImages = 50

// sourceFacts is what the preflight reads of the source once, before any destination is checked.
type sourceFacts struct {
	pod       *corev1.Pod
	container corev1.Container
	node      *corev1.Node
	// memory is the container's resident memory in bytes (0: the kubelet has no figure yet);
	// estimate is memory plus its writable layer: the checkpoint's size.
	memory, estimate int64
	// nodeFsFree is the source node's node.fs.availableBytes (-1: unknown).
	nodeFsFree int64
	// held is what the container holds on the source node, from its probe (NodeProbe.Source):
	// its processes' host PIDs and the device memory they hold on each GPU; zero without a probe.
	held move.Need
}

// readSource reads the source node, its kubelet's stats of the pod's container and, with probe,
// what the container holds on the node (host PIDs, GPU device memory).
func readSource(ctx context.Context, cs kubernetes.Interface, stats StatsFunc, probe NodeProbe, p *corev1.Pod, container string) (*sourceFacts, error) {
	f := &sourceFacts{pod: p, nodeFsFree: -1}
	for _, c := range p.Spec.Containers {
		if c.Name == container {
			f.container = c
		}
	}
	var err error
	if f.node, err = cs.CoreV1().Nodes().Get(ctx, p.Spec.NodeName, metav1.GetOptions{}); err != nil {
		return nil, fmt.Errorf("source node %s: %w", p.Spec.NodeName, err)
	}
	sum, err := stats(ctx, p.Spec.NodeName)
	if err != nil {
		return nil, err
	}
	if fs := sum.Node.Fs; fs != nil && fs.AvailableBytes != nil {
		f.nodeFsFree = int64(*fs.AvailableBytes)
	}
	for _, ps := range sum.Pods {
		if ps.PodRef.Namespace != p.Namespace || ps.PodRef.Name != p.Name || (ps.PodRef.UID != "" && ps.PodRef.UID != string(p.UID)) {
			continue
		}
		for _, c := range ps.Containers {
			if c.Name != container {
				continue
			}
			if m := c.Memory; m != nil {
				switch {
				case m.RSSBytes != nil && *m.RSSBytes > 0:
					f.memory = int64(*m.RSSBytes)
				case m.WorkingSetBytes != nil:
					f.memory = int64(*m.WorkingSetBytes)
				}
			}
			f.estimate = f.memory
			if r := c.Rootfs; r != nil && r.UsedBytes != nil {
				f.estimate += int64(*r.UsedBytes)
			}
		}
	}
	if probe != nil {
		id := containerID(p, container)
		if id == "" {
			return nil, fmt.Errorf("%w: %s/%s: container %s has no containerID in the pod's status", ErrNotMovable, p.Namespace, p.Name, container)
		}
		if f.held, err = probe.Source(ctx, p.Spec.NodeName, id, cgroupPodUID(p)); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// hostNeed is what a destination's probe checks for f (move.Preflight with the host's / under
// the probe's host root): a spec holding the container's hostPath volumes as bind mounts and
// the pod's PID namespace (none of its own with hostPID: then its host PIDs must be free), and
// the device memory it holds on its GPUs. A hostPath of type DirectoryOrCreate or FileOrCreate
// is left out: the kubelet creates it for the restore pod (empty: berth moves no hostPath's
// content, of any type). names[i] names mount i of the spec for a refusal. ok is false
// when there is nothing to check (no such volume, no hostPID, no device memory).
func hostNeed(f *sourceFacts) (need move.Need, names []string, ok bool) {
	sp := &specs.Spec{Linux: &specs.Linux{}}
	if !f.pod.Spec.HostPID {
		sp.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.PIDNamespace}}
	}
	for _, vm := range f.container.VolumeMounts {
		for _, v := range f.pod.Spec.Volumes {
			hp := v.HostPath
			if v.Name != vm.Name || hp == nil || (hp.Type != nil && (*hp.Type == corev1.HostPathDirectoryOrCreate || *hp.Type == corev1.HostPathFileOrCreate)) {
				continue
			}
			src := hp.Path
			if vm.SubPath != "" {
				src = path.Join(src, vm.SubPath)
			}
			sp.Mounts = append(sp.Mounts, specs.Mount{Destination: vm.MountPath, Source: src, Type: "bind", Options: []string{"rbind"}})
			names = append(names, "volumes["+v.Name+"].hostPath.path (mounted at "+vm.MountPath+")")
		}
	}
	need = move.Need{Spec: sp, PIDs: f.held.PIDs, GPU: f.held.GPU}
	ok = len(sp.Mounts) > 0 || (f.pod.Spec.HostPID && len(f.held.PIDs) > 0) || (f.held.GPU != nil && len(f.held.GPU.Devices) > 0)
	return need, names, ok
}

// sourceRefusals are the refusals of the source side: the source node's free disk for the
// kubelet's archive.
func sourceRefusals(f *sourceFacts) []move.Refusal {
	if f.nodeFsFree >= 0 && f.estimate > 0 && f.nodeFsFree < f.estimate {
		return []move.Refusal{{
			Field: "source node " + f.node.Name + " node.fs.availableBytes (the kubelet's checkpoint directory)",
			Value: bytesOf(f.nodeFsFree), Limit: ">= " + bytesOf(f.estimate) + " (the checkpoint estimate: the container's memory and writable layer)",
			Fix: "free disk on " + f.node.Name + " (kubelet checkpoints are never deleted by the kubelet: berthctl checkpoint gc)",
		}}
	}
	return nil
}

// destinationRefusals checks node dst (read from the API server, its kubelet's stats summary,
// with ask its own berth agent, and with probe its host: hostNeed) for the container of f,
// naming the checkpoint name. It
// returns the refusals (nil: dst can take it), or the error of a read that failed.
func destinationRefusals(ctx context.Context, cs kubernetes.Interface, stats StatsFunc, ask NodePreflight, probe NodeProbe, f *sourceFacts, dst *corev1.Node, name string) ([]move.Refusal, error) {
	var out []move.Refusal
	on := "node " + dst.Name + " "
	refuse := func(field, value, limit, fix string) {
		out = append(out, move.Refusal{Field: on + field, Value: value, Limit: limit, Fix: fix})
	}

	// conditions: the restore pod must be admitted and stay
	ready := false
	for _, c := range dst.Status.Conditions {
		switch c.Type {
		case corev1.NodeReady:
			ready = c.Status == corev1.ConditionTrue
			if !ready {
				refuse("condition Ready", conditionValue(c), "True", "restore on a Ready node")
			}
		case corev1.NodeMemoryPressure, corev1.NodeDiskPressure, corev1.NodePIDPressure:
			if c.Status == corev1.ConditionTrue {
				refuse("condition "+string(c.Type), conditionValue(c), "False", "the kubelet evicts pods and refuses new ones under "+string(c.Type))
			}
		}
	}
	if !ready && !slices.ContainsFunc(dst.Status.Conditions, func(c corev1.NodeCondition) bool { return c.Type == corev1.NodeReady }) {
		refuse("condition Ready", "absent", "True", "restore on a Ready node")
	}
	if dst.Spec.Unschedulable {
		refuse("spec.unschedulable", "true", "false", "kubectl uncordon "+dst.Name)
	}
	if t, ok := schedhelper.FindMatchingUntoleratedTaint(klog.Background(), dst.Spec.Taints, f.pod.Spec.Tolerations, func(t *corev1.Taint) bool {
		return (t.Effect == corev1.TaintEffectNoSchedule || t.Effect == corev1.TaintEffectNoExecute) && t.Key != corev1.TaintNodeUnschedulable
	}, false); ok {
		refuse("taint", t.ToString(), "a taint the pod tolerates", "add a toleration to the pod, or remove the taint")
	}

	// the fingerprint labels: the restore pod's nodeSelector is the checkpoint's, the source node's
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		for k := range f.node.Labels {
			if fingerprint.ExactLabel(k) && !yield(k) {
				return
			}
		}
	}) {
		want := f.node.Labels[k]
		got, ok := dst.Labels[k]
		if !ok {
			got = "absent"
		}
		if got != want {
			refuse("label "+k, strconv.Quote(got), strconv.Quote(want)+" (the source node's: the checkpoint's fingerprint)",
				"restore on a node whose berth labels match the source's (CRIU restores only onto the same fingerprint)")
		}
	}

	// the image, which a restore pod with imagePullPolicy Never cannot pull
	if f.container.ImagePullPolicy == corev1.PullNever && len(dst.Status.Images) < maxNodeImages && !nodeHasImage(dst, f.container.Image) {
		refuse("status.images", "without "+f.container.Image+" ("+strconv.Itoa(len(dst.Status.Images))+" images)", f.container.Image,
			"load the image on "+dst.Name+": with imagePullPolicy Never the kubelet does not pull it (ErrImageNeverPull)")
	}

	// scheduling: allocatable minus what the pods bound there request
	want := resourcehelper.PodRequests(f.pod, resourcehelper.PodResourcesOptions{})
	if len(want) > 0 {
		pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", dst.Name).String()})
		if err != nil {
			return nil, fmt.Errorf("pods on %s: %w", dst.Name, err)
		}
		used := corev1.ResourceList{}
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.Spec.NodeName != dst.Name || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
				continue
			}
			for r, q := range resourcehelper.PodRequests(p, resourcehelper.PodResourcesOptions{}) {
				u := used[r]
				u.Add(q)
				used[r] = u
			}
		}
		for _, r := range slices.Sorted(maps.Keys(want)) {
			q := want[r]
			if q.IsZero() {
				continue
			}
			alloc := dst.Status.Allocatable[r]
			free := alloc.DeepCopy()
			u := used[r]
			free.Sub(u)
			if free.Cmp(q) < 0 {
				refuse("status.allocatable["+string(r)+"] minus the requests of its pods", free.String()+" free ("+alloc.String()+" allocatable, "+u.String()+" requested)",
					">= "+q.String()+" (the pod's request)", "free "+string(r)+" on "+dst.Name+": the restore pod would stay Pending")
			}
		}
	}

	// the destination kubelet's own figures
	sum, err := stats(ctx, dst.Name)
	if err != nil {
		return nil, err
	}
	if m := sum.Node.Memory; f.memory > 0 && m != nil && m.AvailableBytes != nil && int64(*m.AvailableBytes) < f.memory {
		refuse("node.memory.availableBytes", bytesOf(int64(*m.AvailableBytes)), ">= "+bytesOf(f.memory)+" (the container's resident memory on "+f.node.Name+")",
			"free memory on "+dst.Name+": CRIU restores every page before the container runs")
	}
	if fs := sum.Node.Fs; f.estimate > 0 && fs != nil && fs.AvailableBytes != nil && int64(*fs.AvailableBytes) < f.estimate {
		refuse("node.fs.availableBytes", bytesOf(int64(*fs.AvailableBytes)), ">= "+bytesOf(f.estimate)+" (the checkpoint estimate: the container's memory and writable layer)",
			"free disk on "+dst.Name)
	}

	// what only the node can tell: its berth agent's receiver
	if ask != nil {
		rs, err := ask(ctx, dst.Name, name, move.Need{DiskBytes: f.estimate})
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			r.Field = on + r.Field
			out = append(out, r)
		}
	}

	// what only the node's host can tell: its probe (bind sources, host PIDs, GPU memory)
	if need, names, ok := hostNeed(f); probe != nil && ok {
		rs, err := probe.Check(ctx, dst.Name, need)
		if err != nil {
			return nil, err
		}
		for _, r := range rs {
			for i, n := range names {
				if strings.HasPrefix(r.Field, "mounts["+strconv.Itoa(i)+"].source") {
					r.Field = n
				}
			}
			r.Field = on + r.Field
			out = append(out, r)
		}
	}
	return out, nil
}

// nodeHasImage reports whether image (as a pod names it) is among n's status.images: by its
// normalized name (the default registry and library/ added, :latest when untagged; reference.ParseNormalizedNamed), as the kubelet looks it up.
func nodeHasImage(n *corev1.Node, image string) bool {
	want := normalizeImage(image)
	for _, img := range n.Status.Images {
		for _, name := range img.Names {
			if normalizeImage(name) == want {
				return true
			}
		}
	}
	return false
}

func normalizeImage(s string) string {
	r, err := reference.ParseNormalizedNamed(s)
	if err != nil {
		return s
	}
	return reference.TagNameOnly(r).String()
}

func conditionValue(c corev1.NodeCondition) string {
	v := string(c.Status)
	if c.Reason != "" || c.Message != "" {
		v += " (" + strings.TrimSpace(c.Reason+" "+c.Message) + ")"
	}
	return v
}

// bytesOf is n bytes as "N bytes (X MiB)".
func bytesOf(n int64) string {
	return fmt.Sprintf("%d bytes (%s)", n, resource.NewQuantity(n, resource.BinarySI).String())
}

// candidates returns the nodes a move of f may go to: to (must not be the source), else every
// schedulable node but the source whose labels match the source node's fingerprint labels, by
// name.
func candidates(ctx context.Context, cs kubernetes.Interface, f *sourceFacts, to string) ([]*corev1.Node, error) {
	if to != "" {
		if to == f.node.Name {
			return nil, fmt.Errorf("%w: %s/%s already runs on %s", ErrNotMovable, f.pod.Namespace, f.pod.Name, to)
		}
		n, err := cs.CoreV1().Nodes().Get(ctx, to, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("destination node %s: %w", to, err)
		}
		return []*corev1.Node{n}, nil
	}
	sel := map[string]string{}
	for k, v := range f.node.Labels {
		if fingerprint.ExactLabel(k) {
			sel[k] = v
		}
	}
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: labels.SelectorFromSet(sel).String()})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	var out []*corev1.Node
	for i := range nodes.Items {
		if n := &nodes.Items[i]; n.Name != f.node.Name {
			out = append(out, n)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no node but %s has the berth labels %v", ErrNoNode, f.node.Name, sel)
	}
	return out, nil
}

// preflight reads the source and checks the destination (o.To, else the first candidate by name
// that passes). It returns the chosen node, or a *move.PreflightError with the refusals (for every
// candidate, each field naming its node), or the error of a read that failed.
func preflight(ctx context.Context, cs kubernetes.Interface, o Options, src *corev1.Pod, container, name string) (string, error) {
	stats := o.Stats
	if stats == nil {
		stats = KubeletStats(cs)
	}
	f, err := readSource(ctx, cs, stats, o.Probe, src, container)
	if err != nil {
		return "", err
	}
	refusals := sourceRefusals(f)
	nodes, err := candidates(ctx, cs, f, o.To)
	if err != nil {
		return "", err
	}
	var all []move.Refusal
	for _, n := range nodes {
		rs, err := destinationRefusals(ctx, cs, stats, o.Preflight, o.Probe, f, n, name)
		if err != nil {
			return "", err
		}
		if len(rs) == 0 && len(refusals) == 0 {
			return n.Name, nil
		}
		all = append(all, rs...)
	}
	return "", &move.PreflightError{Refusals: append(refusals, all...)}
}

// errPreflight wraps a preflight's refusals for the move's error: nothing was checkpointed.
func errPreflight(ns, pod string, err error) error {
	var pe *move.PreflightError
	if errors.As(err, &pe) {
		return fmt.Errorf("move pod %s/%s: nothing was checkpointed: %w", ns, pod, err)
	}
	return fmt.Errorf("move pod %s/%s: preflight (nothing was checkpointed): %w", ns, pod, err)
}

// cgroupPodUID is the pod UID the kubelet names p's cgroup after: p's UID, but for a static pod's
// mirror (annotation kubernetes.io/config.mirror) the static pod's own, its config hash
// (kubernetes.io/config.hash), which the API server's UID of the mirror is not.
func cgroupPodUID(p *corev1.Pod) string {
	if _, mirror := p.Annotations["kubernetes.io/config.mirror"]; mirror {
		if h := p.Annotations["kubernetes.io/config.hash"]; h != "" {
			return h
		}
	}
	return string(p.UID)
}
