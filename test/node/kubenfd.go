package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Node Feature Discovery, as a cluster runs it: nfd-master beside the control plane, and on every
// node nfd-worker with its local source, which reads the feature files under NFD's fixed
// directory. berthctl labels writes the node's file there; the worker publishes it as a NodeFeature
// object and the master turns it into node labels, which restore pods select on.

// nfdNamespace holds the NodeFeature objects the workers publish.
const nfdNamespace = "node-feature-discovery"

// nfdFeaturesDir is where NFD's local source reads feature files (fixed in NFD).
const nfdFeaturesDir = "/etc/kubernetes/node-feature-discovery/features.d"

// nfdWorkerSetup runs in a mount namespace of the worker's own: the node's features.d ($1) at
// nfdFeaturesDir, under an overlay over /etc whose upper layer is a tmpfs ($2), so that nothing
// changes in the machine's /etc; then the worker ("$@").
const nfdWorkerSetup = `set -eu
F=$1 T=$2; shift 2
mount -t tmpfs -o mode=0755,size=4m berth-nfd "$T"
mkdir -p "$T/upper" "$T/work"
mount -t overlay -o lowerdir=/etc,upperdir="$T/upper",workdir="$T/work" berth-nfd-etc /etc
mkdir -p ` + nfdFeaturesDir + `
mount --bind "$F" ` + nfdFeaturesDir + `
exec "$@"
`

// labelNodes installs NFD's CRDs, starts nfd-master, and on every node writes the feature file
// with `berthctl labels` (the label writer DaemonSet's command, with the node's runc, containerd
// and CRIU) and runs nfd-worker once; it waits until every node carries its file's labels.
func (c *KubeCluster) labelNodes(ctx context.Context) error {
	if _, err := c.Kubectl(ctx, "apply", "-f", c.Kube.NFDCRDs()); err != nil {
		return err
	}
	if _, err := c.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/nodefeatures.nfd.k8s-sigs.io", "crd/nodefeaturerules.nfd.k8s-sigs.io", "crd/nodefeaturegroups.nfd.k8s-sigs.io"); err != nil {
		return err
	}
	if _, err := c.Kubectl(ctx, "create", "namespace", nfdNamespace); err != nil {
		return err
	}
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	// the master annotates the node it runs on (NODE_NAME): in a cluster, a pod on some node
	master, err := startProc("nfd-master", filepath.Join(c.Dir, "cp", "nfd-master.log"),
		append(os.Environ(), "NODE_NAME="+c.Nodes[0].Name), c.Kube.Tool("nfd-master"),
		"-kubeconfig="+c.Kubeconfig, fmt.Sprintf("-port=%d", ports[0]), "-config=/dev/null")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, master)
	for _, n := range c.Nodes {
		cmd := exec.CommandContext(ctx, c.Berthctl(), "labels", "--gpu", "none", "--criu", c.Stack.Tool("criu"), "--file", n.FeatureFile)
		cmd.Env = n.Env
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("berthctl labels on %s: %w: %s", n.Name, err, out)
		}
		if n.Labels, err = readFeatureFile(n.FeatureFile); err != nil {
			return err
		}
		tmp := filepath.Join(n.Dir, "nfd-etc")
		if err := os.MkdirAll(tmp, 0o755); err != nil {
			return err
		}
		// the worker publishes with the admin's credentials (its ServiceAccount's in a real cluster)
		w := exec.CommandContext(ctx, "/bin/sh", "-c", nfdWorkerSetup, "sh", filepath.Dir(n.FeatureFile), tmp,
			c.Kube.Tool("nfd-worker"), "-kubeconfig="+c.Kubeconfig, "-oneshot", "-config=/dev/null",
			"-feature-sources=local", "-label-sources=local")
		w.Env = append(os.Environ(), "NODE_NAME="+n.Name, "KUBERNETES_NAMESPACE="+nfdNamespace)
		w.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
		if out, err := w.CombinedOutput(); err != nil {
			return fmt.Errorf("nfd-worker on %s: %w: %s", n.Name, err, out)
		}
	}
	for _, n := range c.Nodes {
		if err := c.waitLabels(ctx, master, n); err != nil {
			return err
		}
	}
	return nil
}

// waitLabels waits until node n carries every label of n.Labels.
func (c *KubeCluster) waitLabels(ctx context.Context, master *proc, n *KubeNode) error {
	var missing []string
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		if master.exited() {
			return fmt.Errorf("nfd-master exited (log %s):\n%s", master.log, master.tail())
		}
		out, err := c.Kubectl(ctx, "get", "node", n.Name, "-o", "jsonpath={.metadata.labels}")
		if err != nil {
			return err
		}
		var have map[string]string
		if err := json.Unmarshal([]byte(out), &have); err != nil {
			return fmt.Errorf("labels of %s: %w", n.Name, err)
		}
		missing = missing[:0]
		for k, v := range n.Labels {
			if have[k] != v {
				missing = append(missing, k+"="+v)
			}
		}
		if len(missing) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("node %s lacks labels from its feature file after 60s (nfd-master log %s): %s", n.Name, master.log, strings.Join(missing, " "))
}
