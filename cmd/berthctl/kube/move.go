// Package kube moves a running pod of the berth runtime from one Kubernetes node to another
// through the Kubernetes API, as a user could by hand: a destination preflight (preflight.go)
// before anything is frozen, the kubelet checkpoint API (through the
// API server's node proxy), the archive brought to the destination node (by the node agents,
// agents.go, or a shared file system, transfer.go), a restore pod created
// from the source pod's spec with the berth.dev/restore-from annotation and a node selector, and
// the source pod deleted once the restore pod is Ready.
//
// What does not belong here: reading checkpoint archives (package commands and oci/checkpoint),
// the containerd side of moves (cmd/berthctl/move), kubeconfig flags (the command).
package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// kubeletCheckpointTimeout bounds move's kubelet checkpoint call: ending it cancels the
// kubelet's, containerd's and the shim's request (and with it an armed page stream). The
// kubelet's own deadline is the call's ?timeout=, days in copy mode (PageStreamRequest's
// CheckpointTimeout), or its runtimeRequestTimeout (2 min by default) in stored mode.
const kubeletCheckpointTimeout = 15 * time.Minute

// Sentinel errors.
var (
	// ErrOwned: the pod belongs to an owner whose pods cannot be moved (a controller other than
	// a ReplicaSet, or a non-controller owner): see checkMovable for why, per kind.
	ErrOwned = errors.New("pod is owned by a controller")
	// ErrNotMovable: the pod cannot be moved as it is (not running, not the berth runtime, more
	// than one container).
	ErrNotMovable = errors.New("pod cannot be moved")
	// ErrNoNode: no other node's labels match the checkpoint.
	ErrNoNode = errors.New("no node matches the checkpoint")
)

// RuntimeClass is the RuntimeClass a movable pod runs with.
const RuntimeClass = "berth"

// hostnameLabel is the well-known node label the restore pod is pinned with.
const hostnameLabel = "kubernetes.io/hostname"

// Transfer brings a kubelet checkpoint archive from the source node to the destination's
// checkpoint root, as the archive (SharedFS) or as a directory of its files (Agents, which has a
// StoresDirectory method to say so; the name then has no .tar suffix).
type Transfer interface {
	// Copy makes the archive at path srcArchive on node src available on node dst under name (a
	// file name in dst's checkpoint root) and returns the bytes moved.
	Copy(ctx context.Context, src, srcArchive, dst, name string) (int64, error)
	// Remove removes name from dst's checkpoint root (the rollback of Copy).
	Remove(ctx context.Context, dst, name string) error
}

