package node

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"text/template"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/berth-dev/berth/gpu/fake"
)

// Options configure one node.
type Options struct {
	// Name is the node's name ("node1"); its files live in Dir/Name.
	Name string
	// Dir is the parent directory of the node's files. Keep it short: unix socket paths are
	// limited to 108 bytes.
	Dir string
	// Stack is the installed real stack.
	Stack Stack
	// BerthBin is the directory holding containerd-shim-berth-v2 (and berth-shim-helper,
	// berthctl), put first in containerd's PATH so containerd starts berth's shim for runtime
	// io.containerd.berth.v2.
	BerthBin string
	// PodCIDR is the CNI bridge subnet for CRI pods, e.g. "10.88.71.0/24"; Bridge its bridge name.
	PodCIDR, Bridge string
	// FakeGPUs is the number of fake GPUs (gpu/fake) the node gets, "Fake H200" with 4 GiB each,
	// UUIDs GPU-<name>-<i>; the shim is configured with gpu = "fake". 0: no GPUs.
	FakeGPUs int
	// NRISocket is where containerd serves NRI, as containerd sees it; default Dir/Name/nri.sock.
	NRISocket string
	// Wrap is put before containerd's command line, for example nsenter into the mount
	// namespace of a Kubernetes node (kubenode.go); nil runs containerd directly.
	Wrap []string
}

// Node is a running local containerd.
type Node struct {
	Name string
	// Dir holds everything of the node: root, state, sockets, logs, checkpoints.
	Dir string
	// Socket is containerd's gRPC socket; NRISocket the NRI socket plugins connect to.
	Socket, NRISocket string
	// CheckpointRoot is the berth shim's checkpoint root on this node.
	CheckpointRoot string
	// XDG is the node's XDG_RUNTIME_DIR (containerd unpacks restored checkpoints there).
	XDG string
	// Log is containerd's log file.
	Log string
	// Env is the environment containerd (and so its shims) runs with.
	Env []string
	// SigningKey is the node's private key (0600), PublicKey its public key: the node's shim signs
	// every checkpoint with it (trust.go).
	SigningKey, PublicKey string
	// GPU is the node's fake GPU root (nil without fake GPUs).
	GPU   *fake.Node
	stack Stack
	cmd   *exec.Cmd
}

var configTmpl = template.Must(template.New("c").Parse(`version = 3
root = '{{.Dir}}/root'
state = '{{.Dir}}/state'
[grpc]
  address = '{{.Dir}}/containerd.sock'
[ttrpc]
  address = '{{.Dir}}/containerd.sock.ttrpc'
[debug]
  level = 'info'
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'localhost/berth/pause:3.10'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_criu = true
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        sandboxer = 'podsandbox'
        disable_pause_image_pull = true
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.berth]
        runtime_type = 'io.containerd.berth.v2'
        sandboxer = 'podsandbox'
        disable_pause_image_pull = true
        pod_annotations = ['berth.dev/*']
        container_annotations = ['berth.dev/*']
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{{.CNIBin}}']
      conf_dir = '{{.Dir}}/cni'
  [plugins.'io.containerd.nri.v1.nri']
    disable = false
    socket_path = '{{.NRISocket}}'
    plugin_path = '{{.Dir}}/nri-plugins'
    plugin_config_path = '{{.Dir}}/nri-conf.d'
`))

var cniTmpl = template.Must(template.New("n").Parse(`{
  "cniVersion": "1.0.0",
  "name": "berth-{{.Name}}",
  "plugins": [
    {"type": "bridge", "bridge": "{{.Bridge}}", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "{{.PodCIDR}}"}]], "dataDir": "{{.Dir}}/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`))

