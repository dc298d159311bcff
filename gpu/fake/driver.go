package fake

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

// DefaultCallTimeout bounds one control call beyond Lock's own timeout.
const DefaultCallTimeout = 60 * time.Second

// Driver is the shim's gpu.Driver for fake CUDA processes. For host PID pid it connects to
// /proc/<pid>/root<SocketDir>/<nspid>.sock (nspid: pid in its own PID namespace), one connection
// per call, closed before the call returns, so no connection stays open across a CRIU dump.
type Driver struct {
	// Node is the node's fake GPU root: its versions are the driver's, and Restore passes its
	// driver version to the process. Nil: Versions fails and the process reads its GPUs' files.
	Node *Node
	// SocketDir is the control socket directory inside the container (default
	// fakecuda.DefaultSocketDir).
	SocketDir string
	// CallTimeout bounds each call beyond Lock's timeout (default DefaultCallTimeout).
	CallTimeout time.Duration
}

var _ gpu.Driver = (*Driver)(nil)

// Versions returns the node's driver versions.
func (d *Driver) Versions() (gpu.Versions, error) {
	if d.Node == nil {
		return gpu.Versions{}, fmt.Errorf("fake GPU driver: no node: %w", gpu.ErrUnsupported)
	}
	return d.Node.Versions()
}

// State returns pid's checkpoint state, or ErrNotCUDA when it has no control socket.
func (d *Driver) State(pid int) (gpu.ProcessState, error) {
	r, err := d.call(pid, "state", fakecuda.Request{Op: fakecuda.OpState}, 0)
	return r.State, err
}

// RestoreThreadID returns the TID of pid's control thread.
func (d *Driver) RestoreThreadID(pid int) (int, error) {
	r, err := d.call(pid, "restore thread id", fakecuda.Request{Op: fakecuda.OpRestoreThreadID}, 0)
	return r.TID, err
}

// Lock locks pid within timeout (0: no limit).
func (d *Driver) Lock(pid int, timeout time.Duration) error {
	_, err := d.call(pid, "lock", fakecuda.Request{Op: fakecuda.OpLock, TimeoutMs: timeout.Milliseconds()}, timeout)
	return err
}

// Checkpoint moves pid's device memory into its host memory.
func (d *Driver) Checkpoint(pid int) error {
	_, err := d.call(pid, "checkpoint", fakecuda.Request{Op: fakecuda.OpCheckpoint}, 0)
	return err
}

// Restore brings pid's device memory back onto its GPUs, remapped by pairs. A destination GPU
// without the free memory the process needs refuses it (gpu.ErrOutOfMemory, the process still
// CHECKPOINTED), or, where the node's RestoreWhenFull is fakecuda.FullHang, never answers: the
// call then fails after CallTimeout with gpu.ErrTimeout, and the process stays stuck until killed.
func (d *Driver) Restore(pid int, pairs []gpu.UUIDPair) error {
	req := fakecuda.Request{Op: fakecuda.OpRestore, Pairs: pairs}
	if d.Node != nil {
		req.Driver = d.Node.spec.Driver
		remap := false
		for _, p := range pairs {
			remap = remap || p.Old != p.New
		}
		v, err := d.Node.Versions()
		if err == nil {
			err = gpu.CheckDriver(v, remap)
		}
		if err != nil {
			return fmt.Errorf("fake GPU restore of pid %d: %w", pid, err)
		}
	}
	_, err := d.call(pid, "restore", req, 0)
	return err
}

// Unlock lets pid's GPU work run again.
func (d *Driver) Unlock(pid int) error {
	_, err := d.call(pid, "unlock", fakecuda.Request{Op: fakecuda.OpUnlock}, 0)
	return err
}

// Usage returns pid's device memory per GPU UUID, in bytes.
func (d *Driver) Usage(pid int) (map[string]uint64, error) {
	r, err := d.call(pid, "usage", fakecuda.Request{Op: fakecuda.OpUsage}, 0)
	return r.Usage, err
}

