package criu

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	gocriu "github.com/checkpoint-restore/go-criu/v7"
)

// Client asks one criu binary about itself. It holds no process or connection between calls:
// each call starts a "criu swrk" process, and reaps it before returning. A Client is safe for
// concurrent use.
type Client struct {
	path string
}

// New returns a Client for the criu binary at path; "" means "criu" looked up in PATH. A path
// without a slash is looked up in PATH at each call. New does not check that the binary exists;
// the calls do, returning ErrNotFound.
func New(path string) *Client {
	if path == "" {
		path = "criu"
	}
	return &Client{path: path}
}

// Path is the path New was given ("criu" for "").
func (c *Client) Path() string { return c.path }

// resolve finds the binary: exec.LookPath of the path. It returns the resolved path, or an
// error wrapping ErrNotFound and LookPath's error, naming the path looked up.
func (c *Client) resolve() (string, error) {
	p, err := exec.LookPath(c.path)
	if err != nil {
		where := c.path
		if !strings.Contains(c.path, "/") {
			where = fmt.Sprintf("%q in PATH", c.path)
		}
		return "", fmt.Errorf("%w: looked up %s: %w", ErrNotFound, where, err)
	}
	return p, nil
}

// Version asks CRIU its version over the RPC (go-criu's GetCriuVersion, VERSION request) and
// checks it against MinVersion.
//
// It returns the version and nil; the version and an error wrapping ErrTooOld (naming the
// version, the path and MinVersion) when it is older than MinVersion; or a zero Version and an
// error wrapping ErrNotFound (naming the path looked up) when the binary is absent, ctx.Err()
// when ctx ends before CRIU answers, or the RPC's error wrapped with the path.
func (c *Client) Version(ctx context.Context) (Version, error) {
	path, err := c.resolve()
	if err != nil {
		return Version{}, err
	}
	n, err := bounded(ctx, func() (int, error) {
		cr := gocriu.MakeCriu()
		cr.SetCriuPath(path)
		if err := cr.Prepare(); err != nil {
			return 0, err
		}
		n, err := cr.GetCriuVersion()
		if cerr := cr.Cleanup(); cerr != nil {
			if err == nil {
				return n, cerr
			}
			err = fmt.Errorf("%w (%v)", err, cerr)
		}
		return n, err
	})
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return Version{}, err
		}
		return Version{}, fmt.Errorf("criu: version of %s: %w", path, err)
	}
	v := VersionFromInt(n)
	return v, checkVersion(v, path)
}

// VersionString is Version as "major.minor.sublevel" ("4.2.1"), shaped to serve as
// fingerprint.Sources.CRIUVersion. It returns Version's errors except ErrTooOld: a fingerprint
// records the CRIU that is installed, and Check decides whether berth can use it.
func (c *Client) VersionString(ctx context.Context) (string, error) {
	v, err := c.Version(ctx)
	if err != nil && !errors.Is(err, ErrTooOld) {
		return "", err
	}
	return v.String(), nil
}

// Check verifies that the criu binary is usable by berth: it exists, its version is at least
// MinVersion (see Version for those errors), and every feature in require is available on this
// CRIU and kernel (see Features). Berth itself needs no feature beyond the version; callers that
// use an optional one (FeatureMemTrack for pre-dumps, FeatureLazyPages for lazy migration)
// pass it. A missing feature gives an error wrapping ErrFeatureMissing that names the feature
// and the binary; an unknown Feature value gives an error naming it.
func (c *Client) Check(ctx context.Context, require ...Feature) error {
	for _, f := range require {
		if !f.known() {
			return fmt.Errorf("criu: unknown feature %q (known: %s, %s, %s)", string(f),
				FeatureMemTrack, FeatureLazyPages, FeaturePidfdStore)
		}
	}
	path, err := c.resolve()
	if err != nil {
		return err
	}
	if _, err := c.Version(ctx); err != nil {
		return err
	}
	if len(require) == 0 {
		return nil
	}
	have, err := c.Features(ctx)
	if err != nil {
		return err
	}
	for _, f := range require {
		if !have.Has(f) {
			return fmt.Errorf("criu at %s on this kernel lacks feature %s: %w", path, f, ErrFeatureMissing)
		}
	}
	return nil
}

// result carries a bounded call's outcome.
type result[T any] struct {
	v   T
	err error
}

// bounded runs f in a goroutine and returns its result, or ctx.Err() as soon as ctx ends; f
// then finishes (and cleans up) in the background, its result dropped.
func bounded[T any](ctx context.Context, f func() (T, error)) (T, error) {
	var zero T
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	ch := make(chan result[T], 1)
	go func() {
		v, err := f()
		ch <- result[T]{v, err}
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		return zero, ctx.Err()
	}
}
