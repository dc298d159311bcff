package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/streaming/pkg/httpstream"

	"github.com/berth-dev/berth/cmd/berthctl/move"
)

// The node agents: the berth-agent DaemonSet of contrib/kubernetes runs `berthctl receive` on
// every node, on the node's address (hostNetwork) over mutual TLS, into berth's checkpoint root;
// its container also holds the node's kubelet checkpoint directory and the transfer PKI's files
// (in $BERTH_TLS_CA, $BERTH_TLS_CERT, $BERTH_TLS_KEY, $BERTH_TLS_SERVER_NAME). Agents reaches
// them through the API server: every step is a command run in an agent's container with the
// pods/exec subresource (what `kubectl exec` does), so the Kubernetes API's authentication and
// RBAC decide who may move checkpoints, no agent opens a control port, and berthctl needs only
// a kubeconfig. The archive itself goes from the source node's agent to the destination node's
// agent directly (berthctl send, transfer.SendCRIArchive), never through the API server or this
// machine. In copy mode (pages.go) the source agent also runs `berthctl send-pages`, which arms
// the shim through the node directory /run/berth/page-streams and carries the memory pages to the
// destination agent during the kubelet's checkpoint.

// Agent defaults: where contrib/kubernetes/berth-agent-daemonset.yaml runs the agents.
const (
	DefaultAgentNamespace = "berth-system"
	DefaultAgentSelector  = "app.kubernetes.io/name=berth-agent"
	DefaultAgentContainer = "agent"
	// AgentPortName is the name of the agent container's port that `berthctl receive` listens
	// on (on the node's address: the pod uses the host network).
	AgentPortName = "transfer"
	// DefaultAgentKubeletDir and DefaultAgentRoot are where the agent's container mounts the
	// node's kubelet checkpoint directory and berth's checkpoint root.
	DefaultAgentKubeletDir = "/var/lib/kubelet/checkpoints"
	DefaultAgentRoot       = "/var/lib/berth/checkpoints"
	// agentBerthctl is berthctl in the agent's image (as berth-agent-daemonset.yaml runs it).
	agentBerthctl = "/usr/local/bin/berthctl"
)

// ErrNoAgent: no running, ready agent pod on the node (the DaemonSet is missing, or its pod is
// not ready there).
var ErrNoAgent = errors.New("no berth agent on the node")

// Agents is the Transfer through the node agents, and the reader of a kubelet archive's node
// selector on its node.
type Agents struct {
	Client kubernetes.Interface
	// Config is the REST configuration exec requests are made with (the clientset's).
	Config *rest.Config
	// Namespace, Labels (a label selector) and Container find an agent's container (defaults
	// above when "").
	Namespace, Labels, Container string
	// KubeletDir and Root are the node directories as the agent's container mounts them.
	KubeletDir, Root string
}

func (a *Agents) defaults() {
	if a.Namespace == "" {
		a.Namespace = DefaultAgentNamespace
	}
	if a.Labels == "" {
		a.Labels = DefaultAgentSelector
	}
	if a.Container == "" {
		a.Container = DefaultAgentContainer
	}
	if a.KubeletDir == "" {
		a.KubeletDir = DefaultAgentKubeletDir
	}
	if a.Root == "" {
		a.Root = DefaultAgentRoot
	}
}

// pod returns the running, ready agent pod on node.
func (a *Agents) pod(ctx context.Context, node string) (*corev1.Pod, error) {
	a.defaults()
	return nodePod(ctx, a.Client, a.Namespace, a.Labels, node, "berth agent", "berth-agent-daemonset.yaml", ErrNoAgent)
}

