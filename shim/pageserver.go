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
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/criu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// usePageServer reads the CRIU work directory's checkpoint.PageServerRequestFile or
// checkpoint.LazyPagesRequestFile, if any, and adds the page server (copy mode) or the lazy page
// server (lazy mode: CRIU listens there once the non-memory images are written, and speaks TLS
// with the identity in checkpoint.LazyTLSDir(workDir): lazyTLSDir) to the bundle's CRIU
// configuration file for this dump; undo puts the file back. lazy is the lazy page server's
// ADDR:PORT ("" unless lazy mode). Errors: an unusable address, both files at once, a bundle
// whose org.criu.config is the user's own file, or (lazy mode) a node where CRIU cannot serve
// pages lazily (criu.CheckLazyDump) or a missing or unsafe TLS directory
// (errdefs.ErrInvalidArgument, errdefs.ErrFailedPrecondition).
func (s *Service) usePageServer(ctx context.Context, id, workDir, bundle string, spec *specs.Spec) (undo func(), lazy string, _ error) {
	undo = func() {}
	b, err := os.ReadFile(filepath.Join(workDir, checkpoint.PageServerRequestFile))
	lb, lerr := os.ReadFile(filepath.Join(workDir, checkpoint.LazyPagesRequestFile))
	file := checkpoint.PageServerRequestFile
	switch {
	case err == nil && lerr == nil:
		return undo, "", fmt.Errorf("checkpoint %s: both %s and %s asked for: %w", id, checkpoint.PageServerRequestFile, checkpoint.LazyPagesRequestFile, errdefs.ErrInvalidArgument)
	case lerr == nil:
		b, err, file = lb, nil, checkpoint.LazyPagesRequestFile
	case !errors.Is(lerr, fs.ErrNotExist):
		return undo, "", fmt.Errorf("checkpoint %s: %w", id, lerr)
	}
	if errors.Is(err, fs.ErrNotExist) {
		return undo, "", nil
	}
	if err != nil {
		return undo, "", fmt.Errorf("checkpoint %s: %w", id, err)
	}
	addr := strings.TrimSpace(string(b))
	host, port, err := pageServerAddr(addr)
	if err != nil {
		return undo, "", fmt.Errorf("checkpoint %s: %s: %w", id, file, err)
	}
	isLazy := file == checkpoint.LazyPagesRequestFile
	if isLazy && net.ParseIP(host).To4() == nil {
		// the shim sees CRIU's listener in /proc/net/tcp (lazy.go)
		return undo, "", fmt.Errorf("checkpoint %s: %s: lazy page server %q: want an IPv4 loopback address: %w", id, file, addr, errdefs.ErrInvalidArgument)
	}
	if isLazy {
		if err := criu.CheckLazyDump(); err != nil {
			return undo, "", fmt.Errorf("checkpoint %s: %w: %w", id, err, errdefs.ErrFailedPrecondition)
		}
	}
	path := filepath.Join(bundle, criuConfigName)
	if spec.Annotations[oci.AnnotationCRIUConfig] != path {
		return undo, "", fmt.Errorf("checkpoint %s: copy and lazy modes need berth's own CRIU configuration file, but %s names %s: %w",
			id, oci.AnnotationCRIUConfig, spec.Annotations[oci.AnnotationCRIUConfig], errdefs.ErrFailedPrecondition)
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return undo, "", fmt.Errorf("checkpoint %s: %w", id, err)
	}
	lines := fmt.Sprintf("page-server\naddress %s\nport %d\n", host, port)
	if isLazy {
		// the source listens: `criu dump --lazy-pages --address --port`, over TLS with the
		// identity the caller's relay made, so that no other local process is served a page
		tlsDir, err := lazyTLSDir(workDir)
		if err != nil {
			return undo, "", fmt.Errorf("checkpoint %s: %w", id, err)
		}
		lines = fmt.Sprintf("lazy-pages\naddress %s\nport %d\ntls\ntls-cacert %s\ntls-cert %s\ntls-key %s\n", host, port,
			filepath.Join(tlsDir, checkpoint.LazyTLSCA), filepath.Join(tlsDir, checkpoint.LazyTLSCert), filepath.Join(tlsDir, checkpoint.LazyTLSKey))
	}
	body := append(append([]byte(nil), old...), lines...)
	if err := os.WriteFile(path, body, 0o600); err != nil {
		return undo, "", fmt.Errorf("checkpoint %s: %w", id, err)
	}
	if isLazy {
		log.G(ctx).WithField("lazy_page_server", addr).Info("lazy mode: CRIU serves memory pages from the frozen task once the rest is dumped")
		lazy = addr
	} else {
		log.G(ctx).WithField("page_server", addr).Info("copy mode: CRIU sends memory pages to the page server")
	}
	return func() {
		if err := os.WriteFile(path, old, 0o600); err != nil {
			log.G(ctx).WithError(err).Error("restore CRIU configuration after a copy- or lazy-mode dump")
		}
	}, lazy, nil
}

// lazyTLSDir returns checkpoint.LazyTLSDir of CRIU work directory workDir, where the caller
// put the TLS identity of CRIU's lazy page server, once it checked that the directory is root's
// alone (a directory, not a link, owned by uid 0, mode 0700 or stricter), holds the three regular
// files CRIU is to read, and has a path CRIU's configuration file can carry (no white space,
// quote, backslash or '#'). Errors: a missing or unusable directory or file, naming it and what
// writes it (errdefs.ErrFailedPrecondition).
func lazyTLSDir(workDir string) (string, error) {
	dir := checkpoint.LazyTLSDir(workDir)
	fail := func(why string) (string, error) {
		return "", fmt.Errorf("lazy mode needs the TLS identity of CRIU's lazy page server in %s (berthctl migrate --lazy writes it beside the CRIU work directory), but %s: %w",
			dir, why, errdefs.ErrFailedPrecondition)
	}
	if strings.ContainsAny(dir, " \t\n\r\"'#\\") {
		return fail("its path holds a character CRIU's configuration file cannot carry")
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fail(err.Error())
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fail("it is not a directory")
	case !ok || st.Uid != 0:
		return fail("it is not root's")
	case fi.Mode().Perm()&0o077 != 0:
		return fail(fmt.Sprintf("its mode %04o lets others in (want 0700)", fi.Mode().Perm()))
	}
	for _, f := range []string{checkpoint.LazyTLSCA, checkpoint.LazyTLSCert, checkpoint.LazyTLSKey} {
		fi, err := os.Lstat(filepath.Join(dir, f))
		if err != nil {
			return fail(err.Error())
		}
		if !fi.Mode().IsRegular() {
			return fail(f + " is not a regular file")
		}
	}
	return dir, nil
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
