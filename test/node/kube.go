package node

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/test/image"
)

// A Kubernetes cluster on this machine for berth's tests: etcd, kube-apiserver,
// kube-controller-manager and kube-scheduler on loopback, and one kubelet per containerd node of
// this package, each node isolated (kubenode.go). The binaries are the ones test/stack/k8s.sh
// builds from Go modules; everything is started, and stopped, by the PIDs this package holds.

// EnvKube overrides where the Kubernetes binaries are found (a directory with bin/).
const EnvKube = "BERTH_KUBE"

// ErrNoKube is returned by FindKube when the Kubernetes binaries are not installed.
var ErrNoKube = errors.New("etcd, Kubernetes and Node Feature Discovery not installed (run `make deps-k8s`)")

// KubeStack is the installed etcd, Kubernetes and Node Feature Discovery binaries.
type KubeStack struct {
	// Dir is the prefix; Bin = Dir/bin.
	Dir, Bin string
}

// kubeTools are the binaries a cluster needs.
var kubeTools = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "nfd-master", "nfd-worker"}

// FindKube returns the binaries at $BERTH_KUBE, else at <repo>/_output/kube (linked by
// test/stack/k8s.sh), or ErrNoKube naming the missing one.
func FindKube() (KubeStack, error) {
	dir := os.Getenv(EnvKube)
	if dir == "" {
		dir = filepath.Join(RepoRoot(), "_output", "kube")
	}
	k := KubeStack{Dir: dir, Bin: filepath.Join(dir, "bin")}
	for _, tool := range kubeTools {
		if _, err := os.Stat(k.Tool(tool)); err != nil {
			return k, fmt.Errorf("%s missing in %s: %w", tool, k.Bin, ErrNoKube)
		}
	}
	if _, err := os.Stat(k.NFDCRDs()); err != nil {
		return k, fmt.Errorf("the CRDs of Node Feature Discovery: %w: %w", err, ErrNoKube)
	}
	return k, nil
}

// NFDCRDs returns the path of Node Feature Discovery's CustomResourceDefinitions (share/).
func (k KubeStack) NFDCRDs() string { return filepath.Join(k.Dir, "share", "nfd-api-crds.yaml") }

// Tool returns the path of a binary (bin/NAME).
func (k KubeStack) Tool(name string) string { return filepath.Join(k.Bin, name) }

// RequireKube is Require plus the Kubernetes binaries, and the commands that isolate a node
// (nsenter, ip): nil when a KubeCluster can start here, else an error wrapping ErrSkip.
func RequireKube() error {
	if err := Require(); err != nil {
		return err
	}
	if _, err := FindKube(); err != nil {
		return fmt.Errorf("%w: %w", err, ErrSkip)
	}
	for _, c := range []string{"nsenter", "ip", "sleep"} {
		if _, err := exec.LookPath(c); err != nil {
			return fmt.Errorf("%s: %w: %w", c, err, ErrSkip)
		}
	}
	return nil
}

// KubeOptions configure StartKube.
type KubeOptions struct {
	// Dir holds everything of the cluster; keep it short (unix socket paths).
	Dir string
	// Nodes is the number of kubelets (and containerd nodes): kube1..kubeN.
	Nodes int
	// ShimConfig is appended to every node's berth shim configuration (TOML keys).
	ShimConfig string
	// Log receives one line per step with its time; nil discards them.
	Log io.Writer
}

// KubeCluster is a running cluster.
type KubeCluster struct {
	Dir   string
	Stack Stack
	Kube  KubeStack
	// BerthBin holds containerd-shim-berth-v2, berth-shim-helper and berthctl.
	BerthBin string
	// Images maps the image refs imported on every node (namespace k8s.io) to their archives.
	Images map[string]string
	// Server is the API server's URL; Kubeconfig the admin's kubeconfig (group system:masters).
	Server, Kubeconfig string
	// Nodes are the nodes in order, kube1 first.
	Nodes []*KubeNode
	// AgentEtc is laid out as the nodes' /etc/berth; the agent DaemonSet mounts its shim.toml and
	// keys/ (kubecontrib.go).
	AgentEtc string
	// Timings are the bring-up steps and how long each took.
	Timings []Timing

	pki   *kubePKI
	procs []*proc // control plane, in start order
	log   io.Writer
}

