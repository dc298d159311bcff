package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-dev/berth/oci"
	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// The contents of the tmpfs mounts a container owns but CRIU does not dump. runc hands CRIU every
// bind mount of the spec as an external mount, whose contents CRIU leaves where they are: a CRI
// container's /dev/shm is such a bind mount of its pod's shm tmpfs, and a Kubernetes emptyDir of
// medium Memory is a bind mount of a tmpfs the kubelet made. On another node these are new and
// empty, so a process that kept a file there (or has one open, which CRIU then cannot restore)
// loses it. The shim writes each one's files beside the CRIU images at checkpoint (so the images'
// signed manifest covers them) and copies them into the destination pod's mount of the same
// destination before the restore. tmpfs mounts of the container's own (spec type tmpfs) are
// inside its mount namespace, and CRIU dumps and restores those itself.
const (
	// tmpfsIndexFile lists the tmpfs contents beside the CRIU images (JSON, []tmpfsContent).
	tmpfsIndexFile = "berth-tmpfs.json"
	// tmpfsFilePrefix starts the name of each content's tar: berth-tmpfs-N.tar.
	tmpfsFilePrefix = "berth-tmpfs-"
)

// tmpfsContent is one tmpfs mount's contents in a checkpoint.
type tmpfsContent struct {
	// Destination is the mount's path in the container ("/dev/shm").
	Destination string `json:"destination"`
	// File is the tar of its files (OCI layer format, uncompressed), beside the CRIU images.
	File string `json:"file"`
}

// ownedTmpfs returns the bind mounts of spec that carry a tmpfs owned by the container or its
// pod: /dev/shm bound from anything but the host's own /dev/shm (a pod with hostIPC shares the
// host's, which is no part of the container), and the kubelet's emptyDir volumes. Mounts whose
// source is not a tmpfs now are left out.
func ownedTmpfs(spec *specs.Spec) []specs.Mount {
	var out []specs.Mount
	for _, m := range spec.Mounts {
		if !oci.IsBindMount(m) || m.Source == "" {
			continue
		}
		owned := (filepath.Clean(m.Destination) == "/dev/shm" && filepath.Clean(m.Source) != "/dev/shm") ||
			strings.Contains(m.Source, "/volumes/kubernetes.io~empty-dir/")
		if !owned || !isTmpfs(m.Source) {
			continue
		}
		out = append(out, m)
	}
	return out
}

func isTmpfs(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.TMPFS_MAGIC
}

// writeTmpfs writes the contents of every tmpfs mount spec's container owns (ownedTmpfs) into
// imagesDir as berth-tmpfs-N.tar, listed in berth-tmpfs.json; nothing when it owns none. It runs
// while the task is frozen (containerd pauses it around the checkpoint); other containers of the
// pod that share the mount keep running and may still write to it.
func writeTmpfs(ctx context.Context, spec *specs.Spec, imagesDir string) (retErr error) {
	mounts := ownedTmpfs(spec)
	if len(mounts) == 0 {
		return nil
	}
	var index []tmpfsContent
	defer func() {
		if retErr != nil {
			for _, c := range index {
				os.Remove(filepath.Join(imagesDir, c.File))
			}
		}
	}()
	for i, m := range mounts {
		name := fmt.Sprintf("%s%d.tar", tmpfsFilePrefix, i)
		if err := writeDirTar(ctx, m.Source, filepath.Join(imagesDir, name)); err != nil {
			return fmt.Errorf("tmpfs %s (%s): %w", m.Destination, m.Source, err)
		}
		index = append(index, tmpfsContent{Destination: m.Destination, File: name})
		log.G(ctx).WithFields(log.Fields{"destination": m.Destination, "source": m.Source}).Info("tmpfs contents written beside the images")
	}
	b, err := json.Marshal(index)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(imagesDir, tmpfsIndexFile), append(b, '\n'), 0o600)
}

// writeDirTar writes every file under dir to path as a tar (symbolic links as links, never
// followed).
func writeDirTar(ctx context.Context, dir, path string) (retErr error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err := f.Close(); err != nil && retErr == nil {
			retErr = err
		}
		if retErr != nil {
			os.Remove(path)
		}
	}()
	return archive.WriteDiff(ctx, f, "", dir)
}

// restoreTmpfs copies the tmpfs contents of the held checkpoint (berth-tmpfs.json beside its
// CRIU images, covered by their signed manifest) into the destination spec's mounts of the same
// destinations, before CRIU restores the processes that use them. Each tar is checked against
// the rootfs diff's limits and applied with no path leaving the mount. A destination that spec
// does not carry as an owned tmpfs is skipped with a warning (CRIU then fails on any file the
// processes hold open there).
func (s *Service) restoreTmpfs(ctx context.Context, plan *restorePlan, spec *specs.Spec) error {
	b, err := os.ReadFile(filepath.Join(plan.images(), tmpfsIndexFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var index []tmpfsContent
	if err := json.Unmarshal(b, &index); err != nil {
		return fmt.Errorf("%s: %w", tmpfsIndexFile, mark(err, ErrBadArchive))
	}
	if err := plan.unchanged(); err != nil {
		return err
	}
	targets := map[string]string{}
	for _, m := range ownedTmpfs(spec) {
		targets[filepath.Clean(m.Destination)] = m.Source
	}
	for _, c := range index {
		if c.File != filepath.Base(c.File) || !strings.HasPrefix(c.File, tmpfsFilePrefix) {
			return fmt.Errorf("%s names %s: %w", tmpfsIndexFile, quote(c.File), mark(errors.New("not a tmpfs file of the checkpoint"), ErrBadArchive))
		}
		dst, ok := targets[filepath.Clean(c.Destination)]
		if !ok {
			log.G(ctx).WithField("destination", c.Destination).Warn("the checkpoint holds this tmpfs's contents, but this container has no tmpfs of its pod there: not restored")
			continue
		}
		src := filepath.Join(plan.images(), c.File)
		if _, err := s.scanRootfsDiff(src); err != nil {
			return fmt.Errorf("%s: %w", c.File, err)
		}
		if err := s.applyDiff(ctx, src, dst); err != nil {
			return fmt.Errorf("restore tmpfs %s into %s: %w", c.Destination, dst, err)
		}
		log.G(ctx).WithFields(log.Fields{"destination": c.Destination, "source": dst}).Info("tmpfs contents restored")
	}
	return nil
}
