package move

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ctroci "github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// RestoreOptions say which checkpoint to restore and as what.
type RestoreOptions struct {
	// Namespace and ID name the container to create on the destination containerd.
	Namespace, ID string
	// Ref is the value of the berth.dev/restore-from annotation: the checkpoint's path relative to
	// the destination shim's checkpoint root (or absolute inside it).
	Ref string
	// Dir is a local copy of the checkpoint (identical to what Ref names, e.g. the directory the
	// transfer was sent from); berth.json, and spec.dump for the fields RestoreSpec takes from
	// it, are read from it.
	Dir string
	// Source, when set, is the source container's spec as its own containerd reports it (migrate:
	// the operator's running container, read by this process, never from a checkpoint's files):
	// the new container's spec is built from it (SourceSpec). Otherwise the spec is the
	// destination's default for the checkpoint's image, with the fields RestoreSpec allows from
	// the checkpoint's spec.dump.
	Source *specs.Spec
	// Mounts are mounts the operator gives the new container (berthctl restore --mount), beyond
	// the destination's default ones; one at the destination of a default mount replaces it.
	Mounts []specs.Mount
	// LogPath, when set, receives the restored task's stdout and stderr; otherwise they are discarded.
	LogPath string
}

// ErrSpecRefused is returned (wrapped, naming the field) when a restore's container spec cannot
// be made from what the operator gave: the checkpoint's container had a bind mount the operator
// did not give, or joined a namespace by path.
var ErrSpecRefused = errors.New("the restored container's spec cannot be built")

// Restore creates the container on the destination with berth's runtime and the restore-from
// annotation, and starts its task, which berth's shim restores with CRIU. Before creating
// anything it checks that the destination has the checkpoint's image with the same digest
// (fingerprint field imageDigest) and builds the container's spec from the operator's side
// (o.Source, or RestoreSpec), never from a checkpoint's spec as it is. On error nothing is left
// on the destination: the task and the container (with its snapshot) are removed; the
// checkpoint is left intact.
func Restore(ctx context.Context, c *containerd.Client, o RestoreOptions) (_ containerd.Task, retErr error) {
	ctx = namespaces.WithNamespace(ctx, o.Namespace)
	m, err := checkpoint.ReadManifest(o.Dir)
	if err != nil {
		return nil, err
	}
	img, err := c.GetImage(ctx, m.Container.Image)
	if errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("image %s of the checkpoint is not on the destination (namespace %s); import it first: %w", m.Container.Image, o.Namespace, err)
	}
	if err != nil {
		return nil, fmt.Errorf("look up image %s on the destination: %w", m.Container.Image, err)
	}
	if d := img.Target().Digest.String(); m.Container.ImageDigest != "" && d != m.Container.ImageDigest {
		return nil, &fingerprint.MismatchError{Field: "imageDigest", Checkpoint: m.Container.ImageDigest, Node: d, Rule: "exact"}
	}
	// the spec, from the operator's side: checked in full before anything is created
	var specOpt containerd.NewContainerOpts
	if o.Source != nil {
		spec, err := SourceSpec(o.Source, m.Container, o)
		if err != nil {
			return nil, fmt.Errorf("restore %s from checkpoint %s: %w", o.ID, o.Ref, err)
		}
		specOpt = containerd.WithSpec(spec)
	} else {
		var ckpt specs.Spec
		b, err := os.ReadFile(filepath.Join(o.Dir, checkpoint.SpecFile))
		if err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", o.Dir, err)
		}
		if err := json.Unmarshal(b, &ckpt); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %s: %w", o.Dir, checkpoint.SpecFile, err)
		}
		base, err := ctroci.GenerateSpec(ctx, c, &containers.Container{ID: o.ID})
		if err != nil {
			return nil, fmt.Errorf("the destination's default spec: %w", err)
		}
		if _, err := RestoreSpec(base, &ckpt, o); err != nil {
			return nil, fmt.Errorf("restore %s from checkpoint %s: %w", o.ID, o.Ref, err)
		}
		specOpt = containerd.WithNewSpec(ctroci.WithImageConfig(img),
			func(_ context.Context, _ ctroci.Client, _ *containers.Container, s *ctroci.Spec) error {
				spec, err := RestoreSpec(s, &ckpt, o)
				if err != nil {
					return err
				}
				*s = *spec
				return nil
			})
	}

	ctr, err := c.NewContainer(ctx, o.ID,
		containerd.WithImage(img),
		containerd.WithNewSnapshot(o.ID, img),
		containerd.WithRuntime(oci.RuntimeName, nil),
		specOpt,
	)
	if err != nil {
		return nil, fmt.Errorf("create container %s on the destination: %w", o.ID, err)
	}
	defer func() {
		if retErr != nil {
			if err := ctr.Delete(context.WithoutCancel(ctx), containerd.WithSnapshotCleanup); err != nil {
				log.G(ctx).WithError(err).Error("remove container after failed restore")
			}
		}
	}()
	ioc := cio.NullIO
	if o.LogPath != "" {
		ioc = cio.LogFile(o.LogPath)
	}
	task, err := ctr.NewTask(ctx, ioc)
	if err != nil {
		return nil, fmt.Errorf("create task %s from checkpoint %s: %w", o.ID, o.Ref, err)
	}
	defer func() {
		if retErr != nil {
			if _, err := task.Delete(context.WithoutCancel(ctx), containerd.WithProcessKill); err != nil && !errdefs.IsNotFound(err) {
				log.G(ctx).WithError(err).Error("remove task after failed restore")
			}
		}
	}()
	if err := task.Start(ctx); err != nil {
		return nil, fmt.Errorf("restore %s from checkpoint %s: %w", o.ID, o.Ref, err)
	}
	return task, nil
}