// Timing is one step of StartKube.
type Timing struct {
	Step string
	Took time.Duration
}

// Image refs a cluster imports besides the workload and pause images.
const (
	// NRIRef is the berth-nri image (berth-nri at /usr/local/bin/berth-nri) the berth-nri
	// DaemonSet of contrib/kubernetes runs instead of its published image.
	NRIRef = "localhost/berth/berth-nri:test"
	// nriPublishedRef is the image berth-nri-daemonset.yaml names.
	nriPublishedRef = "registry.example/berth/berth-nri:latest"
	// kubeServiceIP is the first address of the service range (the kubernetes service).
	kubeServiceIP = "10.233.0.1"
)

// StartKube builds berth and the images, starts the control plane and o.Nodes nodes, waits until
// every node is Ready, applies contrib/kubernetes (RuntimeClass berth, the berth-nri DaemonSet on
// every node, the label writer, the agent DaemonSet: receiver and collector on every node), waits
// until berth-nri and the agents run on every node and has Node Feature
// Discovery label each node from the feature file `berthctl labels` writes there. On error
// everything started is stopped.
func StartKube(ctx context.Context, o KubeOptions) (_ *KubeCluster, retErr error) {
	if o.Nodes < 1 {
		return nil, fmt.Errorf("kube cluster: %d nodes", o.Nodes)
	}
	stack, err := FindStack()
	if err != nil {
		return nil, err
	}
	kube, err := FindKube()
	if err != nil {
		return nil, err
	}
	c := &KubeCluster{Dir: o.Dir, Stack: stack, Kube: kube, Images: map[string]string{}, log: o.Log}
	if c.log == nil {
		c.log = io.Discard
	}
	defer func() {
		if retErr != nil {
			c.Stop(context.WithoutCancel(ctx))
		}
	}()
	t0 := time.Now()
	if err := c.build(ctx); err != nil {
		return nil, err
	}
	c.step("build berth and images", t0)

	t0 = time.Now()
	var names []string
	for i := 1; i <= o.Nodes; i++ {
		names = append(names, fmt.Sprintf("kube%d", i))
	}
	if c.pki, err = newKubePKI(filepath.Join(o.Dir, "pki"), names); err != nil {
		return nil, err
	}
	if err := c.startControlPlane(ctx); err != nil {
		return nil, err
	}
	c.step("control plane up", t0)

	t0 = time.Now()
	for i := range names {
		kn, err := c.startNode(ctx, i+1, o.ShimConfig)
		if kn != nil {
			c.Nodes = append(c.Nodes, kn)
		}
		if err != nil {
			return nil, err
		}
	}
	// signing is on, as on a real cluster: each node's shim signs with its own key and trusts
	// every node of the cluster (a restore pod on kube2 restores kube1's kubelet archive)
	var trust Trust
	for _, kn := range c.Nodes {
		trust.Keys = append(trust.Keys, signature.TrustedKey{Path: kn.PublicKey})
	}
	for _, kn := range c.Nodes {
		if _, err := kn.SetTrust(trust); err != nil {
			return nil, err
		}
	}
	if err := c.waitNodesReady(ctx, 2*time.Minute); err != nil {
		return nil, err
	}
	c.step(fmt.Sprintf("%d nodes Ready", len(c.Nodes)), t0)

	t0 = time.Now()
	if err := c.applyContrib(ctx); err != nil {
		return nil, err
	}
	c.step("contrib/kubernetes applied, berth-nri and the agents on every node", t0)
	t0 = time.Now()
	if err := c.labelNodes(ctx); err != nil {
		return nil, err
	}
	c.step("nodes labelled by Node Feature Discovery from berthctl labels", t0)
	return c, nil
}

