package criu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// LazyPipeBytes is the pipe size CRIU's lazy page server asks for (PIPE_MAX_SIZE pages of 4 KiB,
// criu/page-pipe.c: 819 pages, 3.2 MiB) when it splices pages to a request. Without
// CAP_SYS_RESOURCE a pipe cannot grow past fs.pipe-max-size; CRIU 4.2 ignores that failure and
// fails the first page request with "page-pipe: splice: -1: Bad file descriptor".
const LazyPipeBytes = 819 * 4096

// MinLazyPipeMaxSize is the fs.pipe-max-size, in bytes, that berth asks for when CRIU runs
// without CAP_SYS_RESOURCE: the power of two above LazyPipeBytes.
const MinLazyPipeMaxSize = 4 << 20

// PipeMaxSizeFile is the sysctl fs.pipe-max-size.
const PipeMaxSizeFile = "/proc/sys/fs/pipe-max-size"

// ErrLazyUnsupported: this node cannot take part in a lazy (post-copy) move; the error says why
// and how to fix it.
var ErrLazyUnsupported = errors.New("lazy (post-copy) mode unavailable")

// capSysResource is CAP_SYS_RESOURCE's bit in /proc/self/status's CapEff.
const capSysResource = 24

// CheckLazyDump reports whether CRIU, run with this process's capabilities (berth's shim and
// berthctl both run as root), can serve a lazy dump's pages on this node: it can when it holds
// CAP_SYS_RESOURCE (read from /proc/self/status) or when fs.pipe-max-size is at least
// LazyPipeBytes. The error (ErrLazyUnsupported) names the value found and the sysctl that fixes it.
func CheckLazyDump() error {
	b, err := os.ReadFile(PipeMaxSizeFile)
	return checkLazyDump(hasCap(capSysResource), b, err)
}

// checkLazyDump is CheckLazyDump on what it read: whether CRIU holds CAP_SYS_RESOURCE, and
// fs.pipe-max-size's content (or the error reading it).
func checkLazyDump(capSysResource bool, pipeMax []byte, readErr error) error {
	if capSysResource {
		return nil
	}
	if readErr != nil {
		return fmt.Errorf("%w: %w", ErrLazyUnsupported, readErr)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(pipeMax)), 10, 64)
	if err != nil {
		return fmt.Errorf("%w: %s: %q: %w", ErrLazyUnsupported, PipeMaxSizeFile, pipeMax, err)
	}
	if v < LazyPipeBytes {
		return fmt.Errorf("%w: fs.pipe-max-size is %d bytes and CRIU runs without CAP_SYS_RESOURCE, but CRIU's lazy page server needs pipes of %d bytes (it would fail on the first page request with \"page-pipe: splice: -1: Bad file descriptor\"); raise it on the source node: sysctl -w fs.pipe-max-size=%d",
			ErrLazyUnsupported, v, LazyPipeBytes, MinLazyPipeMaxSize)
	}
	return nil
}

// CheckLazyRestore reports whether CRIU (the binary c names) can restore lazily on this node:
// CRIU's feature check says non-cooperative userfaultfd works (FeatureLazyPages). The error
// (ErrLazyUnsupported) says what to enable.
func (c *Client) CheckLazyRestore(ctx context.Context) error {
	f, err := c.Features(ctx)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrLazyUnsupported, err)
	}
	if !f.LazyPages {
		return fmt.Errorf("%w: CRIU finds no non-cooperative userfaultfd on this node (criu check --feature uffd-noncoop): it needs a kernel built with CONFIG_USERFAULTFD (4.11 or later; /dev/userfaultfd or the userfaultfd system call usable by root, vm.unprivileged_userfaultfd for others)",
			ErrLazyUnsupported)
	}
	return nil
}

// hasCap reports whether this process's effective capabilities (/proc/self/status) hold bit.
func hasCap(bit uint) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && n&(1<<bit) != 0
		}
	}
	return false
}
