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

	"github.com/berth-dev/berth/oci/signature"
	transferkeys "github.com/berth-dev/berth/test/keys"
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
//   - berth-agent-daemonset.yaml runs on every node with the locally built berthctl image
//     (AgentRef), its Secret berth-agent-tls made by agentPKI, and its host paths under /etc/berth
//     replaced by AgentEtc's (the trusted keys every node's shim has, as the agent sees them), and
//     its collector run every AgentGCInterval instead of every 10 minutes (same policy). Its
//     other host paths are the usual ones: each node's mount namespace shows its kubelet
//     checkpoint directory and checkpoint root there (kubenode.go);
//   - berth-probe-daemonset.yaml runs on every node with the locally built berthctl image, as it
//     is otherwise: its host / is the node's mount namespace's (the kubelet and containerd run
//     there), its host PID namespace the machine's, which every node shares.
//
// Then it waits until berth-nri is running and synchronized with containerd on every node, and
// the agents run on every node.
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
	var nriApplied, agentApplied, probeApplied bool
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
		case "restore-pod.yaml":
			args = append(args, "--dry-run=server")
		case "berth-agent-daemonset.yaml":
			if b, err = c.agentManifest(ctx, b); err != nil {
				return err
			}
			agentApplied = true
		case "berth-probe-daemonset.yaml":
			if !bytes.Contains(b, []byte(agentPublishedRef)) {
				return fmt.Errorf("%s does not name the image %s any more: update kubecontrib.go", f, agentPublishedRef)
			}
			b = bytes.ReplaceAll(b, []byte(agentPublishedRef), []byte(AgentRef))
			probeApplied = true
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
	if !agentApplied {
		return fmt.Errorf("no berth-agent-daemonset.yaml in %s", ContribDir())
	}
	if !probeApplied {
		return fmt.Errorf("no berth-probe-daemonset.yaml in %s", ContribDir())
	}
	for _, ds := range []string{"daemonset/berth-nri", "daemonset/berth-agent", "daemonset/berth-probe"} {
		if _, err := c.Kubectl(ctx, "-n", "berth-system", "rollout", "status", ds, "--timeout=120s"); err != nil {
			pods, _ := c.Kubectl(ctx, "-n", "berth-system", "get", "pods", "-o", "wide")
			events, _ := c.Kubectl(ctx, "-n", "berth-system", "get", "events", "--sort-by=.lastTimestamp")
			logs, _ := c.Kubectl(ctx, "-n", "berth-system", "logs", "-l", "app.kubernetes.io/part-of=berth", "--all-containers", "--prefix", "--tail=20")
			return fmt.Errorf("%w\npods:\n%s\nevents:\n%s\nlogs:\n%s", err, pods, lastLines(events, 30), logs)
		}
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

// Image refs of the agent DaemonSet.
const (
	// AgentRef is the berthctl image (berthctl at /usr/local/bin/berthctl) the agent DaemonSet
	// runs instead of its published image.
	AgentRef = "localhost/berth/berthctl:test"
	// agentPublishedRef is the image berth-agent-daemonset.yaml names.
	agentPublishedRef = "registry.example/berth/berthctl:latest"
	// agentName is the name in the agents' shared certificate (berth-agent-daemonset.yaml).
	agentName = "berth-agent.berth-system"
	// AgentGCInterval is how often the agent DaemonSet's collector runs here.
	AgentGCInterval = 2 * time.Second
	// AgentNodeKey is the node's private key beside shim.toml in AgentEtc (signing_key names
	// /etc/berth/node.key), which berth-agent-daemonset.yaml must not mount into the agent.
	AgentNodeKey = "node.key"
)

// agentManifest returns berth-agent-daemonset.yaml (b) for this cluster: the local image, and the
// host paths /etc/berth/shim.toml and /etc/berth/keys replaced by those of AgentEtc, a directory
// laid out as a node's /etc/berth: shim.toml with signing_key (node.key, beside it, mode 0600)
// and the trusted keys of every node (their public keys in keys/, named as the agent's container
// sees them).
// It also creates the agents' transfer PKI (a CA of its own, one certificate naming
// berth-agent.berth-system, as cert-manager would issue it) as the Secret berth-agent-tls.
func (c *KubeCluster) agentManifest(ctx context.Context, b []byte) ([]byte, error) {
	for _, want := range []string{agentPublishedRef, "path: /etc/berth/shim.toml\n", "path: /etc/berth/keys\n", agentName, "--interval=10m"} {
		if !bytes.Contains(b, []byte(want)) {
			return nil, fmt.Errorf("berth-agent-daemonset.yaml does not hold %q any more: update kubecontrib.go", want)
		}
	}
	b = bytes.ReplaceAll(b, []byte(agentPublishedRef), []byte(AgentRef))
	// the collector's policy as shipped, applied every 2 s instead of every 10 minutes
	b = bytes.ReplaceAll(b, []byte("--interval=10m"), []byte("--interval="+AgentGCInterval.String()))
	c.AgentEtc = filepath.Join(c.Dir, "agent-etc")
	b = bytes.ReplaceAll(b, []byte("path: /etc/berth/shim.toml\n"), []byte("path: "+filepath.Join(c.AgentEtc, "shim.toml")+"\n"))
	b = bytes.ReplaceAll(b, []byte("path: /etc/berth/keys\n"), []byte("path: "+filepath.Join(c.AgentEtc, "keys")+"\n"))
	if err := os.MkdirAll(filepath.Join(c.AgentEtc, "keys"), 0o755); err != nil {
		return nil, err
	}
	// a node's /etc/berth also holds its private key, which shim.toml names: the agent must
	// neither see it nor need it (TestKubeMove checks it is not in the agent's container)
	if err := WriteKeyPair(filepath.Join(c.AgentEtc, AgentNodeKey), filepath.Join(c.AgentEtc, "node.pub")); err != nil {
		return nil, err
	}
	var keys []signature.TrustedKey
	for _, n := range c.Nodes {
		pub, err := os.ReadFile(n.PublicKey)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(c.AgentEtc, "keys", n.Name+".pub"), pub, 0o644); err != nil {
			return nil, err
		}
		keys = append(keys, signature.TrustedKey{Path: "/etc/berth/keys/" + n.Name + ".pub"})
	}
	cfg := fmt.Sprintf("signing_key = %q\n%s\n", "/etc/berth/"+AgentNodeKey, trustedKeysLine(keys))
	if err := os.WriteFile(filepath.Join(c.AgentEtc, "shim.toml"), []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	ca, err := transferkeys.NewCA(filepath.Join(c.Dir, "agent-pki"), "berth-test-transfer-ca")
	if err != nil {
		return nil, err
	}
	files, err := ca.Node(agentName)
	if err != nil {
		return nil, err
	}
	if _, err := c.Kubectl(ctx, "-n", "berth-system", "create", "secret", "generic", "berth-agent-tls",
		"--from-file=ca.crt="+files.CA, "--from-file=tls.crt="+files.Cert, "--from-file=tls.key="+files.Key); err != nil {
		return nil, err
	}
	return b, nil
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
