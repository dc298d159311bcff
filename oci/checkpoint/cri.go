package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// ErrNotCRICheckpoint is returned (wrapped, naming the directory and what is missing) by
// SignCRICheckpoint for a directory that is not a CRI checkpoint: no checkpoint/berth.json or no
// config.dump.
var ErrNotCRICheckpoint = errors.New("not a CRI checkpoint of the berth runtime")

// maxConfigDumpBytes bounds the config.dump SignCRICheckpoint reads, in bytes.
const maxConfigDumpBytes = 1 << 20

// CRIContainerConfig is the part of a CRI checkpoint's config.dump that berth reads: what
// containerd's CRI plugin writes there (checkpointctl's lib.ContainerConfig).
type CRIContainerConfig struct {
	ID              string `json:"id"`
	Name            string `json:"name"`
	RootfsImage     string `json:"rootfsImage,omitempty"`
	RootfsImageRef  string `json:"rootfsImageRef,omitempty"`
	RootfsImageName string `json:"rootfsImageName,omitempty"`
	Runtime         string `json:"runtime,omitempty"`
}

// IsCRICheckpoint reports whether dir looks like a CRI checkpoint that berth's shim signed only in
// part: no top-level berth.json, but checkpoint/berth.json (ImagesDir) is there.
func IsCRICheckpoint(dir string) bool {
	if _, err := os.Lstat(filepath.Join(dir, ManifestFile)); !errors.Is(err, os.ErrNotExist) {
		return false
	}
	fi, err := os.Lstat(filepath.Join(dir, ImagesDir, ManifestFile))
	return err == nil && fi.Mode().IsRegular()
}

// SignCRICheckpoint writes the top-level berth.json of a CRI checkpoint directory dir (the
// kubelet's checkpoint API or `crictl checkpoint --export`, extracted). In such an archive only
// the CRIU images are covered by digests: the shim signed them in checkpoint/berth.json, and
// containerd wrote rootfs-diff.tar, spec.dump, config.dump and the rest afterwards.
//
// SignCRICheckpoint first verifies the CRIU images against checkpoint/berth.json (so it never
// signs images changed since the shim wrote them) and that nothing but containerd's own files
// lies beside them (CheckCRITop), then writes dir/berth.json whose Fingerprint,
// CRIU, GPU, Phases, Created, Security and the Kubernetes namespace, pod and container name come
// from checkpoint/berth.json and whose other Container fields come from
// config.dump (id, name as Image when no image name is recorded, rootfsImageName, rootfsImageRef
// when it is a sha256 digest, runtime), with a digest of every file of dir, checkpoint/berth.json
// included. The other files cannot be verified against anything: whoever signs vouches for them.
//
// Errors: ErrNotCRICheckpoint (wrapped) when dir has a top-level berth.json already, or lacks
// checkpoint/berth.json or config.dump; ErrExtraFile (wrapped) for any other file at the top; ReadManifest's and Verify's errors for the CRIU images
// (ErrDigestMismatch and so on, naming checkpoint/<file>); a config.dump that is not JSON or is
// larger than 1 MiB; WriteManifest's errors.
func SignCRICheckpoint(dir string) (*Manifest, error) {
	if _, err := os.Lstat(filepath.Join(dir, ManifestFile)); !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w: it has a top-level %s already", dir, ErrNotCRICheckpoint, ManifestFile)
	}
	images := filepath.Join(dir, ImagesDir)
	if _, err := os.Lstat(filepath.Join(images, ManifestFile)); err != nil {
		return nil, fmt.Errorf("%s: %w: no %s/%s (was it taken with the berth runtime handler?)", dir, ErrNotCRICheckpoint, ImagesDir, ManifestFile)
	}
	inner, err := ReadManifest(images)
	if err != nil {
		return nil, err
	}
	if err := Verify(images, inner); err != nil {
		return nil, fmt.Errorf("CRIU images of %s are not intact: %s/%w", dir, ImagesDir, err)
	}
	if err := CheckCRITop(dir, false); err != nil {
		return nil, fmt.Errorf("CRI checkpoint %s holds a file that neither the shim's signature nor containerd's layout accounts for, so it is not signed: %w", dir, err)
	}
	cfg, err := readCRIConfig(dir)
	if err != nil {
		return nil, err
	}
	m := &Manifest{
		Created: inner.Created,
		Container: ContainerInfo{
			ID:                  cfg.ID,
			KubernetesNamespace: inner.Container.KubernetesNamespace,
			Pod:                 inner.Container.Pod,
			ContainerName:       inner.Container.ContainerName,
			Image:               cfg.RootfsImageName,
			Runtime:             cfg.Runtime,
		},
		Fingerprint: inner.Fingerprint,
		CRIU:        inner.CRIU,
		Phases:      inner.Phases,
		GPU:         inner.GPU,
		Security:    inner.Security,
	}
	if m.Container.ID == "" {
		m.Container.ID = inner.Container.ID
	}
	if m.Container.Image == "" {
		m.Container.Image = inner.Container.Image
	}
	if m.Container.Runtime == "" {
		m.Container.Runtime = inner.Container.Runtime
	}
	if validDigest(cfg.RootfsImageRef) {
		m.Container.ImageDigest = cfg.RootfsImageRef
	}
	if err := WriteManifest(dir, m); err != nil {
		return nil, fmt.Errorf("sign CRI checkpoint %s: %w", dir, err)
	}
	return m, nil
}

// readCRIConfig reads dir/config.dump.
func readCRIConfig(dir string) (*CRIContainerConfig, error) {
	p := filepath.Join(dir, ConfigFile)
	fi, err := os.Lstat(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w: no %s", dir, ErrNotCRICheckpoint, ConfigFile)
	}
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: %w", p, ErrUnsupportedFile)
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConfigDumpBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxConfigDumpBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", p, maxConfigDumpBytes)
	}
	var cfg CRIContainerConfig
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	return &cfg, nil
}
