package node

import (
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"text/template"
	"time"
)

// KubeNode is one Kubernetes node: a containerd node of this package and its kubelet, isolated
// from the machine and from the other nodes:
//   - a private mount namespace, held by a process of its own, in which containerd, its shims
//     and the kubelet run: a tmpfs over /run (containerd's runc state, shim sockets, pod network
//     namespaces and the NRI socket at /var/run/nri/nri.sock, where the berth-nri DaemonSet
//     looks for it), a tmpfs over /var/lib (the kubelet's fixed /var/lib/kubelet/device-plugins and
//     pod-resources sockets), its kubelet checkpoint directory and berth checkpoint root bound
//     at /var/lib/kubelet/checkpoints and /var/lib/berth/checkpoints (where the agent DaemonSet
//     mounts them from), the node's own /var/log (the kubelet's /var/log/containers links) and
//     files over the /proc/sys tunables the kubelet would otherwise rewrite for the whole machine;
//   - a cgroup root of its own in every hierarchy (two kubelets under one root remove each
//     other's pod cgroups);
//   - a CNI bridge whose gateway address is the node IP (a kubelet refuses a loopback node IP),
//     where the kubelet serves on the usual port 10250;
//   - its own kubelet root directory (pods, checkpoint archives), pod log directory, serving
//     certificate and token.
type KubeNode struct {
	*Node
	// IP is the node IP: the gateway address of the node's CNI bridge.
	IP string
	// KubeletDir is the kubelet's root directory; CheckpointDir = KubeletDir/checkpoints is
	// where the kubelet checkpoint API writes archives.
	KubeletDir, CheckpointDir string
	// CgroupRoot is the kubelet's cgroupRoot (one directory in every cgroup hierarchy).
	CgroupRoot string
	// FeatureFile is the node's Node Feature Discovery feature file, written by berthctl labels;
	// NFD's worker reads its directory as /etc/kubernetes/node-feature-discovery/features.d.
	FeatureFile string
	// Labels are the berth.dev/* labels in FeatureFile, which NFD put on the node.
	Labels map[string]string

	bridge     string
	bridgeLock net.Listener // holds the bridge's name (see startNode)
	holder     *proc        // holds the mount namespace
	kubelet    *proc
	// madeCgroups says that CgroupRoot was created (and so is removed) in every hierarchy
	madeCgroups bool
}

// kubeTunables are the sysctls the kubelet sets at start (setupKernelTunables) with the values it
// wants; each node sees files with these values over /proc/sys, so nothing changes on the machine.
var kubeTunables = map[string]string{
	"vm/overcommit_memory":      "1",
	"vm/panic_on_oom":           "0",
	"kernel/panic":              "10",
	"kernel/panic_on_oops":      "1",
	"kernel/keys/root_maxkeys":  "1000000",
	"kernel/keys/root_maxbytes": "25000000",
}

// nsSetup runs in the node's mount namespace before containerd starts; $1 is the node directory.
const nsSetup = `set -eu
D=$1
mount -t tmpfs -o mode=0755,size=64m berth-kube-run /run
mkdir -p /run/nri /run/lock
mount -t tmpfs -o mode=0755,size=16m berth-kube-varlib /var/lib
mkdir -p /var/lib/kubelet
mount --bind "$D/varlog" /var/log
# where a node keeps its checkpoints, as the agent DaemonSet's host paths name them
mkdir -p /var/lib/kubelet/checkpoints /var/lib/berth/checkpoints
mount --bind "$D/kubelet/checkpoints" /var/lib/kubelet/checkpoints
mount --bind "$D/checkpoints" /var/lib/berth/checkpoints
for f in "$D"/sysctl/*; do
  mount --bind "$f" "/proc/sys/$(basename "$f" | tr . /)"
done
`

