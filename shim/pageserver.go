package shim

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// usePageServer reads the CRIU work directory's checkpoint.PageServerRequestFile, if any, and adds the page
// server to the bundle's CRIU configuration file for this dump; undo puts the file back. Errors:
// an unusable address, or a bundle whose org.criu.config is the user's own file
// (errdefs.ErrInvalidArgument, errdefs.ErrFailedPrecondition).
func (s *Service) usePageServer(ctx context.Context, id, workDir, bundle string, spec *specs.Spec) (undo func(), _ error) {
	undo = func() {}
	b, err := os.ReadFile(filepath.Join(workDir, checkpoint.PageServerRequestFile))
	if errors.Is(err, fs.ErrNotExist) {
		return undo, nil
	}
	if err != nil {
		return undo, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	addr := strings.TrimSpace(string(b))
	host, port, err := pageServerAddr(addr)
	if err != nil {
		return undo, fmt.Errorf("checkpoint %s: %s: %w", id, checkpoint.PageServerRequestFile, err)
	}
	path := filepath.Join(bundle, criuConfigName)
	if spec.Annotations[oci.AnnotationCRIUConfig] != path {
		return undo, fmt.Errorf("checkpoint %s: copy mode needs berth's own CRIU configuration file, but %s names %s: %w",
			id, oci.AnnotationCRIUConfig, spec.Annotations[oci.AnnotationCRIUConfig], errdefs.ErrFailedPrecondition)
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return undo, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	body := append(append([]byte(nil), old...), fmt.Sprintf("page-server\naddress %s\nport %d\n", host, port)...)
	if err := os.WriteFile(path, body, 0o600); err != nil {
		return undo, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	log.G(ctx).WithField("page_server", addr).Info("copy mode: CRIU sends memory pages to the page server")
	return func() {
		if err := os.WriteFile(path, old, 0o600); err != nil {
			log.G(ctx).WithError(err).Error("restore CRIU configuration after a copy-mode dump")
		}
	}, nil
}

// pageServerAddr parses a page server's "ADDR:PORT", which must be a loopback IP and a port.
func pageServerAddr(addr string) (string, int, error) {
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("page server %q: %w: %w", addr, err, errdefs.ErrInvalidArgument)
	}
	ip := net.ParseIP(h)
	port, perr := strconv.Atoi(p)
	switch {
	case ip == nil || !ip.IsLoopback():
		return "", 0, fmt.Errorf("page server %q: not a loopback IP address (the page client speaks in the clear; a relay on this node carries the stream over TLS): %w", addr, errdefs.ErrInvalidArgument)
	case perr != nil || port <= 0 || port > 65535:
		return "", 0, fmt.Errorf("page server %q: bad port: %w", addr, errdefs.ErrInvalidArgument)
	}
	return ip.String(), port, nil
}
