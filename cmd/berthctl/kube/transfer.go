package kube

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// SharedFS is the Transfer for nodes whose checkpoint directories this machine sees as files:
// one machine that runs several nodes (labs, the tests), or node directories mounted here. The
// archive is copied from its path on the source (as the kubelet named it) into Root(dst), with
// mode 0600 and fsync, never over an existing file.
type SharedFS struct {
	// Root returns node's checkpoint root as seen here.
	Root func(node string) string
}

// RootTemplate returns a Root that replaces {node} in tmpl with the node's name.
func RootTemplate(tmpl string) func(string) string {
	return func(node string) string { return strings.ReplaceAll(tmpl, "{node}", node) }
}

// Copy copies srcArchive into dst's checkpoint root as name.
func (s SharedFS) Copy(ctx context.Context, _, srcArchive, dst, name string) (n int64, retErr error) {
	if name != filepath.Base(name) || strings.HasPrefix(name, ".") {
		return 0, fmt.Errorf("checkpoint name %q: not a file name", name)
	}
	in, err := os.Open(srcArchive)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	if fi, err := in.Stat(); err != nil || !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("%s: not a regular file (%v)", srcArchive, err)
	}
	out, err := os.OpenFile(filepath.Join(s.Root(dst), name), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return 0, err
	}
	defer func() {
		if err := out.Close(); err != nil && retErr == nil {
			retErr = err
		}
	}()
	n, err = io.Copy(out, ctxReader{ctx, in})
	if err != nil {
		return n, err
	}
	return n, out.Sync()
}

// Remove removes name from dst's checkpoint root; a missing file is no error.
func (s SharedFS) Remove(_ context.Context, dst, name string) error {
	if name != filepath.Base(name) || name == "" || strings.HasPrefix(name, ".") {
		return fmt.Errorf("checkpoint name %q: not a file name", name)
	}
	err := os.Remove(filepath.Join(s.Root(dst), name))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// ctxReader stops a copy when ctx is done.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