// Options of Move.
type Options struct {
	Namespace, Pod string
	// Container is the container to checkpoint; "" for the pod's only container.
	Container string
	// To is the destination node; "" for the first other node by name whose berth labels match
	// the source node's and that passes the preflight.
	To string
	// Name is the restore pod's name; "" for POD-<suffix>.
	Name string
	// Timeout bounds the wait for the restore pod to be Ready.
	Timeout time.Duration
	// Selector returns the node selector a restore of the archive at path needs (read on this
	// machine through Transfer's view of the source node).
	Selector func(ctx context.Context, node, archive string) (map[string]string, error)
	Transfer Transfer
	// Stats reads a node's kubelet stats summary for the preflight; nil: KubeletStats (through
	// the API server's node proxy).
	Stats StatsFunc
	// Preflight asks the destination node itself (Agents.Preflight: its berth agent's receiver)
	// what only it can tell; nil: the preflight reads the API server and the kubelets only.
	Preflight NodePreflight
	// Probe asks the source and destination nodes' hosts (Probes: their berth-probe pods) what
	// the agents cannot see: the container's host PIDs and GPU device memory on the source, bind
	// sources, free PIDs and free device memory on the destination; nil: not checked.
	Probe NodeProbe
	// Progress receives one line per phase as it ends; nil for none.
	Progress func(Phase)
	// Mode is ModeCopy (Transfer must carry page streams: PageStreams, Agents) or ModeStored;
	// "" is ModeCopy where Transfer carries page streams, ModeStored where it does not
	// (SharedFS). Copy mode needs a destination agent that can run CRIU's page server (criu on
	// its PATH and CAP_CHECKPOINT_RESTORE, as contrib/kubernetes's agent has): without it the
	// page stream fails at its first page and the move with it (the pod runs on).
	Mode string
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// Phase is one timed step of a move.
type Phase = checkpoint.Phase

// Result is what Move did.
type Result struct {
	Namespace string `json:"namespace"`
	// Pod is the source pod (deleted), Restored the restore pod (Ready).
	Pod      string `json:"pod"`
	Restored string `json:"restored"`
	From     string `json:"from"`
	To       string `json:"to"`
	// Archive is the kubelet's archive on the source node; Checkpoint its name in the
	// destination's checkpoint root (the restore-from annotation): NS-POD-UNIXNANO, a directory
	// (Agents), or with .tar an archive (SharedFS).
	Archive    string `json:"archive"`
	Checkpoint string `json:"checkpoint"`
	Bytes      int64  `json:"bytes"`
	// Mode is the move's mode (ModeCopy, ModeStored); PageBytes the bytes of the copy-mode page
	// stream (frames included) that went beside the archive.
	Mode      string `json:"mode"`
	PageBytes int64  `json:"pageBytes,omitempty"`
	// Controller is KIND/NAME of the ReplicaSet that owned the source pod and adopted the
	// restored one; "" for a pod without one.
	Controller string            `json:"controller,omitempty"`
	Selector   map[string]string `json:"nodeSelector"`
	Phases     []Phase           `json:"phases"`
	TotalMs    float64           `json:"totalMs"`
}

// Move moves the pod o.Namespace/o.Pod. In copy mode (Options.Mode) the source node's agent
// arms a page stream for the container before the kubelet checkpoint API is called, so that the
// shim sends the memory pages to the destination's agent during the dump and the kubelet's
// archive holds only the rest; a failed stream fails the checkpoint (the container runs on)
// and the destination drops what it got. The destination preflight (preflight.go) runs before
// the kubelet checkpoint API: its refusals come back as a *move.PreflightError (errors.Is
// move.ErrPreflight, errdefs FailedPrecondition) with nothing checkpointed, sent or created.
// On any error before the restore pod is Ready, the
// source pod keeps running (the kubelet checkpoint API leaves it running), and what was made on
// the destination (restore pod, copied archive) is removed.
func Move(ctx context.Context, cs kubernetes.Interface, o Options) (res *Result, retErr error) {
	now := o.Now
	if now == nil {
		now = time.Now
	}
	res = &Result{Namespace: o.Namespace, Pod: o.Pod, Phases: []Phase{}}
	phase := func(name string, t0 time.Time) {
		p := Phase{Name: name, Ms: checkpoint.Millis(now().Sub(t0))}
		res.Phases = append(res.Phases, p)
		res.TotalMs += p.Ms
		if o.Progress != nil {
			o.Progress(p)
		}
	}
	pods := cs.CoreV1().Pods(o.Namespace)

	t0 := now()
	src, err := pods.Get(ctx, o.Pod, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("move pod %s/%s: %w", o.Namespace, o.Pod, err)
	}
	container, err := checkMovable(src, o.Container)
	if err != nil {
		return nil, err
	}
	var rs *adoption
	if c := metav1.GetControllerOf(src); c != nil {
		if rs, err = prepareAdoption(ctx, cs, src, c); err != nil {
			return nil, err
		}
		res.Controller = c.Kind + "/" + c.Name
	}
	res.From = src.Spec.NodeName
	streams, canStream := o.Transfer.(PageStreams)
	if res.Mode, err = moveMode(o.Mode, canStream); err != nil {
		return nil, err
	}
	var containerID string
	if res.Mode == ModeCopy {
		if containerID, err = runningContainerID(src, container); err != nil {
			return nil, err
		}
	}
	// the destination preflight (preflight.go), before the kubelet freezes the container
	res.Checkpoint = fmt.Sprintf("%s-%s-%d", o.Namespace, o.Pod, now().UnixNano())
	if _, dir := o.Transfer.(interface{ StoresDirectory() }); !dir {
		res.Checkpoint += ".tar" // the archive as it is: ls and gc know archives by the suffix
	}
	if o.To, err = preflight(ctx, cs, o, src, container, res.Checkpoint); err != nil {
		return nil, errPreflight(o.Namespace, o.Pod, err)
	}
	res.To = o.To
	phase("preflight", t0)

	var (
		pages     PageStream
		cpTimeout int64 // the kubelet call's ?timeout=, which the armed stream is for
	)
	if res.Mode == ModeCopy {
		// the source agent arms the shim (pagearm.go): the dump of the checkpoint call with
		// cpTimeout (and no other party's checkpoint) sends the pages to dst's agent
		t0 = now()
		if cpTimeout, err = checkpoint.NewCheckpointTimeout(); err != nil {
			return nil, err
		}
		if pages, err = streams.ArmPages(ctx, src.Spec.NodeName, o.To, containerID, res.Checkpoint, cpTimeout); err != nil {
			return nil, fmt.Errorf("arm the page stream of %s/%s on %s toward %s: %w", o.Namespace, o.Pod, src.Spec.NodeName, o.To, err)
		}
		defer pages.Close() // disarms it when the kubelet never asked; nothing after Wait
		phase("arm-pages", t0)
	}

	// the kubelet checkpoint API, through the API server's node proxy
	t0 = now()
	creq := cs.CoreV1().RESTClient().Post().AbsPath("/api/v1/nodes", src.Spec.NodeName, "proxy", "checkpoint", o.Namespace, o.Pod, container)
	if cpTimeout > 0 {
		// whole seconds, as the kubelet parses it (the API server passes a node proxy's
		// query on)
		creq = creq.Param("timeout", strconv.FormatInt(cpTimeout, 10))
	}
	// the kubelet's own bound is the call's timeout, which copy mode sets to days: bound it here
	cctx, cancel := context.WithTimeout(ctx, kubeletCheckpointTimeout)
	raw, err := creq.Do(cctx).Raw()
	cancel()
	if err != nil {
		err = fmt.Errorf("kubelet checkpoint API on %s for %s/%s/%s: %w", src.Spec.NodeName, o.Namespace, o.Pod, container, err)
		taken := true
		if pages != nil { // disarmed at once: no later checkpoint takes it
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeGrace)
			disarmed, derr := pages.Disarm(dctx)
			cancel()
			taken = derr != nil || !disarmed
		}
		if as, ok := pages.(*agentStream); ok && taken {
			// what the source agent saw of the page stream, when it ended with the checkpoint
			if out, aerr, done := as.result(2 * time.Second); done && aerr != nil {
				err = fmt.Errorf("%w; the source agent: %w", err, aerr)
			} else if done {
				err = fmt.Errorf("%w; the source agent forwarded the page stream: %s", err, strings.TrimSpace(string(out)))
			}
		}
		return nil, err
	}
	var items struct {
		Items []string `json:"items"`
	}
	if err := json.Unmarshal(raw, &items); err != nil || len(items.Items) != 1 {
		return nil, fmt.Errorf("kubelet checkpoint API on %s answered %.200q (%v); want one archive", src.Spec.NodeName, raw, err)
	}
	res.Archive = items.Items[0]
	if pages != nil {
		// nothing stays armed once the kubelet answered; a request still there was not taken
		if disarmed, err := pages.Disarm(ctx); err == nil && disarmed {
			return nil, fmt.Errorf("kubelet checkpoint API on %s for %s/%s/%s: %s was written without taking the page stream armed for it (the shim saw another deadline than ?timeout=%d s: a kubelet runtimeRequestTimeout above it?); it holds the pages: --mode stored moves it whole",
				src.Spec.NodeName, o.Namespace, o.Pod, container, res.Archive, cpTimeout)
		}
		// the shim signed the stream's digest only once the destination had it all; the agent's
		// end says how many bytes went
		if res.PageBytes, err = pages.Wait(ctx); err != nil {
			return nil, fmt.Errorf("page stream of %s/%s to %s: %w", o.Namespace, o.Pod, o.To, err)
		}
	}
	phase("checkpoint", t0)

	t0 = now()
	sel, err := o.Selector(ctx, src.Spec.NodeName, res.Archive)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s on %s: %w", res.Archive, src.Spec.NodeName, err)
	}
	// the preflight chose the node by the source node's labels: the checkpoint's must match too
	if err := matchNode(ctx, cs, sel, o.To); err != nil {
		return nil, err
	}
	res.Selector = maps.Clone(sel)
	res.Selector[hostnameLabel] = o.To
	phase("choose-node", t0)

	t0 = now()
	if res.Bytes, err = o.Transfer.Copy(ctx, src.Spec.NodeName, res.Archive, o.To, res.Checkpoint); err != nil {
		_ = o.Transfer.Remove(context.WithoutCancel(ctx), o.To, res.Checkpoint)
		return nil, fmt.Errorf("bring %s from %s to %s: %w", res.Archive, src.Spec.NodeName, o.To, err)
	}
	copied := res.Checkpoint
	committed := false // the restored pod stays: a ReplicaSet may have deleted the source
	defer func() {
		if retErr != nil && !committed {
			_ = o.Transfer.Remove(context.WithoutCancel(ctx), o.To, copied)
		}
	}()
	phase("transfer", t0)

	t0 = now()
	rp := restorePod(src, o, res)
	if rs != nil {
		// out of the ReplicaSet's sight until Ready: it would adopt a Pending pod and, one
		// replica over, delete it first (ReplicaSets delete unready pods before ready ones)
		rp.Labels = map[string]string{LabelMoving: string(src.UID)}
	}
	created, err := pods.Create(ctx, rp, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create restore pod %s/%s: %w", o.Namespace, rp.Name, err)
	}
	res.Restored = created.Name
	defer func() {
		if retErr != nil && !committed {
			// the restore pod goes before its archive (deferred above) is removed, and is waited
			// for: a restore the kubelet is running from that checkpoint ends (and the shim keeps
			// its CRIU log beside the checkpoint) before the checkpoint and its logs are removed
			removePod(context.WithoutCancel(ctx), cs, o.Namespace, created.Name)
		}
	}()
	if err := waitReady(ctx, cs, o.Namespace, created.Name, o.Timeout); err != nil {
		return nil, err
	}
	phase("restore", t0)
	if rs != nil {
		t0 = now()
		if committed, err = rs.handOver(ctx, cs, src, created); err != nil {
			if committed {
				return res, err
			}
			return nil, err
		}
		phase("adopt", t0)
	}

	t0 = now()
	uid := src.UID
	if err := pods.Delete(ctx, src.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
		// the restore pod runs: the move is done, the source must be deleted by hand
		return res, fmt.Errorf("restored as %s/%s on %s, but deleting the source pod failed (delete it): %w", o.Namespace, created.Name, o.To, err)
	}
	phase("delete-source", t0)
	return res, nil
}

