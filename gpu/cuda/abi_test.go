package cuda

import (
	"errors"
	"strings"
	"testing"
	"unsafe"

	"github.com/berth-dev/berth/gpu"
)

// The sizes and offsets cuda.h gives the checkpoint structures on 64-bit Linux. The fake-driver
// test checks the same numbers against what gcc makes of a C declaration.
func TestStructLayout(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof CUcheckpointLockArgs", unsafe.Sizeof(lockArgs{}), 64},
		{"offsetof CUcheckpointLockArgs.reserved0", unsafe.Offsetof(lockArgs{}.reserved0), 4},
		{"offsetof CUcheckpointLockArgs.reserved1", unsafe.Offsetof(lockArgs{}.reserved1), 8},
		{"sizeof CUcheckpointCheckpointArgs", unsafe.Sizeof(checkpointArgs{}), 64},
		{"sizeof CUcheckpointUnlockArgs", unsafe.Sizeof(unlockArgs{}), 64},
		{"sizeof CUuuid", unsafe.Sizeof(cuUUID{}), 16},
		{"sizeof CUcheckpointGpuPair", unsafe.Sizeof(gpuPair{}), 32},
		{"offsetof CUcheckpointGpuPair.newUuid", unsafe.Offsetof(gpuPair{}.newUUID), 16},
		{"sizeof CUcheckpointRestoreArgs", unsafe.Sizeof(restoreArgs{}), 64},
		{"offsetof CUcheckpointRestoreArgs.gpuPairsCount", unsafe.Offsetof(restoreArgs{}.gpuPairsCount), 8},
		{"offsetof CUcheckpointRestoreArgs.reserved", unsafe.Offsetof(restoreArgs{}.reserved), 12},
		{"offsetof CUcheckpointRestoreArgs.reserved1", unsafe.Offsetof(restoreArgs{}.reserved1), 56},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}

func TestResultKind(t *testing.T) {
	for _, c := range []struct {
		r    Result
		want error
	}{
		{Success, nil},
		{ErrorTimeout, gpu.ErrTimeout},
		{ErrorIllegalState, gpu.ErrIllegalState},
		{ErrorNotFound, gpu.ErrNotCUDA},
		{ErrorInvalidValue, gpu.ErrNotCUDA},
		{ErrorNotSupported, gpu.ErrUnsupported},
		{ErrorNotInitialized, gpu.ErrUnsupported},
		{ErrorDeinitialized, gpu.ErrUnsupported},
		{ErrorNoDevice, gpu.ErrUnsupported},
		{ErrorNotPermitted, gpu.ErrUnsupported},
		{ErrorSystemDriverMismatch, gpu.ErrUnsupported},
		{ErrorCompatNotSupported, gpu.ErrUnsupported},
		{ErrorMPSConnectionFailed, gpu.ErrUnsupported},
		{ErrorMPSClientTerminated, gpu.ErrUnsupported},
		{ErrorOutOfMemory, gpu.ErrOutOfMemory}, // issue 21: driver 580's answer to a restore onto a full GPU
		{ErrorNotReady, gpu.ErrTimeout},        // issue 21: what cuCheckpointProcessLock documents for its timeout
		{ErrorUnknown, nil},
		{Result(12345), nil},
	} {
		if got := c.r.Kind(); got != c.want {
			t.Errorf("Result(%d).Kind() = %v, want %v", c.r, got, c.want)
		}
		e := &Error{Call: "cuCheckpointProcessLock", Code: c.r}
		if c.want != nil && !errors.Is(e, c.want) {
			t.Errorf("errors.Is(%v, %v) = false", e, c.want)
		}
		if !strings.Contains(e.Error(), "cuCheckpointProcessLock") {
			t.Errorf("%q does not name the call", e.Error())
		}
	}
	e := &Error{Call: "cuCheckpointProcessLock", Code: ErrorTimeout, Name: "CUDA_ERROR_TIMEOUT", Message: "the timeout lapsed"}
	if got, want := e.Error(), "cuCheckpointProcessLock: CUDA_ERROR_TIMEOUT (the timeout lapsed): timed out"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
}