var kubeletConfigTmpl = template.Must(template.New("k").Parse(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {{.IP}}
port: 10250
readOnlyPort: 0
healthzPort: 0
tlsCertFile: {{.Dir}}/kubelet.crt
tlsPrivateKeyFile: {{.Dir}}/kubelet.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {{.CA}}
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: {{.CgroupRoot}}
cgroupsPerQOS: true
# this machine runs cgroup v1 (hybrid): allowed for a test node
failCgroupV1: false
failSwapOn: false
# no iptables chains on the machine
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://{{.Socket}}
podLogsDir: {{.Dir}}/pod-logs
resolvConf: /etc/resolv.conf
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
# the test images cannot be pulled again: never garbage-collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
`))

// startNode starts node i (kube<i>): bridge, cgroup root, mount namespace, containerd (with the
// images imported) and the kubelet. A node returned with an error holds what was started, for
// stop.
func (c *KubeCluster) startNode(ctx context.Context, i int, shimExtra string) (*KubeNode, error) {
	name := fmt.Sprintf("kube%d", i)
	dir := filepath.Join(c.Dir, name)
	kn := &KubeNode{
		IP:         fmt.Sprintf("10.88.%d.1", 90+i),
		bridge:     fmt.Sprintf("berth-k%d", i),
		KubeletDir: filepath.Join(dir, "kubelet"),
		// unique on the machine: another cluster (or a left-over one) never shares it
		CgroupRoot:  fmt.Sprintf("/berth-kube-%d-%s", os.Getpid(), name),
		FeatureFile: filepath.Join(dir, "features.d", "berth"),
	}
	kn.CheckpointDir = filepath.Join(kn.KubeletDir, "checkpoints")
	for _, d := range []string{kn.KubeletDir, filepath.Join(dir, "varlog"), filepath.Join(dir, "sysctl"),
		filepath.Join(dir, "pod-logs"), filepath.Dir(kn.FeatureFile)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	// bound into the node's mount namespace at the usual places (nsSetup) before containerd
	// and the kubelet create them: the kubelet's checkpoint directory and the checkpoint root
	for _, d := range []string{kn.CheckpointDir, filepath.Join(dir, "checkpoints")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	for k, v := range kubeTunables {
		if err := os.WriteFile(filepath.Join(dir, "sysctl", strings.ReplaceAll(k, "/", ".")), []byte(v+"\n"), 0o644); err != nil {
			return nil, err
		}
	}

	// the bridge first: its address is the node IP. Its name is held, while the cluster lives, by
	// an abstract unix socket (gone with the process, nothing on disk): a bridge of that name whose
	// socket is free was left by a run that was killed, and is replaced.
	l, err := net.Listen("unix", "@berth-kube-"+kn.bridge)
	if err != nil {
		return nil, fmt.Errorf("node %s: bridge %s is held by another cluster on this machine: %w", name, kn.bridge, err)
	}
	kn.bridgeLock = l
	if exec.Command("ip", "link", "show", kn.bridge).Run() == nil {
		fmt.Fprintf(c.log, "kube: node %s: removing bridge %s left by a killed run\n", name, kn.bridge)
		kn.deleteBridge()
	}
	for _, args := range [][]string{
		{"link", "add", kn.bridge, "type", "bridge"},
		{"addr", "add", kn.IP + "/24", "dev", kn.bridge},
		{"link", "set", kn.bridge, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return kn, fmt.Errorf("node %s: ip %s: %w: %s", name, strings.Join(args, " "), err, out)
		}
	}

	if err := kn.makeCgroups(); err != nil {
		return kn, fmt.Errorf("node %s: %w", name, err)
	}

	// the mount namespace: a process that only holds it; setup through nsenter
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return kn, err
	}
	holder := exec.Command("sleep", "infinity")
	holder.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Unshareflags: syscall.CLONE_NEWNS}
	if err := holder.Start(); err != nil {
		return kn, fmt.Errorf("node %s: mount namespace: %w", name, err)
	}
	kn.holder = &proc{name: name + " namespace", cmd: holder, done: make(chan struct{})}
	go func() { _ = holder.Wait(); close(kn.holder.done) }()
	enter := []string{"nsenter", fmt.Sprintf("--mount=/proc/%d/ns/mnt", holder.Process.Pid), "--"}
	if out, err := exec.CommandContext(ctx, enter[0], append(enter[1:], "/bin/sh", "-c", nsSetup, "sh", dir)...).CombinedOutput(); err != nil {
		return kn, fmt.Errorf("node %s: mount namespace setup: %w: %s", name, err, out)
	}

	nd, err := Start(ctx, Options{
		Name: name, Dir: c.Dir, Stack: c.Stack, BerthBin: c.BerthBin,
		PodCIDR: fmt.Sprintf("10.88.%d.0/24", 90+i), Bridge: kn.bridge,
		NRISocket: "/var/run/nri/nri.sock", Wrap: enter,
	})
	if err != nil {
		return kn, err
	}
	kn.Node = nd
	// seen from the machine, through the namespace holder's root
	nd.NRISocket = fmt.Sprintf("/proc/%d/root/run/nri/nri.sock", holder.Process.Pid)
	if shimExtra != "" {
		if _, err := nd.AppendShimConfig(shimExtra); err != nil {
			return kn, err
		}
	}
	for _, tar := range c.Images {
		if err := nd.Import(ctx, "k8s.io", tar); err != nil {
			return kn, err
		}
	}

	// the kubelet: serving certificate for the node IP, token, configuration
	if err := c.pki.sign(filepath.Join("..", name, "kubelet"), pkix.Name{CommonName: "system:node:" + name, Organization: []string{"system:nodes"}},
		x509.ExtKeyUsageServerAuth, []string{name}, []net.IP{net.ParseIP(kn.IP)}); err != nil {
		return kn, err
	}
	kubeconfig, err := c.pki.kubeconfig(name, c.Server, c.pki.NodeTokens[name])
	if err != nil {
		return kn, err
	}
	cfg := filepath.Join(dir, "kubelet-config.yaml")
	if err := writeTemplate(cfg, kubeletConfigTmpl, map[string]string{
		"IP": kn.IP, "Dir": dir, "CA": c.pki.path("ca.crt"), "CgroupRoot": kn.CgroupRoot, "Socket": nd.Socket,
	}); err != nil {
		return kn, err
	}
	argv := append(append([]string{}, enter...), c.Kube.Tool("kubelet"), "--config="+cfg, "--kubeconfig="+kubeconfig,
		"--root-dir="+kn.KubeletDir, "--cert-dir="+filepath.Join(kn.KubeletDir, "pki"),
		"--hostname-override="+name, "--node-ip="+kn.IP, "--v=1")
	if kn.kubelet, err = startProc(name+" kubelet", filepath.Join(dir, "kubelet.log"), nd.Env, argv...); err != nil {
		return kn, err
	}
	return kn, nil
}

// cgroupHierarchies returns the mounted cgroup hierarchies under /sys/fs/cgroup: each v1
// controller directory, or /sys/fs/cgroup itself on a cgroup v2 only machine. The v2 hierarchy of
// a hybrid machine (unified), which holds no controllers, only with unified: the kubelet creates
// its cgroups there too, so they are removed there, but nothing needs creating.
func cgroupHierarchies(unified bool) ([]string, error) {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		return []string{"/sys/fs/cgroup"}, nil
	}
	ents, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, err
	}
	var hs []string
	for _, e := range ents {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		if !e.IsDir() || (e.Name() == "unified" && !unified) {
			continue // a symlink (cpu -> cpu,cpuacct) names a hierarchy listed under its own name
		}
		if _, err := os.Stat(filepath.Join(p, "cgroup.procs")); err == nil {
			hs = append(hs, p)
		}
	}
	return hs, nil
}

// makeCgroups creates the node's cgroup root in every hierarchy (cpuset: with the parent's CPUs
// and memory nodes, which a new v1 cpuset does not inherit).
func (kn *KubeNode) makeCgroups() error {
	hs, err := cgroupHierarchies(false)
	if err != nil {
		return err
	}
	for _, h := range hs {
		p := filepath.Join(h, kn.CgroupRoot)
		if err := os.Mkdir(p, 0o755); err != nil {
			return fmt.Errorf("cgroup root: %w", err)
		}
		kn.madeCgroups = true
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if _, err := os.Stat(filepath.Join(h, f)); err != nil {
				continue
			}
			b, err := os.ReadFile(filepath.Join(h, f))
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(p, f), b, 0o644); err != nil {
				return fmt.Errorf("cgroup root %s: %w", f, err)
			}
		}
	}
	return nil
}

// removeCgroups removes every cgroup under the node's root, deepest first, and the root, in every
// hierarchy. A cgroup whose last process is still exiting is retried for a few seconds.
func (kn *KubeNode) removeCgroups() error {
	if !kn.madeCgroups {
		return nil
	}
	hs, err := cgroupHierarchies(true)
	if err != nil {
		return err
	}
	var left []string
	for try := 0; try < 50; try++ {
		left = left[:0]
		for _, h := range hs {
			root := filepath.Join(h, kn.CgroupRoot)
			var dirs []string
			_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, p)
				}
				return nil
			})
			slices.Reverse(dirs)
			for _, d := range dirs {
				if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
					left = append(left, d)
				}
			}
		}
		if len(left) == 0 {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("cgroups left: %s", strings.Join(left, " "))
}

func (kn *KubeNode) deleteBridge() {
	_ = exec.Command("ip", "link", "del", kn.bridge).Run()
}

// releaseBridge deletes the node's bridge and lets go of its name.
func (kn *KubeNode) releaseBridge() {
	if kn.bridgeLock == nil {
		return
	}
	kn.deleteBridge()
	kn.bridgeLock.Close()
	kn.bridgeLock = nil
}

// stop stops the kubelet, removes the pods through CRI (CNI releases their addresses and
// veths), stops containerd and its shims, ends the mount namespace and removes the cgroups and
// the bridge.
func (kn *KubeNode) stop(ctx context.Context) {
	kn.kubelet.stop(20 * time.Second)
	if kn.Node != nil {
		if ids, err := kn.Crictl(ctx, "pods", "-q"); err == nil {
			for _, id := range strings.Fields(ids) {
				kn.RemovePod(ctx, id)
			}
		}
		_ = kn.Node.Stop(ctx)
	}
	if kn.holder != nil {
		_ = kn.holder.cmd.Process.Kill()
		<-kn.holder.done
	}
	if err := kn.removeCgroups(); err != nil && kn.Node != nil {
		fmt.Fprintf(os.Stderr, "kube node %s: %v\n", kn.Name, err)
	}
	kn.releaseBridge()
}