// SocketPath returns the host path of pid's control socket.
func (d *Driver) SocketPath(pid int) (string, error) {
	nspid, err := NSPid(pid)
	if err != nil {
		return "", err
	}
	dir := d.SocketDir
	if dir == "" {
		dir = fakecuda.DefaultSocketDir
	}
	return filepath.Join(fmt.Sprintf("/proc/%d/root", pid), dir, strconv.Itoa(nspid)+".sock"), nil
}

// NSPid returns host PID pid's id in its innermost PID namespace (the last NSpid field of
// /proc/<pid>/status).
func NSPid(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) == 0 {
				break
			}
			return strconv.Atoi(f[len(f)-1])
		}
	}
	return pid, nil
}

// call performs one request on a fresh connection to pid's control socket.
func (d *Driver) call(pid int, step string, req fakecuda.Request, extra time.Duration) (fakecuda.Response, error) {
	var resp fakecuda.Response
	wrap := func(err error) error {
		return fmt.Errorf("fake GPU %s of pid %d: %w", step, pid, err)
	}
	if d.Node != nil {
		if v, err := d.Node.Versions(); err == nil {
			if err := gpu.CheckDriver(v, false); err != nil {
				return resp, wrap(err)
			}
		}
	}
	sock, err := d.SocketPath(pid)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return resp, wrap(fmt.Errorf("no such process: %w", gpu.ErrNotCUDA))
		}
		return resp, wrap(err)
	}
	conn, err := dialUnix(sock)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOTDIR) {
			return resp, wrap(fmt.Errorf("no control socket %s: %w", sock, gpu.ErrNotCUDA))
		}
		return resp, wrap(err)
	}
	defer conn.Close()
	timeout := d.CallTimeout
	if timeout <= 0 {
		timeout = DefaultCallTimeout
	}
	_ = conn.SetDeadline(time.Now().Add(timeout + extra))
	b, err := json.Marshal(req)
	if err != nil {
		return resp, wrap(err)
	}
	if _, err := conn.Write(append(b, '\n')); err != nil {
		return resp, wrap(err)
	}
	// Half-close, and below wait for the process to close its end: that end lives in the
	// shim's network namespace, and CRIU cannot dump the process while it holds it.
	if uc, ok := conn.(*net.UnixConn); ok {
		_ = uc.CloseWrite()
	}
	br := bufio.NewReader(conn)
	line, err := br.ReadBytes('\n')
	if err == nil {
		_, _ = io.Copy(io.Discard, br)
	}
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return resp, wrap(fmt.Errorf("no answer within %v (are its threads frozen?): %w", timeout+extra, gpu.ErrTimeout))
		}
		return resp, wrap(fmt.Errorf("read answer: %w", err))
	}
	if err := json.Unmarshal(line, &resp); err != nil {
		return resp, wrap(fmt.Errorf("bad answer %q: %w", line, err))
	}
	if resp.Error == "" {
		return resp, nil
	}
	var kind error
	switch resp.Code {
	case fakecuda.CodeIllegalState:
		kind = gpu.ErrIllegalState
	case fakecuda.CodeTimeout:
		kind = gpu.ErrTimeout
	case fakecuda.CodeUnsupported:
		kind = gpu.ErrUnsupported
	case fakecuda.CodeOutOfMemory:
		kind = gpu.ErrOutOfMemory
	}
	if kind != nil {
		msg := strings.TrimSuffix(resp.Error, ": "+kind.Error())
		return resp, wrap(fmt.Errorf("%s (state %s): %w", msg, resp.State, kind))
	}
	return resp, wrap(fmt.Errorf("%s (state %s)", resp.Error, resp.State))
}

// dialUnix connects to the unix socket at path; paths too long for sockaddr_un go through an
// O_PATH descriptor of the directory.
func dialUnix(path string) (net.Conn, error) {
	if len(path) < 100 {
		return net.Dial("unix", path)
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: filepath.Dir(path), Err: err}
	}
	defer unix.Close(fd)
	return net.Dial("unix", fmt.Sprintf("/proc/self/fd/%d/%s", fd, filepath.Base(path)))
}
