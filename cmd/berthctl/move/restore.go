package move

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

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
	// transfer was sent from); spec.dump and berth.json are read from it.
	Dir string
	// LogPath, when set, receives the restored task's stdout and stderr; otherwise they are discarded.
	LogPath string
}

// Restore creates the container on the destination with berth's runtime and the restore-from
// annotation, and starts its task, which berth's shim restores with CRIU. Before creating
// anything it checks that the destination has the checkpoint's image with the same digest
// (fingerprint field imageDigest). On error nothing is left on the destination: the task and the
// container (with its snapshot) are removed; the checkpoint is left intact.
func Restore(ctx context.Context, c *containerd.Client, o RestoreOptions) (_ containerd.Task, retErr error) {
	ctx = namespaces.WithNamespace(ctx, o.Namespace)
	m, err := checkpoint.ReadManifest(o.Dir)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(o.Dir, checkpoint.SpecFile))
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", o.Dir, err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %s: %w", o.Dir, checkpoint.SpecFile, err)
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
	if err := adaptSpec(&spec, m.Container, o); err != nil {
		return nil, err
	}

	ctr, err := c.NewContainer(ctx, o.ID,
		containerd.WithImage(img),
		containerd.WithNewSnapshot(o.ID, img),
		containerd.WithRuntime(oci.RuntimeName, nil),
		containerd.WithSpec(&spec),
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

// adaptSpec rewrites the node-specific parts of the source spec for the destination: the
// restore-from annotation, the cgroup path containerd derives from namespace and id, and network
// namespaces joined by path (which do not exist on another node).
func adaptSpec(spec *specs.Spec, src checkpoint.ContainerInfo, o RestoreOptions) error {
	if spec.Annotations == nil {
		spec.Annotations = map[string]string{}
	}
	spec.Annotations[oci.AnnotationRestoreFrom] = o.Ref
	if spec.Linux == nil {
		return nil
	}
	if cg := spec.Linux.CgroupsPath; cg != "" && strings.HasSuffix(cg, "/"+src.ID) {
		spec.Linux.CgroupsPath = "/" + o.Namespace + "/" + o.ID
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Path != "" {
			return fmt.Errorf("container joins the %s namespace at %s, which does not exist on the destination: %w",
				ns.Type, ns.Path, errdefs.ErrNotImplemented)
		}
	}
	return nil
}
