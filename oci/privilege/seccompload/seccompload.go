// Package seccompload compiles a seccomp profile (an OCI spec's linux.seccomp) into the filter
// runc installs for it, by having runc's own code (libcontainer/seccomp, over the node's
// libseccomp) load it into one thread of a child process and reading the filter back with
// PTRACE_SECCOMP_GET_FILTER: the program a container of that profile runs, as the kernel keeps
// it and CRIU dumps it. runc's package is compiled only with the build tag seccomp (and cgo);
// without it Compile says so.
//
// What belongs here: Compile (the parent) and Child (the child, run as `berth-shim-helper
// seccomp-load`). What does not: comparing filters (oci/privilege/seccompbpf). Only
// berth-shim-helper links it: runc's seccomp code and libseccomp stay out of the shim.
package seccompload

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"
	"unsafe"

	runcseccomp "github.com/opencontainers/runc/libcontainer/seccomp"
	"github.com/opencontainers/runc/libcontainer/specconv"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/berth-dev/berth/oci/privilege/seccompbpf"
)

// ChildCommand is berth-shim-helper's argument that runs Child.
const ChildCommand = "seccomp-load"

// ErrCompile is seccompbpf.ErrCompile: the profile could not be compiled (runc refuses it, the
// helper was built without seccomp support, the child died or did not answer in time).
var ErrCompile = seccompbpf.ErrCompile

// timeout bounds a compilation: the child's start, its load and the read back.
const timeout = 10 * time.Second

// ptraceSeccompGetFilter is PTRACE_SECCOMP_GET_FILTER (linux/ptrace.h).
const ptraceSeccompGetFilter = 0x420c

// Compile returns the filter runc installs for profile (a struct sock_filter array in this
// machine's byte order), compiled by a child process (exe with args, which must run Child) and
// read back from the child's thread with PTRACE_SECCOMP_GET_FILTER (the caller needs
// CAP_SYS_ADMIN, as root has). The child is killed before Compile returns. Errors wrap
// ErrCompile, naming the cause (runc's error, the child's standard error).
func Compile(ctx context.Context, profile *specs.LinuxSeccomp, exe string, args ...string) ([]byte, error) {
	if profile == nil {
		return nil, fmt.Errorf("%w: no profile", ErrCompile)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	body, err := json.Marshal(profile)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCompile, err)
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCompile, err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCompile, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%w: start %s: %w", ErrCompile, exe, err)
	}
	defer func() {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	if _, err := stdin.Write(append(body, '\n')); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCompile, err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("%w: the loader said nothing (%v): %s", ErrCompile, err, tail(stderr.String()))
	}
	tid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || tid <= 0 {
		return nil, fmt.Errorf("%w: the loader said %q: %s", ErrCompile, strings.TrimSpace(line), tail(stderr.String()))
	}
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := filterOf(tid)
		done <- result{b, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("%w: read the loaded filter of thread %d: %w", ErrCompile, tid, r.err)
		}
		return r.b, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: %w", ErrCompile, ctx.Err())
	}
}

// filterOf returns the most recent seccomp filter of thread tid: it seizes the thread, stops it,
// reads the filter and detaches, on one locked OS thread (ptrace requests must come from the
// tracer's thread).
func filterOf(tid int) ([]byte, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.PtraceSeize(tid); err != nil {
		return nil, fmt.Errorf("seize: %w", err)
	}
	defer unix.PtraceDetach(tid) //nolint:errcheck // the child is killed next
	if err := unix.PtraceInterrupt(tid); err != nil {
		return nil, fmt.Errorf("interrupt: %w", err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(tid, &ws, unix.WALL, nil); err != nil {
		return nil, fmt.Errorf("wait: %w", err)
	}
	if !ws.Stopped() {
		return nil, fmt.Errorf("thread %d did not stop: status %#x", tid, uint32(ws))
	}
	n, _, errno := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(tid), 0, 0, 0, 0)
	if errno != 0 {
		return nil, fmt.Errorf("PTRACE_SECCOMP_GET_FILTER: %w", errno)
	}
	if n == 0 || n > 4096 {
		return nil, fmt.Errorf("PTRACE_SECCOMP_GET_FILTER: %d instructions", n)
	}
	buf := make([]byte, 8*int(n))
	if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, ptraceSeccompGetFilter, uintptr(tid), 0, uintptr(unsafe.Pointer(&buf[0])), 0, 0); errno != 0 {
		return nil, fmt.Errorf("PTRACE_SECCOMP_GET_FILTER: %w", errno)
	}
	return buf, nil
}

// Child reads a profile (JSON, one line) from in, converts it as runc does
// (specconv.SetupSeccomp), loads it into its own, locked, thread with runc's InitSeccomp, writes
// that thread's id and a newline to out, and waits until in ends (Compile closes it and kills the
// child). It returns the process's exit status: non-zero, with the reason on standard error,
// when it could not load the profile.
func Child(in io.Reader, out io.Writer) int {
	br := bufio.NewReader(in)
	line, err := br.ReadBytes('\n')
	if err != nil && len(line) == 0 {
		fmt.Fprintln(os.Stderr, "seccomp-load: no profile on standard input:", err)
		return 2
	}
	var profile specs.LinuxSeccomp
	if err := json.Unmarshal(line, &profile); err != nil {
		fmt.Fprintln(os.Stderr, "seccomp-load: profile:", err)
		return 2
	}
	cfg, err := specconv.SetupSeccomp(&profile)
	if err != nil {
		fmt.Fprintln(os.Stderr, "seccomp-load: runc refuses the profile:", err)
		return 1
	}
	runtime.LockOSThread() // never unlocked: the thread holds the filter until the process ends
	if _, err := runcseccomp.InitSeccomp(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "seccomp-load: runc's InitSeccomp (berth-shim-helper needs the build tag seccomp, as make build gives it):", err)
		return 1
	}
	fmt.Fprintln(out, unix.Gettid())
	_, _ = io.Copy(io.Discard, br)
	return 0
}

// tail is the last 512 bytes of s.
func tail(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 512 {
		s = "..." + s[len(s)-512:]
	}
	return s
}
