package cuda

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/berth-dev/berth/gpu"
)

// DefaultLibrary is the file name Load opens when given "": the CUDA driver library as the NVIDIA
// driver installs it (found through the dynamic linker's search path).
const DefaultLibrary = "libcuda.so.1"

// DefaultVersionFile is where the NVIDIA kernel module reports its version
// ("NVRM version: NVIDIA UNIX ... Kernel Module  580.65.06  ...").
const DefaultVersionFile = "/proc/driver/nvidia/version"

// Option configures Load.
type Option func(*options)

type options struct {
	versionFile string
}

// WithVersionFile reads the kernel driver version from path instead of DefaultVersionFile (a
// test seam, or a host's /proc seen from a container at another path).
func WithVersionFile(path string) Option { return func(o *options) { o.versionFile = path } }

// Driver is gpu.Driver through the CUDA driver's checkpoint API in libcuda.so.1. Make one with
// Load; it is safe for concurrent use (each method is one driver call on one PID).
type Driver struct {
	path     string
	versions gpu.Versions

	getErrorName   func(r Result, s **byte) Result
	getErrorString func(r Result, s **byte) Result

	getRestoreThreadID func(pid int32, tid *int32) Result
	getState           func(pid int32, state *int32) Result
	lock               func(pid int32, args *lockArgs) Result
	checkpoint         func(pid int32, args *checkpointArgs) Result
	restore            func(pid int32, args *restoreArgs) Result
	unlock             func(pid int32, args *unlockArgs) Result
}

var _ gpu.Driver = (*Driver)(nil)

// Load opens the CUDA driver library at path ("" means DefaultLibrary), resolves the checkpoint
// API, calls cuInit(0) once, and reads the driver versions: the CUDA driver API version from
// cuDriverGetVersion and the kernel driver version from /proc/driver/nvidia/version (see
// WithVersionFile). Every error wraps gpu.ErrUnsupported and says what is missing: the library
// (no NVIDIA driver on this node), a checkpoint symbol (driver older than 570), or a driver
// version too old for the API.
//
// When the version file cannot be read, Versions().Driver is "" and DriverMajor is the oldest
// driver that ships the CUDA version found (12.8 -> 570, 12.9 -> 575, 13.0 -> 580), which is
// enough for gating but not for a fingerprint.
func Load(path string, opts ...Option) (*Driver, error) {
	o := options{versionFile: DefaultVersionFile}
	for _, opt := range opts {
		opt(&o)
	}
	if path == "" {
		path = DefaultLibrary
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("load CUDA driver library %s (is the NVIDIA driver installed?): %v: %w", path, err, gpu.ErrUnsupported)
	}
	d := &Driver{path: path}
	var (
		cuInit             func(flags uint32) Result
		cuDriverGetVersion func(v *int32) Result
	)
	// Symbols every CUDA driver has.
	for _, s := range []struct {
		name string
		fn   any
	}{
		{"cuInit", &cuInit},
		{"cuDriverGetVersion", &cuDriverGetVersion},
		{"cuGetErrorName", &d.getErrorName},
		{"cuGetErrorString", &d.getErrorString},
	} {
		if err := bind(h, s.name, s.fn); err != nil {
			return nil, fmt.Errorf("load CUDA driver library %s: %s not found (not a CUDA driver library?): %w", path, s.name, gpu.ErrUnsupported)
		}
	}
	// The checkpoint API, new in driver 570.
	for _, s := range []struct {
		name string
		fn   any
	}{
		{"cuCheckpointProcessGetRestoreThreadId", &d.getRestoreThreadID},
		{"cuCheckpointProcessGetState", &d.getState},
		{"cuCheckpointProcessLock", &d.lock},
		{"cuCheckpointProcessCheckpoint", &d.checkpoint},
		{"cuCheckpointProcessRestore", &d.restore},
		{"cuCheckpointProcessUnlock", &d.unlock},
	} {
		if err := bind(h, s.name, s.fn); err != nil {
			return nil, fmt.Errorf("load CUDA driver library %s: %s not found: the CUDA checkpoint API needs NVIDIA driver >= %d: %w",
				path, s.name, gpu.MinDriverCheckpoint, gpu.ErrUnsupported)
		}
	}
	if r := cuInit(0); r != Success {
		return nil, fmt.Errorf("load CUDA driver library %s: %w", path, d.wrapUnsupported("cuInit", r))
	}
	var cudaVersion int32
	if r := cuDriverGetVersion(&cudaVersion); r != Success {
		return nil, fmt.Errorf("load CUDA driver library %s: %w", path, d.wrapUnsupported("cuDriverGetVersion", r))
	}
	d.versions = gpu.Versions{CUDA: FormatCUDAVersion(int(cudaVersion))}
	if drv, err := ReadDriverVersion(o.versionFile); err == nil {
		d.versions.Driver = drv
		d.versions.DriverMajor, _ = DriverMajor(drv)
	} else {
		d.versions.DriverMajor = minDriverForCUDA(int(cudaVersion))
	}
	if err := gpu.CheckDriver(d.versions, false); err != nil {
		if d.versions.Driver == "" {
			return nil, fmt.Errorf("load CUDA driver library %s: CUDA driver API %s (driver version unknown: %s unreadable) is older than the checkpoint API: %w",
				path, d.versions.CUDA, o.versionFile, gpu.ErrUnsupported)
		}
		return nil, fmt.Errorf("load CUDA driver library %s: %w", path, err)
	}
	return d, nil
}

