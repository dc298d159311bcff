package criu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
)

// Feature names a CRIU feature that depends on the kernel and architecture, not only on CRIU's
// version; the values are the field names of CRIU's RPC CriuFeatures message.
type Feature string

// The features CRIU's FEATURE_CHECK RPC reports.
const (
	// FeatureMemTrack: dirty-memory tracking (soft-dirty bits), needed for pre-dumps and
	// incremental dumps. Not available on kernels without CONFIG_MEM_SOFT_DIRTY.
	FeatureMemTrack Feature = "mem_track"
	// FeatureLazyPages: lazy (post-copy) restore through non-cooperative userfaultfd.
	FeatureLazyPages Feature = "lazy_pages"
	// FeaturePidfdStore: pidfd_open and pidfd_getfd, for CRIU's pidfd store (PID reuse
	// detection across pre-dumps).
	FeaturePidfdStore Feature = "pidfd_store"
)

func (f Feature) known() bool {
	return f == FeatureMemTrack || f == FeatureLazyPages || f == FeaturePidfdStore
}

// Features is what CRIU reports available on this CRIU, kernel and architecture, from CRIU's
// FEATURE_CHECK RPC answer.
type Features struct {
	// MemTrack is FeatureMemTrack (as `criu check --feature mem_dirty_track`).
	MemTrack bool `json:"mem_track"`
	// LazyPages is FeatureLazyPages (as `criu check --feature uffd-noncoop`).
	LazyPages bool `json:"lazy_pages"`
	// PidfdStore is FeaturePidfdStore (as `criu check --feature pidfd_store`).
	PidfdStore bool `json:"pidfd_store"`
}

// Has reports whether f is available; false for an unknown Feature.
func (f Features) Has(feat Feature) bool {
	switch feat {
	case FeatureMemTrack:
		return f.MemTrack
	case FeatureLazyPages:
		return f.LazyPages
	case FeaturePidfdStore:
		return f.PidfdStore
	}
	return false
}

// Features asks CRIU which of the features above are available, with CRIU's FEATURE_CHECK RPC
// request. It does not check the version (Check does).
//
// go-criu v7.2.0's Criu.FeatureCheck returns the request it was given instead of CRIU's answer
// (every requested feature reads as available), so this sends the same request with go-criu's
// rpc messages over its own "criu swrk" connection and reads CRIU's answer. The swrk process is
// killed when ctx ends and always reaped before Features returns.
//
// Errors: ErrNotFound (wrapped, naming the path looked up) when the binary is absent; ctx.Err()
// when ctx ends first; otherwise the RPC's failure wrapped with the path and CRIU's error
// message, and the tail of CRIU's standard error when it has one.
func (c *Client) Features(ctx context.Context) (Features, error) {
	path, err := c.resolve()
	if err != nil {
		return Features{}, err
	}
	req := &rpc.CriuFeatures{
		MemTrack:   proto.Bool(true),
		LazyPages:  proto.Bool(true),
		PidfdStore: proto.Bool(true),
	}
	typ := rpc.CriuReqType_FEATURE_CHECK
	resp, err := swrkCall(ctx, path, &rpc.CriuReq{Type: &typ, Features: req})
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return Features{}, err
		}
		return Features{}, fmt.Errorf("criu: feature check with %s: %w", path, err)
	}
	got := resp.GetFeatures()
	if got == nil {
		return Features{}, fmt.Errorf("criu: feature check with %s: answer holds no features", path)
	}
	return Features{
		MemTrack:   got.GetMemTrack(),
		LazyPages:  got.GetLazyPages(),
		PidfdStore: got.GetPidfdStore(),
	}, nil
}

// maxResp bounds one RPC answer (go-criu reads 8 KiB; feature and version answers are tiny).
const maxResp = 64 << 10

// swrkCall starts `path swrk 3` with one end of a SOCK_SEQPACKET pair as fd 3 (the protocol
// go-criu speaks), sends req, reads one answer, and stops and reaps CRIU. It returns the answer
// when CRIU reports success and its type matches the request's.
func swrkCall(ctx context.Context, path string, req *rpc.CriuReq) (*rpc.CriuResp, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	reqB, err := proto.Marshal(req)
	if err != nil {
		return nil, err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	// Non-blocking, so that the runtime poller serves the client end and deadlines work.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	cln := os.NewFile(uintptr(fds[0]), "criu-swrk-client")
	srv := os.NewFile(uintptr(fds[1]), "criu-swrk-server")
	defer cln.Close()

	var stderr tailBuffer
	cmd := exec.CommandContext(ctx, path, "swrk", "3")
	cmd.ExtraFiles = []*os.File{srv}
	cmd.Stderr = &stderr
	cmd.WaitDelay = 5 * time.Second
	err = cmd.Start()
	srv.Close()
	if err != nil {
		return nil, err
	}
	waited := false
	wait := func() error {
		waited = true
		cln.Close() // EOF on CRIU's end: swrk exits
		return cmd.Wait()
	}
	defer func() {
		if !waited {
			_ = wait()
		}
	}()
	stop := context.AfterFunc(ctx, func() { _ = cln.SetDeadline(time.Now()) })
	defer stop()

	withStderr := func(err error) error {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if s := stderr.String(); s != "" {
			return fmt.Errorf("%w (criu stderr: %s)", err, s)
		}
		return err
	}
	if _, err := cln.Write(reqB); err != nil {
		return nil, withStderr(fmt.Errorf("send request: %w", err))
	}
	buf := make([]byte, maxResp)
	n, err := cln.Read(buf)
	if err != nil {
		_ = wait()
		return nil, withStderr(fmt.Errorf("read answer: %w", err))
	}
	resp := &rpc.CriuResp{}
	if err := proto.Unmarshal(buf[:n], resp); err != nil {
		return nil, withStderr(fmt.Errorf("decode answer: %w", err))
	}
	werr := wait()
	if !resp.GetSuccess() {
		return nil, withStderr(fmt.Errorf("criu answered failure (msg: %q, errno %d)", resp.GetCrErrmsg(), resp.GetCrErrno()))
	}
	if resp.GetType() != req.GetType() {
		return nil, fmt.Errorf("unexpected answer type %v to %v", resp.GetType(), req.GetType())
	}
	if werr != nil && ctx.Err() == nil {
		return nil, withStderr(fmt.Errorf("criu swrk: %w", werr))
	}
	return resp, nil
}

// tailBuffer keeps the last 512 bytes written to it, for error messages.
type tailBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf.Write(p)
	if t.buf.Len() > 512 {
		b := t.buf.Bytes()[t.buf.Len()-512:]
		t.buf.Reset()
		t.buf.Write(b)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(t.buf.String())
}