// nodePod returns the running, ready pod of a berth DaemonSet (what, from contrib/kubernetes's
// manifest) on node, found by its labels in namespace ns. Errors: the API server's, wrapped;
// none (ErrNoAgent, ErrNoProbe) naming the node, the selector and the manifest to apply when
// there is no such pod.
func nodePod(ctx context.Context, cs kubernetes.Interface, ns, labels, node, what, manifest string, none error) (*corev1.Pod, error) {
	p, err := readyPod(ctx, cs, ns, labels, node)
	if err != nil {
		return nil, fmt.Errorf("find the %s on %s: %w", what, node, err)
	}
	if p == nil {
		return nil, fmt.Errorf("%w %s: no ready pod %s in namespace %s (is contrib/kubernetes/%s applied?)",
			none, node, labels, ns, manifest)
	}
	return p, nil
}

// readyPod returns the running, ready pod of namespace ns matching selector on node; nil when
// there is none. The error is the API server's.
func readyPod(ctx context.Context, cs kubernetes.Interface, ns, selector, node string) (*corev1.Pod, error) {
	pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{
		LabelSelector: selector, FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
	})
	if err != nil {
		return nil, err
	}
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			continue
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return p, nil
			}
		}
	}
	return nil, nil
}

// exec runs argv in the agent container of p and returns its standard output; the error holds
// its standard error.
func (a *Agents) exec(ctx context.Context, p *corev1.Pod, argv ...string) ([]byte, error) {
	return execIn(ctx, a.Client, a.Config, p, a.Container, "berth agent", argv...)
}

// execIn runs argv in container of p through the pods/exec subresource (what kubectl exec does:
// WebSocket, else SPDY) and returns its standard output; the error, naming what (the pod's
// role) and the pod, holds the last 2000 bytes of its standard error.
func execIn(ctx context.Context, cs kubernetes.Interface, cfg *rest.Config, p *corev1.Pod, container, what string, argv ...string) ([]byte, error) {
	req := cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(p.Namespace).Name(p.Name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: container, Command: argv, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(cfg, "GET", req.URL().String())
	if err != nil {
		return nil, err
	}
	spdy, err := remotecommand.NewSPDYExecutor(cfg, "POST", req.URL())
	if err != nil {
		return nil, err
	}
	ex, err := remotecommand.NewFallbackExecutor(ws, spdy, func(err error) bool {
		return httpstream.IsUpgradeFailure(err) || httpstream.IsHTTPSProxyError(err)
	})
	if err != nil {
		return nil, err
	}
	var stdout, stderr bytes.Buffer
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr}); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 2000 {
			msg = "..." + msg[len(msg)-2000:]
		}
		cmd := path.Base(argv[0])
		if len(argv) > 1 {
			cmd += " " + argv[1]
		}
		return stdout.Bytes(), fmt.Errorf("%s in %s %s/%s on %s: %w: %s", cmd, what, p.Namespace, p.Name, p.Spec.NodeName, err, msg)
	}
	return stdout.Bytes(), nil
}

// ArchiveSelector returns the node selector that a restore of the kubelet archive (as the
// kubelet named it; only its base name is used) on node needs: `berthctl checkpoint selector` in
// node's agent.
func (a *Agents) ArchiveSelector(ctx context.Context, node, archive string) (map[string]string, error) {
	p, err := a.pod(ctx, node)
	if err != nil {
		return nil, err
	}
	out, err := a.exec(ctx, p, agentBerthctl, "checkpoint", "selector", "-o", "json", path.Join(a.KubeletDir, path.Base(archive)))
	if err != nil {
		return nil, err
	}
	var sel struct {
		NodeSelector map[string]string `json:"nodeSelector"`
	}
	if err := json.Unmarshal(out, &sel); err != nil || len(sel.NodeSelector) == 0 {
		return nil, fmt.Errorf("checkpoint selector in %s/%s: %v: no nodeSelector in %.200q", p.Namespace, p.Name, err, out)
	}
	return sel.NodeSelector, nil
}