// bind points fn (a pointer to a func variable) at the C function name in library h.
func bind(h uintptr, name string, fn any) error {
	sym, err := purego.Dlsym(h, name)
	if err != nil || sym == 0 {
		return fmt.Errorf("symbol %s: %v", name, err)
	}
	purego.RegisterFunc(fn, sym)
	return nil
}

// Path returns the library Load opened.
func (d *Driver) Path() string { return d.path }

// Versions returns the versions read once by Load (no driver call).
func (d *Driver) Versions() (gpu.Versions, error) { return d.versions, nil }

// State returns pid's checkpoint state (cuCheckpointProcessGetState). A PID without CUDA gives
// an error wrapping gpu.ErrNotCUDA.
func (d *Driver) State(pid int) (gpu.ProcessState, error) {
	var st int32
	if r := d.getState(int32(pid), &st); r != Success {
		return 0, fmt.Errorf("get CUDA checkpoint state of pid %d: %w", pid, d.err("cuCheckpointProcessGetState", r))
	}
	return gpu.ProcessState(st), nil
}

// RestoreThreadID returns the Linux thread id of pid's CUDA restore thread
// (cuCheckpointProcessGetRestoreThreadId).
func (d *Driver) RestoreThreadID(pid int) (int, error) {
	var tid int32
	if r := d.getRestoreThreadID(int32(pid), &tid); r != Success {
		return 0, fmt.Errorf("get CUDA restore thread of pid %d: %w", pid, d.err("cuCheckpointProcessGetRestoreThreadId", r))
	}
	return int(tid), nil
}

// Lock locks pid's CUDA work (cuCheckpointProcessLock, RUNNING -> LOCKED), waiting at most
// timeout, rounded up to whole milliseconds; timeout must be positive (the driver's 0, wait
// forever, is never passed). Errors wrap gpu.ErrTimeout when the lock did not complete in time.
func (d *Driver) Lock(pid int, timeout time.Duration) error {
	if timeout <= 0 {
		return fmt.Errorf("lock CUDA process %d: timeout %v must be positive", pid, timeout)
	}
	ms := (timeout + time.Millisecond - 1) / time.Millisecond
	args := lockArgs{timeoutMs: uint32(min(int64(ms), math.MaxUint32))}
	if r := d.lock(int32(pid), &args); r != Success {
		return fmt.Errorf("lock CUDA process %d (timeout %v): %w", pid, timeout, d.err("cuCheckpointProcessLock", r))
	}
	return nil
}

// Checkpoint copies locked pid's device memory into its host memory and releases its GPUs
// (cuCheckpointProcessCheckpoint, LOCKED -> CHECKPOINTED).
func (d *Driver) Checkpoint(pid int) error {
	var args checkpointArgs
	if r := d.checkpoint(int32(pid), &args); r != Success {
		return fmt.Errorf("checkpoint CUDA process %d: %w", pid, d.err("cuCheckpointProcessCheckpoint", r))
	}
	return nil
}

