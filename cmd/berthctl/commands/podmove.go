package commands

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-dev/berth/cmd/berthctl/kube"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// EnvKubeconfig is kubectl's list of kubeconfig files, read as kubectl reads it.
const EnvKubeconfig = clientcmd.RecommendedConfigPathEnvVar

// kubeFlags are kubectl's connection flags, with kubectl's meaning: --kubeconfig (else
// $KUBECONFIG, else ~/.kube/config), --context, -n/--namespace (else the context's namespace).
type kubeFlags struct {
	kubeconfig, context, namespace string
}

func (k *kubeFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&k.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
	cmd.Flags().StringVar(&k.context, "context", "", "kubeconfig context (default: the current context)")
	// shadows berthctl's global -n (the containerd namespace): here it is the pod's, as in kubectl
	cmd.Flags().StringVarP(&k.namespace, "namespace", "n", "", "the pod's Kubernetes namespace (default: the context's namespace)")
}

// client returns a clientset, its REST configuration and the namespace, as kubectl resolves
// them.
func (k *kubeFlags) client() (kubernetes.Interface, *rest.Config, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = k.kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: k.context})
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	ns := k.namespace
	if ns == "" {
		if ns, _, err = cc.Namespace(); err != nil {
			return nil, nil, "", fmt.Errorf("kubeconfig: %w", err)
		}
	}
	cfg.UserAgent = "berthctl"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, "", fmt.Errorf("kubernetes client: %w", err)
	}
	return cs, cfg, ns, nil
}