func (c *KubeCluster) step(what string, since time.Time) {
	d := time.Since(since)
	c.Timings = append(c.Timings, Timing{what, d})
	fmt.Fprintf(c.log, "kube: %s (%.1f s)\n", what, d.Seconds())
}

// build builds berth's shim and berthctl, and the images every node imports: pause, the
// inference workload, berth-nri and berthctl (the agents') (cached in <repo>/_output/images as the Cluster's are).
func (c *KubeCluster) build(ctx context.Context) error {
	var err error
	if c.BerthBin, err = BuildBerth(filepath.Join(c.Dir, "bin")); err != nil {
		return err
	}
	imgDir := filepath.Join(RepoRoot(), "_output", "images")
	if err := os.MkdirAll(imgDir, 0o755); err != nil {
		return err
	}
	for _, b := range []struct {
		out   string
		build func(out string) (string, error)
	}{
		{"pause.tar", func(out string) (string, error) { return image.BuildPause(ctx, out) }},
		{"infer.tar", func(out string) (string, error) { return image.BuildWorkload(ctx, RepoRoot(), out) }},
		{"berth-nri.tar", func(out string) (string, error) {
			return image.BuildGoImage(ctx, RepoRoot(), "./cmd/berth-nri", NRIRef, out, image.Config{})
		}},
		{"berthctl.tar", func(out string) (string, error) {
			return image.BuildGoImage(ctx, RepoRoot(), "./cmd/berthctl", AgentRef, out, image.Config{})
		}},
	} {
		out := filepath.Join(imgDir, b.out)
		ref, err := b.build(out)
		if err != nil {
			return fmt.Errorf("build image %s: %w", b.out, err)
		}
		c.Images[ref] = out
	}
	return nil
}