// checkMovable returns the container to checkpoint, or why p cannot be moved. A pod whose
// controller is a ReplicaSet (a Deployment's included) is movable: the ReplicaSet adopts the
// restored pod (adoption.go). Other owners are refused, each saying why.
func checkMovable(p *corev1.Pod, container string) (string, error) {
	id := p.Namespace + "/" + p.Name
	if c := metav1.GetControllerOf(p); c != nil {
		switch {
		case c.Kind == "ReplicaSet" && strings.HasPrefix(c.APIVersion, "apps/"):
		case c.Kind == "StatefulSet":
			return "", fmt.Errorf("%w: %s is managed by StatefulSet %s: its pods are known by name (%s), which the restore pod cannot take while the source holds it, and once the source is deleted the StatefulSet recreates %s fresh at once; scale the StatefulSet down to release the pod, or move pods of a Deployment",
				ErrOwned, id, c.Name, p.Name, p.Name)
		case c.Kind == "DaemonSet":
			return "", fmt.Errorf("%w: %s is managed by DaemonSet %s, which runs one pod per node: a pod moved to another node would be a second one there and its node would get a fresh one",
				ErrOwned, id, c.Name)
		default:
			return "", fmt.Errorf("%w: %s is managed by %s %s, which would start a fresh replica when the source pod is deleted and would not adopt the restored one (berth adopts only into ReplicaSets and Deployments); move a pod without a controller, or scale the controller down and move its pod",
				ErrOwned, id, c.Kind, c.Name)
		}
	} else if len(p.OwnerReferences) > 0 {
		return "", fmt.Errorf("%w: %s has ownerReferences (%s %s); a restore pod would not have them", ErrOwned, id, p.OwnerReferences[0].Kind, p.OwnerReferences[0].Name)
	}
	if p.Spec.RuntimeClassName == nil || *p.Spec.RuntimeClassName != RuntimeClass {
		return "", fmt.Errorf("%w: %s does not run with runtimeClassName %s (only berth's shim checkpoints and restores)", ErrNotMovable, id, RuntimeClass)
	}
	if p.Status.Phase != corev1.PodRunning || p.Spec.NodeName == "" {
		return "", fmt.Errorf("%w: %s is %s, not Running", ErrNotMovable, id, p.Status.Phase)
	}
	if len(p.Spec.Containers) != 1 || len(p.Spec.InitContainers) > 0 {
		return "", fmt.Errorf("%w: %s has %d containers and %d init containers; a restore pod restores one container", ErrNotMovable, id, len(p.Spec.Containers), len(p.Spec.InitContainers))
	}
	name := p.Spec.Containers[0].Name
	if container != "" && container != name {
		return "", fmt.Errorf("%w: %s has no container %s (it has %s)", ErrNotMovable, id, container, name)
	}
	return name, nil
}