// Move is `berthctl move` (also `kubectl berth move`, the same binary as the kubectl plugin
// kubectl-berth).
func Move(g *Globals) *cobra.Command {
	var (
		kf        kubeFlags
		o         kube.Options
		rootTmpl  string
		kubeletTm string
		output    *format
		via       string
		agents    = &kube.Agents{}
		probes    = &kube.Probes{}
		probe     bool
	)
	cmd := &cobra.Command{
		Use:   "move POD [--to NODE] [-c CONTAINER] [-n NAMESPACE] [-o text|json]",
		Short: "Move a running pod (runtimeClassName berth) to another Kubernetes node",
		Long: `move moves a running pod of the berth runtime to another node through the Kubernetes API:

  1. the destination preflight, before anything is frozen: the node (--to NODE, else the first
     node by name other than the source whose berth labels match the source node's and that
     passes) is checked against the source container's memory and checkpoint estimate (the
     source kubelet's stats summary): Ready, no Memory/Disk/PIDPressure, not cordoned, no taint
     the pod does not tolerate, the berth fingerprint labels of the source node, the image in
     status.images (imagePullPolicy Never), the pod's requests within allocatable minus what its
     pods request, node.memory.availableBytes and node.fs.availableBytes of its kubelet, the source
     node's free disk for the archive, and (--transfer agent) the free disk of berth's checkpoint
     root as the destination's agent answers it ('berthctl checkpoint check --receiver' in that
     agent), and what only the nodes' hosts can tell, asked of their berth probes
     (contrib/kubernetes/berth-probe-daemonset.yaml; --probe=false skips it): 'berthctl checkpoint
     need' on the source node (the container's host PIDs, found by its cgroup, and the device
     memory they hold on each GPU when the probe has a GPU backend), then 'berthctl checkpoint
     check --host-root' on the destination: every hostPath volume's path present (but
     DirectoryOrCreate and FileOrCreate, which the kubelet creates), with hostPID the
     container's PIDs free there, and free device memory on GPUs of the source's models. Each
     refusal names the field, its value and the limit; nothing is checkpointed;
  2. the kubelet checkpoint API on the pod's node, through the API server
     (POST /api/v1/nodes/NODE/proxy/checkpoint/NS/POD/CONTAINER), which freezes the container
     while CRIU dumps it; the pod keeps running; the checkpoint's selector ('berthctl checkpoint
     selector') must match the node chosen;
  3. the kubelet's archive sent from the source node to that node (--transfer);
  4. a restore pod created from the source pod's spec, labels and annotations, with
     berth.dev/restore-from naming the checkpoint and a nodeSelector of the checkpoint's labels and
     kubernetes.io/hostname, and waited for until Ready (--timeout);
  5. the source pod deleted.

It prints every phase's wall time as it ends (-o json: the result at the end). On any failure
before the restore pod is Ready, the source pod keeps running and the restore pod and the copied
checkpoint are removed.

A pod of a ReplicaSet (a Deployment's) moves into the same ReplicaSet: the restore pod is created
outside its selector; once it is Ready the source gets the lowest pod deletion cost
(controller.kubernetes.io/pod-deletion-cost) and the restore pod the source's labels, so the
ReplicaSet adopts it and, one replica over, deletes the source: it never creates a replica nor
deletes the restored pod. Pods of other controllers are refused, the error saying why for each
(StatefulSet: pods known by name; DaemonSet: one pod per node; others would start a fresh pod).

--mode copy (with --transfer agent; the default is stored): before the kubelet is asked, berthctl runs
'berthctl send-pages' in the source node's agent, which arms berth's shim for that container
(a request in the shim's page_stream_dir, /run/berth/page-streams) and connects to the
destination's agent. The shim then has CRIU send the memory pages through its own relay, which
digests them (the digest is in the checkpoint's signed berth.json), to the source agent and on
over mutual TLS to the destination's agent, which keeps them until the archive of the same
name arrives and its signed digest matches. The kubelet's archive then holds only the rest
(non-memory images, rootfs diff). A stream that fails fails the checkpoint: the pod runs on.
The destination's agent writes the pages with CRIU's page server: its container needs criu on
its PATH and the capability CHECKPOINT_RESTORE, which the image and the DaemonSet of
contrib/kubernetes do not give it (there a copy-mode move fails at its first page, safely).
--mode stored (the default): the archive holds the pages and is sent whole.

--transfer agent (the default) goes through the berth agents (contrib/kubernetes/
berth-agent-daemonset.yaml, namespace --agent-namespace): berthctl runs 'berthctl checkpoint
selector' in the source node's agent, then 'berthctl send' there, which sends the archive as it is
over mutual TLS to the destination node's agent ('berthctl receive' on the node's address); that
agent verifies the CRIU images and the signature before it keeps the checkpoint (the shim
verifies again at restore). berthctl reaches the agents with the pods/exec subresource through
the API server only, so it needs a kubeconfig allowed to exec in the agents' pods, no node
address and no certificate; the archive never passes through this machine.

--transfer shared-fs copies the archive through a file system this machine shares with the
nodes: --kubelet-checkpoints and --checkpoint-root are the source's kubelet checkpoint directory
and the destination's checkpoint root as seen here ({node} is replaced by the node's name); for a
single machine running several nodes (a lab) or node directories mounted here.

kubeconfig: --kubeconfig, else $KUBECONFIG, else ~/.kube/config; --context; -n is the pod's
namespace, as kubectl's (here it is not containerd's namespace).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cs, cfg, ns, err := kf.client()
			if err != nil {
				return err
			}
			o.Namespace, o.Pod = ns, args[0]
			if probe {
				probes.Client, probes.Config, probes.Namespace = cs, cfg, agents.Namespace
				o.Probe = probes
			}
			switch via {
			case "agent":
				agents.Client, agents.Config = cs, cfg
				o.Transfer, o.Selector, o.Preflight = agents, agents.ArchiveSelector, agents.Preflight
			case "shared-fs":
				root := rootTmpl
				if root == "" {
					if root, err = g.checkpointRoot(cmd.Flags(), ""); err != nil {
						return err
					}
				}
				kubelet := kube.RootTemplate(kubeletTm)
				o.Selector = func(_ context.Context, node, archive string) (map[string]string, error) {
					// the path as the kubelet named it, seen here in the node's directory
					m, err := readArchiveManifest(filepath.Join(kubelet(node), filepath.Base(archive)))
					if err != nil {
						return nil, err
					}
					return fingerprint.Selector(m.Fingerprint), nil
				}
				o.Transfer = sharedArchive{kube.SharedFS{Root: kube.RootTemplate(root)}, kubelet}
			default:
				return fmt.Errorf("--transfer %q: want agent or shared-fs", via)
			}
			if via != "shared-fs" && (cmd.Flags().Changed("checkpoint-root") || cmd.Flags().Changed("kubelet-checkpoints")) {
				return fmt.Errorf("--checkpoint-root and --kubelet-checkpoints apply to --transfer shared-fs only")
			}
			if !output.json() {
				fmt.Fprintf(cmd.OutOrStdout(), "moving pod %s/%s\n", ns, o.Pod)
				o.Progress = func(p kube.Phase) { fmt.Fprintf(cmd.OutOrStdout(), "  %-32s %9.1f ms\n", p.Name, p.Ms) }
			}
			res, err := kube.Move(cmd.Context(), cs, o)
			if err != nil {
				if res != nil && output.json() {
					_ = writeJSON(cmd.OutOrStdout(), res)
				}
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "  %-32s %9.1f ms\nmoved %s/%s (%s) -> %s/%s (%s), %s mode, archive %s (%s)", "total", res.TotalMs,
				ns, res.Pod, res.From, ns, res.Restored, res.To, res.Mode, res.Checkpoint, humanBytes(res.Bytes))
			if res.PageBytes > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), ", pages streamed %s", humanBytes(res.PageBytes))
			}
			fmt.Fprintln(cmd.OutOrStdout())
			return nil
		},
	}
	kf.add(cmd)
	cmd.Flags().StringVar(&o.To, "to", "", "destination node (default: any other Ready node whose labels match the checkpoint)")
	cmd.Flags().StringVarP(&o.Container, "container", "c", "", "the container to checkpoint (default: the pod's only container)")
	cmd.Flags().StringVar(&o.Name, "name", "", "the restore pod's name (default: POD-mNNNNN)")
	cmd.Flags().DurationVar(&o.Timeout, "timeout", 5*time.Minute, "how long to wait for the restore pod to be Ready")
	cmd.Flags().StringVar(&o.Mode, "mode", "", "stored (the kubelet's archive holds the memory pages) or copy (they go to the destination's agent during the dump, beside the archive; --transfer agent, and an agent image with CRIU: see --help)")
	cmd.Flags().StringVar(&via, "transfer", "agent", "how the archive reaches the destination: agent (the berth agents, node to node over mutual TLS) or shared-fs")
	cmd.Flags().StringVar(&agents.Namespace, "agent-namespace", kube.DefaultAgentNamespace, "the namespace of the berth agents (--transfer agent) and probes")
	cmd.Flags().BoolVar(&probe, "probe", true, "check bind sources, host PIDs and GPU memory through each node's berth probe before anything is checkpointed")
	cmd.Flags().StringVar(&probes.Labels, "probe-selector", kube.DefaultProbeSelector, "the label selector of the berth probes' pods")
	cmd.Flags().StringVar(&agents.Labels, "agent-selector", kube.DefaultAgentSelector, "the label selector of the berth agents' pods (--transfer agent)")
	cmd.Flags().StringVar(&rootTmpl, "checkpoint-root", "", "--transfer shared-fs: the destination's berth checkpoint root as seen here, {node} for its name (default: checkpoint_root of --config)")
	cmd.Flags().StringVar(&kubeletTm, "kubelet-checkpoints", DefaultKubeletCheckpointDir, "--transfer shared-fs: the source's kubelet checkpoint directory as seen here, {node} for its name")
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	return cmd
}

// sharedArchive reads the kubelet's archive at its place in the source node's directory as seen
// here.
type sharedArchive struct {
	kube.SharedFS
	kubelet func(node string) string
}

func (s sharedArchive) Copy(ctx context.Context, src, archive, dst, name string) (int64, error) {
	return s.SharedFS.Copy(ctx, src, filepath.Join(s.kubelet(src), filepath.Base(archive)), dst, name)
}
