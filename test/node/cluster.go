package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/test/image"
)

// Cluster is N local nodes with berth's binaries built and the test images imported.
type Cluster struct {
	Stack Stack
	// BerthBin holds containerd-shim-berth-v2, berth-shim-helper and berthctl.
	BerthBin string
	// Nodes are the running nodes, node1..nodeN.
	Nodes []*Node
	// Images maps image refs to their OCI archive paths.
	Images map[string]string
	// BerthctlConfig is the configuration berthctl runs with for this cluster (EnvShimConfig):
	// it signs with the operator key BerthctlKey (public key BerthctlPublicKey), which every node
	// trusts, and trusts every node's key.
	BerthctlConfig, BerthctlKey, BerthctlPublicKey string
}

// Namespace is the containerd namespace the harness imports images into and runs containers in.
const Namespace = "berth-test"

// StartCluster builds berth (into dir/bin), builds the test images (cached in
// <repo>/_output/images), and starts n nodes under dir with the images imported, each with a
// signing key of its own and trusting every node's and the operator key's (TrustEachOther,
// BerthctlConfig). On error, nodes already started are stopped.
func StartCluster(ctx context.Context, dir string, n int) (_ *Cluster, retErr error) {
	return StartClusterWith(ctx, dir, n, Options{})
}

// StartClusterWith is StartCluster with per-node options taken from tmpl (FakeGPUs); names,
// directories, the stack and networks are set per node.
func StartClusterWith(ctx context.Context, dir string, n int, tmpl Options) (_ *Cluster, retErr error) {
	stack, err := FindStack()
	if err != nil {
		return nil, err
	}
	c := &Cluster{Stack: stack, Images: map[string]string{}}
	if c.BerthBin, err = BuildBerth(filepath.Join(dir, "bin")); err != nil {
		return nil, err
	}
	imgDir := filepath.Join(RepoRoot(), "_output", "images")
	if err := os.MkdirAll(imgDir, 0o755); err != nil {
		return nil, err
	}
	builds := []struct {
		out   string
		build func(out string) (string, error)
	}{
		{"infer.tar", func(out string) (string, error) { return image.BuildWorkload(ctx, RepoRoot(), out) }},
		{"redis.tar", func(out string) (string, error) { return image.BuildRedis(ctx, out) }},
		{"pause.tar", func(out string) (string, error) { return image.BuildPause(ctx, out) }},
	}
	for _, b := range builds {
		out := filepath.Join(imgDir, b.out)
		ref, err := b.build(out)
		if err != nil {
			return nil, fmt.Errorf("build image %s: %w", b.out, err)
		}
		c.Images[ref] = out
	}
	defer func() {
		if retErr != nil {
			c.Stop(context.WithoutCancel(ctx))
		}
	}()
	for i := 1; i <= n; i++ {
		o := tmpl
		o.Name, o.Dir, o.Stack, o.BerthBin = fmt.Sprintf("node%d", i), dir, stack, c.BerthBin
		o.PodCIDR, o.Bridge = fmt.Sprintf("10.88.%d.0/24", 70+i), fmt.Sprintf("berth-n%d", i)
		nd, err := Start(ctx, o)
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, nd)
		for ref, tar := range c.Images {
			ns := Namespace
			if ref == image.PauseRef {
				ns = "k8s.io"
			}
			if err := nd.Import(ctx, ns, tar); err != nil {
				return nil, err
			}
		}
	}
	if err := c.writeBerthctlConfig(dir); err != nil {
		return nil, err
	}
	if err := c.TrustEachOther(); err != nil {
		return nil, err
	}
	return c, nil
}

// Stop stops every node (see Node.Stop).
func (c *Cluster) Stop(ctx context.Context) {
	for _, n := range c.Nodes {
		_ = n.Stop(ctx)
	}
}

// Berthctl returns the path of the berthctl binary the cluster built.
func (c *Cluster) Berthctl() string { return filepath.Join(c.BerthBin, "berthctl") }

// RunOptions describe a container for Run.
type RunOptions struct {
	// ID is the container id (unique across nodes: nodes on one host share runc's state root).
	ID string
	// Image is an image ref imported by the cluster.
	Image string
	// Args replace the image's entrypoint and command when set.
	Args []string
	// Runtime is the containerd runtime ("io.containerd.berth.v2" by default).
	Runtime string
	// LogPath receives stdout and stderr.
	LogPath string
	// Annotations are added to the container's OCI spec (for example runc's org.criu.config, the
	// CRIU configuration file runc hands to CRIU on checkpoint and restore).
	Annotations map[string]string
	// GPUs are fake GPU UUIDs of the node given to the container (bind mounts at
	// /dev/berth-gpu/<i> and BERTH_FAKE_GPUS).
	GPUs []string
}

