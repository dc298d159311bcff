package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/log"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/shim/helper"
)

// PulledDir is the directory under the checkpoint root that holds checkpoints pulled from
// registries for berth.dev/restore-from=oci://..., one directory per OCI manifest digest
// ("sha256-<hex>"), kept and reused by later restores of the same digest. Its name starts with
// "." so it never collides with a received checkpoint.
const PulledDir = ".oci"

// pullCheckpoint makes the checkpoint src (a registry reference) available under the checkpoint
// root and returns its directory. The registry must be in allowed_registries. A tag is resolved to
// its manifest digest first; a checkpoint of that digest already pulled and still intact is
// reused, otherwise it is pulled (registry.Pull: every digest verified, nothing left behind on
// failure) into a temporary directory and renamed into place, so a concurrent restore never sees
// a partial one. Resolving and pulling are Deps.Registry's (berth-shim-helper on a real node: the
// registry client is not part of the shim process). The caller runs the usual validation
// (digests, fingerprint, namespace, GPUs).
func (s *Service) pullCheckpoint(ctx context.Context, src regdef.RestoreFrom) (string, error) {
	if !s.cfg.RegistryAllowed(src.Registry) {
		return "", mark(fmt.Errorf("registry %s is not in allowed_registries %q of the shim config %s: add it there to restore from it",
			src.Registry, s.cfg.AllowedRegistries, s.cfg.Path), ErrRegistryNotAllowed)
	}
	if s.deps.Registry == nil {
		return "", fmt.Errorf("restore from registry %s: this shim has no registry client", src.Registry)
	}
	opts := helper.RegistryOptions{
		PlainHTTP:    s.cfg.RegistryPlain(src.Registry),
		DockerConfig: s.cfg.RegistryConfig,
		Limits:       archive.Limits{MaxFileBytes: s.cfg.MaxArchiveBytes, MaxTotalBytes: s.cfg.MaxArchiveBytes},
	}
	start := s.deps.Now()
	dgst := src.Digest
	if dgst == "" {
		d, err := s.deps.Registry.Resolve(ctx, src.Ref(), opts)
		if err != nil {
			return "", err
		}
		dgst = d
	}
	algo, hex, ok := strings.Cut(dgst, ":")
	if !ok || algo != "sha256" || len(hex) != 64 || strings.Trim(hex, "0123456789abcdef") != "" {
		return "", mark(fmt.Errorf("registry %s answered %s with digest %q (want sha256)", src.Registry, src, dgst), ErrRegistryDigest)
	}
	cache := filepath.Join(s.cfg.CheckpointRoot, PulledDir)
	if err := os.MkdirAll(cache, 0o700); err != nil {
		return "", err
	}
	final := filepath.Join(cache, algo+"-"+hex)
	logger := log.G(ctx).WithFields(log.Fields{"ref": src.String(), "digest": dgst, "checkpoint": final})
	if fi, err := os.Lstat(final); err == nil {
		if fi.IsDir() {
			if m, err := checkpoint.ReadManifest(final); err == nil {
				if _, err := checkpoint.VerifyStamped(final, m); err == nil {
					logger.WithField("ms", checkpoint.Millis(s.deps.Now().Sub(start))).Info("checkpoint pulled before: reused")
					return final, nil
				}
			}
		}
		// damaged or not ours: move it aside and pull again
		logger.Warn("pulled checkpoint is not intact: pulling it again")
		stale := filepath.Join(cache, fmt.Sprintf(".stale-%s-%d", hex, s.deps.Now().UnixNano()))
		if err := os.Rename(final, stale); err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("move damaged checkpoint %s aside: %w", final, err)
		}
		_ = checkpoint.RemoveStamp(final)
		os.RemoveAll(stale)
	}
	tmp := filepath.Join(cache, fmt.Sprintf(".pull-%s-%d", hex, s.deps.Now().UnixNano()))
	byDigest := src.Registry + "/" + src.Repository + "@" + dgst
	if err := s.deps.Registry.Pull(ctx, byDigest, tmp, opts); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, final); err != nil {
		os.RemoveAll(tmp)
		if fi, serr := os.Lstat(final); serr == nil && fi.IsDir() {
			return final, nil // a concurrent restore pulled the same digest first
		}
		return "", fmt.Errorf("move pulled checkpoint into place: %w", err)
	}
	if m, err := checkpoint.ReadManifest(final); err == nil {
		// Pull verified every file: let the validation that follows skip re-reading them
		if err := checkpoint.WriteStamp(final, m); err != nil {
			logger.WithError(err).Warn("no verification stamp for the pulled checkpoint")
		}
	}
	logger.WithField("ms", checkpoint.Millis(s.deps.Now().Sub(start))).Info("checkpoint pulled and verified")
	return final, nil
}