// TestKindOf: NOT_INITIALIZED from the state queries is a PID without CUDA (a shell or tini as
// the container's PID 1), from any other call a driver that cannot be used.
func TestKindOf(t *testing.T) {
	for _, c := range []struct {
		call string
		r    Result
		want error
	}{
		{"cuCheckpointProcessGetState", ErrorNotInitialized, gpu.ErrNotCUDA},
		{"cuCheckpointProcessGetRestoreThreadId", ErrorNotInitialized, gpu.ErrNotCUDA},
		{"cuCheckpointProcessGetState", ErrorInvalidValue, gpu.ErrNotCUDA},
		{"cuCheckpointProcessLock", ErrorNotInitialized, gpu.ErrUnsupported},
		{"cuCheckpointProcessLock", ErrorNotReady, gpu.ErrTimeout},
		{"cuCheckpointProcessRestore", ErrorOutOfMemory, gpu.ErrOutOfMemory},
	} {
		e := &Error{Call: c.call, Code: c.r}
		if !errors.Is(e, c.want) {
			t.Errorf("%s %d: %v does not match %v", c.call, c.r, e, c.want)
		}
	}
}

func TestParseUUID(t *testing.T) {
	u, err := parseUUID("GPU-5a3b1c2d-0e0f-1011-1213-141516171819")
	if err != nil {
		t.Fatal(err)
	}
	want := cuUUID{0x5a, 0x3b, 0x1c, 0x2d, 0x0e, 0x0f, 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19}
	if u != want {
		t.Errorf("parseUUID = %x, want %x", u, want)
	}
	for _, bad := range []string{"", "GPU-", "GPU-5a3b1c2d", "GPU-zz3b1c2d-0e0f-1011-1213-141516171819", "MIG-5a3b1c2d-0e0f-1011-1213-14151617181"} {
		if _, err := parseUUID(bad); err == nil {
			t.Errorf("parseUUID(%q): no error", bad)
		}
	}
}

func TestVersions(t *testing.T) {
	for v, want := range map[int]string{12080: "12.8", 12090: "12.9", 13000: "13.0", 11040: "11.4"} {
		if got := FormatCUDAVersion(v); got != want {
			t.Errorf("FormatCUDAVersion(%d) = %q, want %q", v, got, want)
		}
	}
	for v, want := range map[int]int{12040: 0, 12080: 570, 12090: 575, 13000: 580, 13010: 580} {
		if got := minDriverForCUDA(v); got != want {
			t.Errorf("minDriverForCUDA(%d) = %d, want %d", v, got, want)
		}
	}
	dir := t.TempDir()
	for _, c := range []struct{ text, want string }{
		{"NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\nGCC version:  gcc version 12.2.0\n", "580.65.06"},
		{"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  (dvs-builder@U16-I3-B03-4-3)  Wed Mar  5 2025\n", "570.124.06"},
		{"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  575.51.03  Release Build\n", "575.51.03"},
		{"garbage\n", ""},
	} {
		p := dir + "/version"
		writeFile(t, p, c.text)
		got, err := ReadDriverVersion(p)
		if got != c.want || (c.want == "") != (err != nil) {
			t.Errorf("ReadDriverVersion(%q) = %q, %v; want %q", c.text, got, err, c.want)
		}
	}
	if _, err := ReadDriverVersion(dir + "/missing"); err == nil {
		t.Error("ReadDriverVersion(missing): no error")
	}
	if n, err := DriverMajor("580.65.06"); n != 580 || err != nil {
		t.Errorf("DriverMajor = %d, %v", n, err)
	}
	if _, err := DriverMajor("x.1"); err == nil {
		t.Error("DriverMajor(x.1): no error")
	}
}

func TestLoadWithoutLibrary(t *testing.T) {
	_, err := Load("/nonexistent/libcuda.so.1")
	if !errors.Is(err, gpu.ErrUnsupported) {
		t.Fatalf("Load(missing) = %v, want ErrUnsupported", err)
	}
	for _, want := range []string{"/nonexistent/libcuda.so.1", "NVIDIA driver installed"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Load(missing) error %q does not say %q", err, want)
		}
	}
	// The default library: on a machine without the NVIDIA driver (CI) this must be
	// ErrUnsupported, never a panic; on a GPU machine it may load.
	d, err := Load("")
	switch {
	case err == nil:
		v, _ := d.Versions()
		t.Logf("libcuda.so.1 loaded on this machine: %+v", v)
	case !errors.Is(err, gpu.ErrUnsupported):
		t.Errorf("Load(\"\") = %v, want nil or ErrUnsupported", err)
	default:
		t.Logf("Load(\"\"): %v", err)
	}
}
