package node

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// ContribDir returns contrib/kubernetes of the repository: the manifests a cluster applies.
func ContribDir() string { return filepath.Join(RepoRoot(), "contrib", "kubernetes") }

// applyContrib applies every manifest of contrib/kubernetes the way an operator would, with
// what this machine needs changed and nothing else:
//   - berth-nri-daemonset.yaml runs the locally built berth-nri image (NRIRef; no registry is
//     reachable here) and so places every container on every node;
//   - berth-labels-daemonset.yaml is applied as it is: its node selector asks for NVIDIA GPU
//     nodes, which this machine has none of, so it runs nowhere; labelNodes does its work;
//   - restore-pod.yaml, an example whose image and selector are placeholders, is validated by the
//     API server (server-side dry run) and not created;
//   - berth-checkpoint-gc-daemonset.yaml is validated by the API server (server-side dry run) and
//     not created: its host paths are the kubelet's fixed /var/lib/kubelet/checkpoints, which a
//     node here keeps elsewhere (KubeNode.CheckpointDir); the cluster test runs its berthctl
//     command with its policy over each node's directories instead.
//
// Then it waits until berth-nri is running and synchronized with containerd on every node.
func (c *KubeCluster) applyContrib(ctx context.Context) error {
	files, err := filepath.Glob(filepath.Join(ContribDir(), "*.yaml"))
	if err != nil {
		return err
	}
	// 00-namespace.yaml first; the example pod last, once its RuntimeClass exists
	slices.SortFunc(files, func(a, b string) int {
		ea, eb := filepath.Base(a) == "restore-pod.yaml", filepath.Base(b) == "restore-pod.yaml"
		if ea != eb {
			if ea {
				return 1
			}
			return -1
		}
		return strings.Compare(a, b)
	})
	// pods need their namespace's default service account, which the controller manager creates
	if err := c.waitServiceAccount(ctx, "default"); err != nil {
		return err
	}
	var nriApplied bool
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		args := []string{"apply", "-f", "-", "-o", "name"}
		switch filepath.Base(f) {
		case "berth-nri-daemonset.yaml":
			if !bytes.Contains(b, []byte(nriPublishedRef)) {
				return fmt.Errorf("%s does not name the image %s any more: update kubecontrib.go", f, nriPublishedRef)
			}
			b = bytes.ReplaceAll(b, []byte(nriPublishedRef), []byte(NRIRef))
			nriApplied = true
		case "restore-pod.yaml", "berth-checkpoint-gc-daemonset.yaml":
			args = append(args, "--dry-run=server")
		}
		out, err := c.KubectlIn(ctx, bytes.NewReader(b), args...)
		if err != nil {
			return fmt.Errorf("apply %s: %w", f, err)
		}
		for _, obj := range strings.Fields(out) {
			if ns, ok := strings.CutPrefix(obj, "namespace/"); ok {
				if err := c.waitServiceAccount(ctx, ns); err != nil {
					return err
				}
			}
		}
	}
	if !nriApplied {
		return fmt.Errorf("no berth-nri-daemonset.yaml in %s", ContribDir())
	}
	if _, err := c.Kubectl(ctx, "-n", "berth-system", "rollout", "status", "daemonset/berth-nri", "--timeout=120s"); err != nil {
		return err
	}
	for _, n := range c.Nodes {
		if err := c.waitNRI(ctx, n.Name); err != nil {
			return err
		}
	}
	return nil
}

// waitServiceAccount waits until namespace ns has its default service account.
func (c *KubeCluster) waitServiceAccount(ctx context.Context, ns string) error {
	var err error
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		if _, err = c.Kubectl(ctx, "-n", ns, "get", "serviceaccount", "default"); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("no default service account in namespace %s after 60s: %w", ns, err)
}

// waitNRI waits until the berth-nri pod on node says (kubectl logs) that it synchronized with
// containerd: from then on it places every container created there.
func (c *KubeCluster) waitNRI(ctx context.Context, node string) error {
	var last string
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
		pod, err := c.Kubectl(ctx, "-n", "berth-system", "get", "pods", "-l", "app.kubernetes.io/name=berth-nri",
			"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[0].metadata.name}")
		if err == nil && pod != "" {
			logs, err := c.Kubectl(ctx, "-n", "berth-system", "logs", pod)
			if err == nil && strings.Contains(logs, "berth-nri: synchronized") {
				return nil
			}
			last = logs
			if err != nil {
				last = err.Error()
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("berth-nri on %s did not synchronize in 60s: %s", node, last)
}

// readFeatureFile reads an NFD local feature file: NAME=VALUE lines, # comments.
func readFeatureFile(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	labels := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("feature file %s: line %q is not NAME=VALUE", path, line)
		}
		labels[k] = v
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(labels) == 0 {
		return nil, fmt.Errorf("feature file %s: no labels", path)
	}
	return labels, nil
}