// Run creates and starts a container on the node in Namespace and returns its task's init PID.
func (n *Node) Run(ctx context.Context, o RunOptions) (uint32, error) {
	c, err := n.Client()
	if err != nil {
		return 0, err
	}
	defer c.Close()
	ctx = namespaces.WithNamespace(ctx, Namespace)
	img, err := c.GetImage(ctx, o.Image)
	if err != nil {
		return 0, err
	}
	if o.Runtime == "" {
		o.Runtime = "io.containerd.berth.v2"
	}
	specOpts := []oci.SpecOpts{oci.WithImageConfig(img)}
	if len(o.Args) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(o.Args...))
	}
	if len(o.Annotations) > 0 {
		specOpts = append(specOpts, oci.WithAnnotations(o.Annotations))
	}
	if len(o.GPUs) > 0 {
		if n.GPU == nil {
			return 0, fmt.Errorf("node %s has no fake GPUs", n.Name)
		}
		mounts, env, err := fake.ContainerMounts(n.GPU, o.GPUs)
		if err != nil {
			return 0, err
		}
		specOpts = append(specOpts, oci.WithMounts(mounts), oci.WithEnv(env))
	}
	ctr, err := c.NewContainer(ctx, o.ID, containerd.WithImage(img), containerd.WithNewSnapshot(o.ID, img),
		containerd.WithRuntime(o.Runtime, nil), containerd.WithNewSpec(specOpts...))
	if err != nil {
		return 0, fmt.Errorf("create container %s on %s: %w", o.ID, n.Name, err)
	}
	ioc := cio.NullIO
	if o.LogPath != "" {
		ioc = cio.LogFile(o.LogPath)
	}
	t, err := ctr.NewTask(ctx, ioc)
	if err != nil {
		_ = ctr.Delete(ctx, containerd.WithSnapshotCleanup)
		return 0, fmt.Errorf("create task %s on %s: %w", o.ID, n.Name, err)
	}
	if err := t.Start(ctx); err != nil {
		_, _ = t.Delete(ctx, containerd.WithProcessKill)
		_ = ctr.Delete(ctx, containerd.WithSnapshotCleanup)
		return 0, fmt.Errorf("start task %s on %s: %w", o.ID, n.Name, err)
	}
	return t.Pid(), nil
}

// TaskPID returns the init PID and status of container id's task on the node.
func (n *Node) TaskPID(ctx context.Context, id string) (uint32, containerd.ProcessStatus, error) {
	c, err := n.Client()
	if err != nil {
		return 0, "", err
	}
	defer c.Close()
	ctx = namespaces.WithNamespace(ctx, Namespace)
	ctr, err := c.LoadContainer(ctx, id)
	if err != nil {
		return 0, "", err
	}
	t, err := ctr.Task(ctx, nil)
	if err != nil {
		return 0, "", err
	}
	st, err := t.Status(ctx)
	if err != nil {
		return 0, "", err
	}
	return t.Pid(), st.Status, nil
}

// Remove kills container id's task (if any) and deletes the container with its snapshot.
func (n *Node) Remove(ctx context.Context, id string) error {
	c, err := n.Client()
	if err != nil {
		return err
	}
	defer c.Close()
	ctx = namespaces.WithNamespace(ctx, Namespace)
	ctr, err := c.LoadContainer(ctx, id)
	if err != nil {
		return err
	}
	if t, err := ctr.Task(ctx, nil); err == nil {
		_ = t.Kill(ctx, syscall.SIGKILL)
		_ = t.Resume(ctx)
		if ch, err := t.Wait(ctx); err == nil {
			select {
			case <-ch:
			case <-time.After(10 * time.Second):
			}
		}
		if _, err := t.Delete(ctx, containerd.WithProcessKill); err != nil {
			return err
		}
	}
	return ctr.Delete(ctx, containerd.WithSnapshotCleanup)
}

// Containers returns the ids of the containers in Namespace on the node.
func (n *Node) Containers(ctx context.Context) ([]string, error) {
	c, err := n.Client()
	if err != nil {
		return nil, err
	}
	defer c.Close()
	cs, err := c.Containers(namespaces.WithNamespace(ctx, Namespace))
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, x := range cs {
		ids = append(ids, x.ID())
	}
	return ids, nil
}

// ErrSkip is wrapped by Require when the harness cannot run here (not root, no stack).
var ErrSkip = errors.New("integration tests need root and the stack")

// Require returns nil when integration tests can run: root and the stack installed. Otherwise an
// error wrapping ErrSkip that says what is missing.
func Require() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("not root: %w", ErrSkip)
	}
	if _, err := FindStack(); err != nil {
		return fmt.Errorf("%w: %w", err, ErrSkip)
	}
	return nil
}