// runningContainerID returns the containerd id of p's container name, from its status
// ("containerd://ID").
func runningContainerID(p *corev1.Pod, name string) (string, error) {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name != name {
			continue
		}
		if id, ok := strings.CutPrefix(cs.ContainerID, "containerd://"); ok && id != "" && cs.State.Running != nil {
			return id, nil
		}
		return "", fmt.Errorf("%w: %s/%s: container %s is not running under containerd (id %q)", ErrNotMovable, p.Namespace, p.Name, name, cs.ContainerID)
	}
	return "", fmt.Errorf("%w: %s/%s: no status of container %s", ErrNotMovable, p.Namespace, p.Name, name)
}

// restorePod is the source pod's spec, unscheduled, with the restore-from annotation and the
// selector; its labels (what Services select) and other annotations are the source's.
func restorePod(src *corev1.Pod, o Options, res *Result) *corev1.Pod {
	name := o.Name
	if name == "" {
		base := src.Name
		if i := strings.LastIndex(base, "-m"); i > 0 && len(base)-i == 7 {
			base = base[:i] // a pod moved before: keep the name from growing
		}
		name = fmt.Sprintf("%s-m%05d", base, time.Now().UnixNano()%100000)
	}
	spec := *src.Spec.DeepCopy()
	spec.NodeName = ""
	spec.NodeSelector = maps.Clone(res.Selector)
	ann := maps.Clone(src.Annotations)
	if ann == nil {
		ann = map[string]string{}
	}
	ann[oci.AnnotationRestoreFrom] = res.Checkpoint
	ann[AnnotationMovedFrom] = src.Namespace + "/" + src.Name + "@" + src.Spec.NodeName
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: src.Namespace,
			Labels: maps.Clone(src.Labels), Annotations: ann,
		},
		Spec: spec,
	}
}