// RestoreSpec returns the spec of a container restored from a checkpoint that did not come
// from this operator's own source container: base is the destination's (containerd's default
// spec for the new container with the checkpoint's image config: namespaces, mounts, devices,
// capabilities, user, rlimits and no hooks, all the destination's), and ckpt the checkpoint's
// spec.dump, from which only these fields are taken, none of which grants anything:
// process.args, process.env, process.cwd, process.terminal (CRIU restores the process's own
// terminal or pipes, so it must match) and hostname. Hooks, mounts, devices, namespaces,
// capabilities, the user, rlimits, seccomp, AppArmor, sysctls and annotations of the
// checkpoint are never taken (a signed checkpoint's spec.dump is its source's word, not this
// node's). The operator's o.Mounts are added, and the restore-from annotation set. A bind
// mount of the checkpoint's container that o.Mounts does not give is refused before anything
// is created (ErrSpecRefused, naming it and the --mount that gives it): CRIU would fail on it.
func RestoreSpec(base, ckpt *specs.Spec, o RestoreOptions) (*specs.Spec, error) {
	spec := base
	if spec.Process == nil {
		spec.Process = &specs.Process{}
	}
	if p := ckpt.Process; p != nil {
		if len(p.Args) > 0 {
			spec.Process.Args = slices.Clone(p.Args)
		}
		spec.Process.Env = slices.Clone(p.Env)
		if p.Cwd != "" {
			spec.Process.Cwd = p.Cwd
		}
		spec.Process.Terminal = p.Terminal
	}
	spec.Hostname = ckpt.Hostname
	spec.Mounts = withMounts(spec.Mounts, o.Mounts)
	var missing []string
	for _, m := range ckpt.Mounts {
		if !oci.IsBindMount(m) || gpuMount(m) || hasBindMount(spec.Mounts, m.Destination) {
			continue
		}
		missing = append(missing, fmt.Sprintf("--mount type=bind,src=%s,dst=%s,options=%s", m.Source, m.Destination, strings.Join(m.Options, ":")))
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: the checkpoint's container had bind mounts the restore was not given (a checkpoint's mounts are never taken as they are; CRIU needs each): give them, with the paths of this node, as %s",
			ErrSpecRefused, strings.Join(missing, " "))
	}
	spec.Annotations = map[string]string{oci.AnnotationRestoreFrom: o.Ref}
	return spec, nil
}

// SourceSpec returns the spec of a container that migrate restores from the source container
// it checkpointed a moment ago: src is that container's spec as the source's containerd
// reports it (the operator's own container). It keeps src but for what a destination must not
// run or cannot have: OCI hooks are dropped (they would run as root on the destination's host),
// every annotation is replaced by the restore-from one (runc's org.criu.config names a file of
// the source), the cgroup path containerd derives from namespace and id is the new one, and a
// namespace joined by path (the source node's) is refused. o.Mounts are added.
func SourceSpec(src *specs.Spec, info checkpoint.ContainerInfo, o RestoreOptions) (*specs.Spec, error) {
	b, err := json.Marshal(src)
	if err != nil {
		return nil, err
	}
	spec := &specs.Spec{}
	if err := json.Unmarshal(b, spec); err != nil { // a deep copy
		return nil, err
	}
	spec.Hooks = nil
	spec.Annotations = map[string]string{oci.AnnotationRestoreFrom: o.Ref}
	spec.Mounts = withMounts(spec.Mounts, o.Mounts)
	if spec.Linux == nil {
		return spec, nil
	}
	if cg := spec.Linux.CgroupsPath; cg != "" && strings.HasSuffix(cg, "/"+info.ID) {
		spec.Linux.CgroupsPath = "/" + o.Namespace + "/" + o.ID
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Path != "" {
			return nil, fmt.Errorf("%w: the container joins the %s namespace at %s, which does not exist on the destination: %w",
				ErrSpecRefused, ns.Type, ns.Path, errdefs.ErrNotImplemented)
		}
	}
	return spec, nil
}

// withMounts returns mounts with add appended, each replacing any mount at its destination.
func withMounts(mounts, add []specs.Mount) []specs.Mount {
	out := slices.Clone(mounts)
	for _, a := range add {
		out = slices.DeleteFunc(out, func(m specs.Mount) bool { return path.Clean(m.Destination) == path.Clean(a.Destination) })
		out = append(out, a)
	}
	return out
}

// hasBindMount reports whether mounts has a bind mount at destination dst (a default tmpfs
// there, such as /dev/shm's, is not what CRIU restores a bind mount onto).
func hasBindMount(mounts []specs.Mount, dst string) bool {
	return slices.ContainsFunc(mounts, func(m specs.Mount) bool {
		return path.Clean(m.Destination) == path.Clean(dst) && oci.IsBindMount(m)
	})
}

// gpuMount reports whether m is a fake GPU's bind mount (gpu/fake's convention, under
// /dev/berth-gpu): the destination shim gives the GPUs of its device map itself, from the
// process environment the checkpoint records.
func gpuMount(m specs.Mount) bool {
	return strings.HasPrefix(path.Clean(m.Destination)+"/", fake.DevRoot+"/")
}