// Start writes the node's configuration and starts its containerd, waiting until it answers.
// On error nothing of the node keeps running.
func Start(ctx context.Context, o Options) (_ *Node, retErr error) {
	dir := filepath.Join(o.Dir, o.Name)
	if o.PodCIDR == "" {
		o.PodCIDR = "10.88.77.0/24"
	}
	if o.Bridge == "" {
		o.Bridge = "berth-" + o.Name
	}
	if o.NRISocket == "" {
		o.NRISocket = filepath.Join(dir, "nri.sock")
	}
	n := &Node{
		Name: o.Name, Dir: dir,
		Socket:         filepath.Join(dir, "containerd.sock"),
		NRISocket:      o.NRISocket,
		CheckpointRoot: filepath.Join(dir, "checkpoints"),
		XDG:            filepath.Join(dir, "xdg"),
		Log:            filepath.Join(dir, "containerd.log"),
		SigningKey:     filepath.Join(dir, "node.key"),
		PublicKey:      filepath.Join(dir, "node.pub"),
		stack:          o.Stack,
	}
	if len(n.Socket) > 100 {
		return nil, fmt.Errorf("node dir %s: socket path %s is too long for a unix socket", dir, n.Socket)
	}
	for _, d := range []string{dir, n.XDG, filepath.Join(dir, "cni"), filepath.Join(dir, "nri-plugins"), filepath.Join(dir, "nri-conf.d")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(n.CheckpointRoot, 0o700); err != nil {
		return nil, err
	}
	data := map[string]string{"Dir": dir, "CNIBin": o.Stack.CNIBin, "Name": o.Name, "Bridge": o.Bridge, "PodCIDR": o.PodCIDR, "NRISocket": o.NRISocket}
	if err := writeTemplate(filepath.Join(dir, "containerd.toml"), configTmpl, data); err != nil {
		return nil, err
	}
	if err := writeTemplate(filepath.Join(dir, "cni", "10-berth.conflist"), cniTmpl, data); err != nil {
		return nil, err
	}
	if err := WriteKeyPair(n.SigningKey, n.PublicKey); err != nil {
		return nil, err
	}
	shimCfg := fmt.Sprintf("checkpoint_root = %q\ncriu_path = %q\nsigning_key = %q\n", n.CheckpointRoot, o.Stack.Tool("criu"), n.SigningKey)
	if o.FakeGPUs > 0 {
		spec := fake.NodeSpec{Driver: "580.65.06", CUDA: "12.8"}
		for i := 0; i < o.FakeGPUs; i++ {
			spec.GPUs = append(spec.GPUs, fake.GPUSpec{UUID: fmt.Sprintf("GPU-%s-%d", o.Name, i), Name: "Fake H200", MemoryBytes: 4 << 30})
		}
		var err error
		if n.GPU, err = fake.Setup(filepath.Join(dir, "fakegpu"), spec); err != nil {
			return nil, err
		}
		shimCfg += fmt.Sprintf("gpu = \"fake\"\nfake_gpu_root = %q\n", n.GPU.Root())
	}
	if err := os.WriteFile(filepath.Join(dir, "shim.toml"), []byte(shimCfg), 0o644); err != nil {
		return nil, err
	}
	crictl := fmt.Sprintf("runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 120\n", n.Socket, n.Socket)
	if err := os.WriteFile(filepath.Join(dir, "crictl.yaml"), []byte(crictl), 0o644); err != nil {
		return nil, err
	}
	path := o.Stack.Bin + ":" + os.Getenv("PATH")
	if o.BerthBin != "" {
		path = o.BerthBin + ":" + path
	}
	n.Env = append(filterEnv(os.Environ(), "PATH", "XDG_RUNTIME_DIR", "BERTH_SHIM_CONFIG"),
		"PATH="+path, "XDG_RUNTIME_DIR="+n.XDG, "BERTH_SHIM_CONFIG="+filepath.Join(dir, "shim.toml"))

	logf, err := os.OpenFile(n.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	argv := append(append([]string{}, o.Wrap...), o.Stack.Tool("containerd"), "--config", filepath.Join(dir, "containerd.toml"))
	n.cmd = exec.Command(argv[0], argv[1:]...)
	n.cmd.Env = n.Env
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := n.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start containerd for %s: %w", o.Name, err)
	}
	_ = os.WriteFile(filepath.Join(dir, "containerd.pid"), []byte(fmt.Sprint(n.cmd.Process.Pid)), 0o644)
	defer func() {
		if retErr != nil {
			n.Stop(context.Background())
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := containerd.New(n.Socket, containerd.WithTimeout(time.Second))
		if err == nil {
			_, verr := c.Version(ctx)
			c.Close()
			if verr == nil {
				return n, nil
			}
			err = verr
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("containerd of %s did not answer in 30s (log %s): %w", o.Name, n.Log, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Client returns a containerd client for the node. Callers close it.
func (n *Node) Client() (*containerd.Client, error) {
	return containerd.New(n.Socket, containerd.WithTimeout(10*time.Second))
}

// Ctr runs the stack's ctr against this node with args and returns its combined output.
func (n *Node) Ctr(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, n.stack.Tool("ctr"), append([]string{"--address", n.Socket}, args...)...)
	cmd.Env = n.Env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s on %s: %w: %s", strings.Join(args, " "), n.Name, err, out)
	}
	return string(out), nil
}

// Crictl runs the stack's crictl against this node and returns its standard output (trimmed);
// the error carries its standard error.
func (n *Node) Crictl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, n.stack.Tool("crictl"), append([]string{"--config", filepath.Join(n.Dir, "crictl.yaml")}, args...)...)
	cmd.Env = n.Env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("crictl %s on %s: %w: %s", strings.Join(args, " "), n.Name, err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// Import imports an OCI image-layout tar into namespace ns with `ctr images import`.
func (n *Node) Import(ctx context.Context, ns, tar string) error {
	_, err := n.Ctr(ctx, "-n", ns, "images", "import", tar)
	return err
}

// Stop removes every task and container the node holds (all namespaces), stops its containerd
// (by the PID this package started), ends shims this containerd started that are still alive,
// and unmounts what remains under the node's directory. It never touches other processes.
func (n *Node) Stop(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if c, err := n.Client(); err == nil {
		n.removeAll(ctx, c)
		c.Close()
	}
	if n.cmd != nil && n.cmd.Process != nil {
		_ = n.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { n.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = n.cmd.Process.Kill()
			<-done
		}
	}
	for _, pid := range n.shimPIDs() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	unmountUnder(n.Dir)
	return nil
}

func (n *Node) removeAll(ctx context.Context, c *containerd.Client) {
	nss, err := c.NamespaceService().List(ctx)
	if err != nil {
		return
	}
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		cs, err := c.Containers(nctx)
		if err != nil {
			continue
		}
		for _, ctr := range cs {
			if t, err := ctr.Task(nctx, nil); err == nil {
				_ = t.Kill(nctx, syscall.SIGKILL)
				if ch, err := t.Wait(nctx); err == nil {
					select {
					case <-ch:
					case <-time.After(5 * time.Second):
					}
				}
				_, _ = t.Delete(nctx, containerd.WithProcessKill)
			}
			if err := ctr.Delete(nctx, containerd.WithSnapshotCleanup); err != nil && !errdefs.IsNotFound(err) {
				_ = ctr.Delete(nctx)
			}
		}
	}
}

// shimPIDs returns the PIDs of shims started by this node's containerd (their command line names
// this node's socket).
func (n *Node) shimPIDs() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) > 0 && strings.HasPrefix(filepath.Base(args[0]), "containerd-shim-") && strings.Contains(string(b), "\x00"+n.Socket+"\x00") {
			pids = append(pids, pid)
		}
	}
	return pids
}

func unmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	defer f.Close()
	var mps []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			mps = append(mps, fields[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(mps)))
	for _, m := range mps {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

func writeTemplate(path string, t *template.Template, data any) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := t.Execute(f, data); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func filterEnv(env []string, drop ...string) []string {
	var out []string
next:
	for _, kv := range env {
		for _, d := range drop {
			if strings.HasPrefix(kv, d+"=") {
				continue next
			}
		}
		out = append(out, kv)
	}
	return out
}