// AnnotationMovedFrom records on a restore pod the pod it was moved from (namespace/name@node).
const AnnotationMovedFrom = "berth.dev/moved-from"

// matchNode checks that node's labels match sel (the checkpoint's node selector).
func matchNode(ctx context.Context, cs kubernetes.Interface, sel map[string]string, node string) error {
	n, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("node %s: %w", node, err)
	}
	if !labels.SelectorFromSet(sel).Matches(labels.Set(n.Labels)) {
		return fmt.Errorf("%w: node %s's labels do not match the checkpoint's selector %v (the source node's labels were stale)", ErrNoNode, node, sel)
	}
	return nil
}

// podGoneTimeout bounds removePod's wait for the kubelet to have stopped a restore pod.
const podGoneTimeout = 30 * time.Second

// removePod deletes pod ns/name with a grace period of one second and waits, at most
// podGoneTimeout, until the API server no longer has it: the kubelet removes a pod only once its
// containers stopped, and a container it is creating (a CRI restore) is created first. A force
// delete (grace 0) would remove the pod from the API at once and leave the kubelet restoring.
// Errors are not returned: this is a rollback's step, and the rollback goes on regardless.
func removePod(ctx context.Context, cs kubernetes.Interface, ns, name string) {
	one := int64(1)
	pods := cs.CoreV1().Pods(ns)
	if err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &one}); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, podGoneTimeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := pods.Get(ctx, name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// failedWaiting are the reasons of a waiting container that a restore does not recover from.
var failedWaiting = []string{"CreateContainerError", "CreateContainerConfigError", "RunContainerError", "CrashLoopBackOff", "ErrImageNeverPull"}

// waitReady waits until the pod is Ready, failing as soon as it cannot become Ready.
func waitReady(ctx context.Context, cs kubernetes.Interface, ns, name string, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = 5 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := ""
	for {
		p, err := cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					return nil
				}
			}
			last = string(p.Status.Phase)
			for _, s := range p.Status.ContainerStatuses {
				if w := s.State.Waiting; w != nil && w.Reason != "" {
					last += ": " + w.Reason + " " + w.Message
					if slices.Contains(failedWaiting, w.Reason) {
						return fmt.Errorf("restore pod %s/%s on %s: %s: %s", ns, name, p.Spec.NodeName, w.Reason, w.Message)
					}
				}
				if t := s.State.Terminated; t != nil {
					return fmt.Errorf("restore pod %s/%s on %s: container %s ended (%s, exit %d): %s", ns, name, p.Spec.NodeName, s.Name, t.Reason, t.ExitCode, t.Message)
				}
			}
			if p.Status.Phase == corev1.PodFailed {
				return fmt.Errorf("restore pod %s/%s failed: %s %s", ns, name, p.Status.Reason, p.Status.Message)
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("restore pod %s/%s not Ready after %s (%s): %w", ns, name, timeout, last, ctx.Err())
		case <-tick.C:
		}
	}
}

// moveMode returns the mode a move runs in: requested (Options.Mode), or where that is "" copy
// when the transfer carries page streams (canStream) and stored when it does not. Errors: copy
// requested of a transfer that cannot stream, or a mode that is neither.
func moveMode(requested string, canStream bool) (string, error) {
	switch requested {
	case "":
		if canStream {
			return ModeCopy, nil
		}
		return ModeStored, nil
	case ModeStored:
		return ModeStored, nil
	case ModeCopy:
		if !canStream {
			return "", fmt.Errorf("move mode %s: the transfer cannot carry a page stream (use the berth agents, --transfer agent, or --mode %s)", ModeCopy, ModeStored)
		}
		return ModeCopy, nil
	}
	return "", fmt.Errorf("move mode %q: want %s or %s", requested, ModeCopy, ModeStored)
}