// startControlPlane starts etcd, the API server, the controller manager and the scheduler on
// loopback ports chosen free, and waits for etcd's health and the API server's readiness.
func (c *KubeCluster) startControlPlane(ctx context.Context) error {
	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	etcdClient, etcdPeer, apiPort, kcmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	cp := filepath.Join(c.Dir, "cp")
	if err := os.MkdirAll(cp, 0o700); err != nil {
		return err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	p, err := startProc("etcd", filepath.Join(cp, "etcd.log"), nil, c.Kube.Tool("etcd"),
		"--name=berth-test", "--data-dir="+filepath.Join(cp, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=berth-test="+peerURL, "--log-level=warn",
		// a test cluster's data is thrown away: no fsync on a shared, slow disk
		"--unsafe-no-fsync")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	if err := waitHTTP(ctx, p, http.DefaultClient, etcdURL+"/health", "", 30*time.Second); err != nil {
		return err
	}

	c.Server = fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	pki := c.pki
	p, err = startProc("kube-apiserver", filepath.Join(cp, "apiserver.log"), nil, c.Kube.Tool("kube-apiserver"),
		"--etcd-servers="+etcdURL, "--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", apiPort),
		// a documentation address (RFC 5737): the kubernetes service's endpoint, which nothing here
		// uses (no kube-proxy); the API server listens on loopback only
		"--advertise-address=192.0.2.1",
		"--service-cluster-ip-range=10.233.0.0/24",
		"--tls-cert-file="+pki.path("apiserver.crt"), "--tls-private-key-file="+pki.path("apiserver.key"),
		"--client-ca-file="+pki.path("ca.crt"), "--token-auth-file="+pki.path("tokens.csv"),
		"--kubelet-client-certificate="+pki.path("apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+pki.path("apiserver-kubelet-client.key"),
		"--kubelet-certificate-authority="+pki.path("ca.crt"),
		"--kubelet-preferred-address-types=InternalIP",
		"--service-account-issuer=https://kubernetes.default.svc", "--service-account-key-file="+pki.path("sa.pub"),
		"--service-account-signing-key-file="+pki.path("sa.key"),
		"--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction", "--profiling=false")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	pool := x509.NewCertPool()
	pool.AddCert(pki.caCert)
	api := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	if err := waitHTTP(ctx, p, api, c.Server+"/readyz", pki.AdminToken, 90*time.Second); err != nil {
		return err
	}
	if c.Kubeconfig, err = pki.kubeconfig("admin", c.Server, pki.AdminToken); err != nil {
		return err
	}
	p, err = startProc("kube-controller-manager", filepath.Join(cp, "controller-manager.log"), nil, c.Kube.Tool("kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig, "--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", kcmPort), "--leader-elect=false",
		"--service-account-private-key-file="+pki.path("sa.key"), "--root-ca-file="+pki.path("ca.crt"),
		"--use-service-account-credentials=true", "--profiling=false")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	p, err = startProc("kube-scheduler", filepath.Join(cp, "scheduler.log"), nil, c.Kube.Tool("kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig, "--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", fmt.Sprintf("--secure-port=%d", schedPort), "--leader-elect=false", "--profiling=false")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	return nil
}

// waitNodesReady waits until every node has registered and is Ready. A kubelet that exits is
// reported with the end of its log.
func (c *KubeCluster) waitNodesReady(ctx context.Context, timeout time.Duration) error {
	var last string
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
		for _, n := range c.Nodes {
			if n.kubelet.exited() {
				return fmt.Errorf("kubelet of %s exited (log %s):\n%s", n.Name, n.kubelet.log, n.kubelet.tail())
			}
		}
		out, err := c.Kubectl(ctx, "get", "nodes", "-o",
			`jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`)
		if err != nil {
			return err
		}
		ready := 0
		for _, line := range strings.Fields(out) {
			if strings.HasSuffix(line, "=True") {
				ready++
			}
		}
		if ready == len(c.Nodes) {
			return nil
		}
		last = strings.TrimSpace(out)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("nodes not Ready in %v: %q", timeout, last)
}

// Kubectl runs kubectl with the admin's kubeconfig and returns its standard output; the error
// carries its standard error.
func (c *KubeCluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	return c.KubectlIn(ctx, nil, args...)
}

// KubectlIn is Kubectl with stdin.
func (c *KubeCluster) KubectlIn(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, c.Kube.Tool("kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Stdin = stdin
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// Node returns the node named name, or nil.
func (c *KubeCluster) Node(name string) *KubeNode {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// Berthctl returns the path of the berthctl binary the cluster built.
func (c *KubeCluster) Berthctl() string { return filepath.Join(c.BerthBin, "berthctl") }

// Stop stops the nodes (kubelet, pods, containerd, namespace, cgroups, bridge) and then the
// control plane, each by the process this package started. It leaves c.Dir for the caller.
func (c *KubeCluster) Stop(ctx context.Context) {
	for i := len(c.Nodes) - 1; i >= 0; i-- {
		c.Nodes[i].stop(ctx)
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].stop(10 * time.Second)
	}
	c.Nodes, c.procs = nil, nil
}

// proc is a process this package started (own process group), with its exit observed.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// startProc starts argv with stdout and stderr appended to logPath.
func startProc(name, logPath string, env []string, argv ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM, waits up to grace, then SIGKILL.
func (p *proc) stop(grace time.Duration) {
	if p == nil || p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// tail returns the last lines of the process's log, for errors.
func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 15 {
		lines = lines[len(lines)-15:]
	}
	return strings.Join(lines, "\n")
}

// waitHTTP polls url until it answers 200, p exits or the timeout passes.
func waitHTTP(ctx context.Context, p *proc, client *http.Client, url, token string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if p.exited() {
			return fmt.Errorf("%s exited (log %s):\n%s", p.name, p.log, p.tail())
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s: %s", url, resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s not ready in %v (log %s): %w", p.name, timeout, p.log, last)
}

// freePorts returns n distinct loopback TCP ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