// Restore brings checkpointed pid's device memory back (cuCheckpointProcessRestore,
// CHECKPOINTED -> LOCKED). pairs ("GPU-<uuid>" old -> new) remap the checkpoint's GPUs onto this
// node's; nil restores onto the same GPUs. Remapping needs driver >= 580: on an older driver the
// error wraps gpu.ErrUnsupported and names the version, and the driver is not called.
func (d *Driver) Restore(pid int, pairs []gpu.UUIDPair) error {
	var args restoreArgs
	var cpairs []gpuPair
	if len(pairs) > 0 {
		if err := gpu.CheckDriver(d.versions, true); err != nil {
			return fmt.Errorf("restore CUDA process %d: %w", pid, err)
		}
		cpairs = make([]gpuPair, len(pairs))
		for i, p := range pairs {
			var err error
			if cpairs[i].oldUUID, err = parseUUID(p.Old); err != nil {
				return fmt.Errorf("restore CUDA process %d: pair %d: %w", pid, i, err)
			}
			if cpairs[i].newUUID, err = parseUUID(p.New); err != nil {
				return fmt.Errorf("restore CUDA process %d: pair %d: %w", pid, i, err)
			}
		}
		args.gpuPairs = &cpairs[0]
		args.gpuPairsCount = uint32(len(cpairs))
	}
	r := d.restore(int32(pid), &args)
	runtime.KeepAlive(cpairs)
	if r != Success {
		return fmt.Errorf("restore CUDA process %d (%d GPU pairs): %w", pid, len(pairs), d.err("cuCheckpointProcessRestore", r))
	}
	return nil
}

// Unlock lets locked pid's CUDA work run again (cuCheckpointProcessUnlock, LOCKED -> RUNNING).
func (d *Driver) Unlock(pid int) error {
	var args unlockArgs
	if r := d.unlock(int32(pid), &args); r != Success {
		return fmt.Errorf("unlock CUDA process %d: %w", pid, d.err("cuCheckpointProcessUnlock", r))
	}
	return nil
}

// err builds the *Error of a failed call, with the driver's name and description of r.
func (d *Driver) err(call string, r Result) *Error {
	e := &Error{Call: call, Code: r}
	var s *byte
	if d.getErrorName != nil && d.getErrorName(r, &s) == Success {
		e.Name = goString(s)
	}
	s = nil
	if d.getErrorString != nil && d.getErrorString(r, &s) == Success {
		e.Message = goString(s)
	}
	return e
}

// wrapUnsupported is err for calls whose every failure means the driver is unusable.
func (d *Driver) wrapUnsupported(call string, r Result) error {
	e := d.err(call, r)
	if errors.Is(e, gpu.ErrUnsupported) {
		return e
	}
	return fmt.Errorf("%w: %w", e, gpu.ErrUnsupported)
}

// goString copies the NUL-terminated C string at p (owned by the driver) into Go memory.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	var n int
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// FormatCUDAVersion turns cuDriverGetVersion's integer (1000*major + 10*minor, 12080) into
// "12.8".
func FormatCUDAVersion(v int) string {
	return fmt.Sprintf("%d.%d", v/1000, (v%1000)/10)
}

// minDriverForCUDA is the oldest kernel driver major that ships CUDA driver API v (0 below 12.8,
// which predates the checkpoint API).
func minDriverForCUDA(v int) int {
	switch {
	case v >= 13000:
		return 580
	case v >= 12090:
		return 575
	case v >= 12080:
		return 570
	}
	return 0
}

// driverVersionRE matches a driver version ("550.54.15"), compiled by the first use.
var driverVersionRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^\d+\.\d+(\.\d+)*$`) })

// ReadDriverVersion returns the NVIDIA kernel module version ("580.65.06") from the first line
// of path, normally /proc/driver/nvidia/version, which reads like
// "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ...", or for the open
// module "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build ...".
func ReadDriverVersion(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("read NVIDIA driver version: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		_, rest, ok := strings.Cut(line, "Kernel Module")
		if !ok || !strings.HasPrefix(line, "NVRM version:") {
			continue
		}
		for _, f := range strings.Fields(rest) {
			if driverVersionRE().MatchString(f) {
				return f, nil
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read NVIDIA driver version from %s: %w", path, err)
	}
	return "", fmt.Errorf("read NVIDIA driver version: no \"NVRM version: ... Kernel Module <version>\" line in %s", path)
}

// DriverMajor returns the first number of a driver version ("580.65.06" -> 580).
func DriverMajor(v string) (int, error) {
	head, _, _ := strings.Cut(v, ".")
	n, err := strconv.Atoi(head)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("driver version %q: no major number", v)
	}
	return n, nil
}