// Copy has src's agent send the kubelet archive srcArchive (its base name, in the agent's kubelet
// checkpoint directory) to dst's agent over mutual TLS (`berthctl send`), which verifies it and
// stores it as the directory name in dst's checkpoint root. It returns the bytes sent.
func (a *Agents) Copy(ctx context.Context, src, srcArchive, dst, name string) (int64, error) {
	from, err := a.pod(ctx, src)
	if err != nil {
		return 0, err
	}
	to, err := a.pod(ctx, dst)
	if err != nil {
		return 0, err
	}
	addr, err := agentAddress(to, a.Container)
	if err != nil {
		return 0, err
	}
	out, err := a.exec(ctx, from, agentBerthctl, "send", "-o", "json", "--name", name,
		path.Join(a.KubeletDir, path.Base(srcArchive)), addr)
	if err != nil {
		return 0, err
	}
	var res struct {
		Bytes int64 `json:"bytes"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		return 0, fmt.Errorf("send in %s/%s: %w: %.200q", from.Namespace, from.Name, err, out)
	}
	return res.Bytes, nil
}

// Remove removes the checkpoint name from dst's checkpoint root (`berthctl checkpoint rm
// --force` in dst's agent): the rollback of Copy. A checkpoint that is not there is no error.
func (a *Agents) Remove(ctx context.Context, dst, name string) error {
	p, err := a.pod(ctx, dst)
	if err != nil {
		return err
	}
	_, err = a.exec(ctx, p, agentBerthctl, "checkpoint", "rm", "--force", "--kubelet-dir=", "--root", a.Root, name)
	return err
}

// StoresDirectory says that the destination keeps the checkpoint as a directory (the receiver
// extracts the archive while it arrives), so a restore does not extract it again.
func (a *Agents) StoresDirectory() {}

// agentAddress returns host:port of the agent pod's receiver: its pod IP (the node's address:
// the agent uses the host network) and the container port named AgentPortName.
func agentAddress(p *corev1.Pod, container string) (string, error) {
	if p.Status.PodIP == "" {
		return "", fmt.Errorf("berth agent %s/%s on %s has no address yet", p.Namespace, p.Name, p.Spec.NodeName)
	}
	for _, c := range p.Spec.Containers {
		if c.Name != container {
			continue
		}
		for _, port := range c.Ports {
			if port.Name == AgentPortName {
				return net.JoinHostPort(p.Status.PodIP, strconv.Itoa(int(port.ContainerPort))), nil
			}
		}
	}
	return "", fmt.Errorf("berth agent %s/%s: container %s has no port named %s", p.Namespace, p.Name, container, AgentPortName)
}

// Preflight asks node's berth agent whether that node can take need (a NodePreflight): it runs
// `berthctl checkpoint check --receiver ADDR --need JSON` in the agent's container, which sends
// the receive protocol's preflight query (move.RemotePreflight, over the agent's mutual TLS) to
// the agent's own receiver on ADDR (agentAddress), so the answer is the receiver's: the free disk
// of the checkpoint root it writes into, and the device memory of its --gpu backend. It returns
// the receiver's refusals. Errors: no agent (ErrNoAgent), or a check that gave no answer (an
// agent without --need, a receiver that answers no preflight), each naming the agent pod.
func (a *Agents) Preflight(ctx context.Context, node, name string, need move.Need) ([]move.Refusal, error) {
	p, err := a.pod(ctx, node)
	if err != nil {
		return nil, err
	}
	addr, err := agentAddress(p, a.Container)
	if err != nil {
		return nil, err
	}
	q, err := json.Marshal(need)
	if err != nil {
		return nil, err
	}
	out, err := a.exec(ctx, p, agentBerthctl, "checkpoint", "check", "-o", "json", "--receiver", addr, "--name", name, "--need", string(q))
	// a refusal exits non-zero with the answer on stdout
	var res struct {
		Refusals []move.Refusal `json:"refusals"`
	}
	if jerr := json.Unmarshal(out, &res); jerr != nil || res.Refusals == nil {
		if err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("checkpoint check in %s/%s: %v: no answer in %.200q", p.Namespace, p.Name, jerr, out)
	}
	return res.Refusals, nil
}
