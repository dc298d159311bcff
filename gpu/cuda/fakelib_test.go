package cuda

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/berth-dev/berth/gpu"
)

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

var (
	fakeOnce  sync.Once
	fakeDir   string
	fakeErr   error
	fakeSkips string
)

// buildFake compiles testdata/fakecuda.c twice (with and without the checkpoint API) into a
// directory shared by the tests of this run, and returns the path of a private copy of the
// wanted one: each copy is its own file, so the dynamic linker loads it afresh with fresh state.
func buildFake(t *testing.T, withCheckpoint bool) string {
	t.Helper()
	fakeOnce.Do(func() {
		gcc, err := exec.LookPath("gcc")
		if err != nil {
			fakeSkips = "gcc not found: cannot build the fake libcuda.so.1"
			return
		}
		fakeDir, fakeErr = os.MkdirTemp("", "berth-fakecuda-")
		if fakeErr != nil {
			return
		}
		for name, extra := range map[string][]string{"full.so": nil, "old.so": {"-DNO_CHECKPOINT"}} {
			args := append([]string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", filepath.Join(fakeDir, name)}, extra...)
			out, err := exec.Command(gcc, append(args, "testdata/fakecuda.c")...).CombinedOutput()
			if err != nil {
				fakeErr = errors.New("gcc: " + err.Error() + ": " + string(out))
				return
			}
		}
	})
	if fakeSkips != "" {
		if os.Getenv("CI") != "" {
			t.Fatal("CI is set: " + fakeSkips)
		}
		t.Skip(fakeSkips)
	}
	if fakeErr != nil {
		t.Fatal(fakeErr)
	}
	src := filepath.Join(fakeDir, "full.so")
	if !withCheckpoint {
		src = filepath.Join(fakeDir, "old.so")
	}
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "libcuda.so.1")
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// fake drives the fake library's control functions.
type fake struct {
	sizeOf         func(which int32) int32
	setCUDAVersion func(v int32)
	setInitResult  func(r int32)
	initCalls      func() int32
	addProcess     func(pid int32)
	force          func(pid, step, result int32)
	lastTimeoutMs  func() uint32
	lastPairCount  func() uint32
	lastPairByte   func(pair, which, b int32) int32
}

func openFake(t *testing.T, path string) *fake {
	t.Helper()
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{}
	purego.RegisterLibFunc(&f.sizeOf, h, "fake_sizeof")
	purego.RegisterLibFunc(&f.setCUDAVersion, h, "fake_set_cuda_version")
	purego.RegisterLibFunc(&f.setInitResult, h, "fake_set_init_result")
	purego.RegisterLibFunc(&f.initCalls, h, "fake_init_calls")
	purego.RegisterLibFunc(&f.addProcess, h, "fake_add_process")
	purego.RegisterLibFunc(&f.force, h, "fake_force")
	purego.RegisterLibFunc(&f.lastTimeoutMs, h, "fake_last_timeout_ms")
	purego.RegisterLibFunc(&f.lastPairCount, h, "fake_last_pair_count")
	purego.RegisterLibFunc(&f.lastPairByte, h, "fake_last_pair_byte")
	return f
}

// versionFile writes a /proc/driver/nvidia/version for driver v.
func versionFile(t *testing.T, v string) string {
	p := filepath.Join(t.TempDir(), "version")
	writeFile(t, p, "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "+v+"  Release Build  (fake)\n")
	return p
}

// C's view of the structures must agree with Go's.
func TestFakeLayoutAgreesWithC(t *testing.T) {
	f := openFake(t, buildFake(t, true))
	for which, want := range map[int32]uintptr{
		0: unsafe.Sizeof(lockArgs{}),
		1: unsafe.Sizeof(checkpointArgs{}),
		2: unsafe.Sizeof(restoreArgs{}),
		3: unsafe.Sizeof(unlockArgs{}),
		4: unsafe.Sizeof(gpuPair{}),
		5: unsafe.Offsetof(restoreArgs{}.gpuPairsCount),
		6: unsafe.Offsetof(restoreArgs{}.reserved),
		7: unsafe.Offsetof(restoreArgs{}.reserved1),
		8: unsafe.Offsetof(lockArgs{}.reserved1),
	} {
		if got := f.sizeOf(which); uintptr(got) != want {
			t.Errorf("C layout item %d = %d, Go = %d", which, got, want)
		}
	}
}

const (
	oldUUID = "GPU-00112233-4455-6677-8899-aabbccddeeff"
	newUUID = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
)

func TestFakeSequence(t *testing.T) {
	for _, c := range []struct {
		name       string
		driver     string // "" : no version file (driver inferred from CUDA version)
		cuda       int32
		checkpoint bool // library exports the checkpoint API
		loadErr    string
		remapErr   string // error of Restore with pairs; "" means it works
	}{
		{name: "565 without the API", driver: "565.57.01", cuda: 12070, checkpoint: false, loadErr: "cuCheckpointProcessGetRestoreThreadId not found: the CUDA checkpoint API needs NVIDIA driver >= 570"},
		{name: "565 with symbols", driver: "565.57.01", cuda: 12070, checkpoint: true, loadErr: "needs NVIDIA driver >= 570, this node has 565.57.01"},
		{name: "575 no remap", driver: "575.51.03", cuda: 12090, checkpoint: true, remapErr: "needs NVIDIA driver >= 580, this node has 575.51.03"},
		{name: "580 remap", driver: "580.65.06", cuda: 13000, checkpoint: true},
		{name: "no version file, CUDA 13.0", cuda: 13000, checkpoint: true},
		{name: "no version file, CUDA 12.4", cuda: 12040, checkpoint: true, loadErr: "CUDA driver API 12.4 (driver version unknown"},
	} {
		t.Run(c.name, func(t *testing.T) {
			lib := buildFake(t, c.checkpoint)
			f := openFake(t, lib)
			f.setCUDAVersion(c.cuda)
			vf := filepath.Join(t.TempDir(), "missing")
			if c.driver != "" {
				vf = versionFile(t, c.driver)
			}
			d, err := Load(lib, WithVersionFile(vf))
			if c.loadErr != "" {
				if !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), c.loadErr) {
					t.Fatalf("Load = %v, want ErrUnsupported saying %q", err, c.loadErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			v, _ := d.Versions()
			if v.Driver != c.driver || v.CUDA != FormatCUDAVersion(int(c.cuda)) {
				t.Errorf("Versions = %+v", v)
			}

			const pid = 4242
			f.addProcess(pid)
			step := func(name string, err error, want gpu.ProcessState) {
				t.Helper()
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if st, err := d.State(pid); err != nil || st != want {
					t.Fatalf("after %s: state %v, %v; want %v", name, st, err, want)
				}
			}
			step("start", nil, gpu.StateRunning)
			if tid, err := d.RestoreThreadID(pid); err != nil || tid != pid+7 {
				t.Errorf("RestoreThreadID = %d, %v", tid, err)
			}
			step("lock", d.Lock(pid, 1500*time.Microsecond), gpu.StateLocked)
			if got := f.lastTimeoutMs(); got != 2 {
				t.Errorf("lock timeout = %d ms, want 2 (1.5 ms rounded up)", got)
			}
			step("checkpoint", d.Checkpoint(pid), gpu.StateCheckpointed)
			// Same GPUs: no pairs.
			step("restore", d.Restore(pid, nil), gpu.StateLocked)
			if n := f.lastPairCount(); n != 0 {
				t.Errorf("restore without pairs passed %d pairs", n)
			}
			step("checkpoint again", d.Checkpoint(pid), gpu.StateCheckpointed)
			err = d.Restore(pid, []gpu.UUIDPair{{Old: oldUUID, New: newUUID}})
			if c.remapErr != "" {
				if !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), c.remapErr) {
					t.Fatalf("Restore(pairs) = %v, want ErrUnsupported saying %q", err, c.remapErr)
				}
				step("refused remap leaves the process alone", nil, gpu.StateCheckpointed)
				step("restore", d.Restore(pid, nil), gpu.StateLocked)
			} else {
				step("restore with pairs", err, gpu.StateLocked)
				if n := f.lastPairCount(); n != 1 {
					t.Fatalf("restore passed %d pairs, want 1", n)
				}
				o, _ := parseUUID(oldUUID)
				nw, _ := parseUUID(newUUID)
				for b := range 16 {
					if f.lastPairByte(0, 0, int32(b)) != int32(o[b]) || f.lastPairByte(0, 1, int32(b)) != int32(nw[b]) {
						t.Fatalf("pair byte %d differs from the UUIDs", b)
					}
				}
			}
			step("unlock", d.Unlock(pid), gpu.StateRunning)
			if n := f.initCalls(); n != 1 {
				t.Errorf("cuInit called %d times, want once (at Load)", n)
			}
		})
	}
}

func TestFakeErrors(t *testing.T) {
	lib := buildFake(t, true)
	f := openFake(t, lib)
	d, err := Load(lib, WithVersionFile(versionFile(t, "580.65.06")))
	if err != nil {
		t.Fatal(err)
	}
	const pid, busy = 100, 101
	f.addProcess(pid)
	f.addProcess(busy)
	f.force(busy, 2, int32(ErrorTimeout))

	check := func(name string, err, want error, says ...string) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Errorf("%s = %v, want %v", name, err, want)
			return
		}
		for _, s := range says {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("%s: %q does not say %q", name, err, s)
			}
		}
		var ce *Error
		if !errors.As(err, &ce) {
			t.Errorf("%s: %v is not a *cuda.Error", name, err)
		}
	}
	_, err = d.State(999)
	check("State(non-CUDA pid)", err, gpu.ErrNotCUDA, "pid 999", "CUDA_ERROR_INVALID_VALUE")
	check("Lock(non-CUDA pid)", d.Lock(999, time.Second), gpu.ErrNotCUDA, "CUDA_ERROR_NOT_FOUND")
	check("Lock(busy)", d.Lock(busy, 10*time.Millisecond), gpu.ErrTimeout, "lock CUDA process 101", "CUDA_ERROR_TIMEOUT", "fake driver says so")
	check("Checkpoint(running)", d.Checkpoint(pid), gpu.ErrIllegalState, "checkpoint CUDA process 100", "CUDA_ERROR_ILLEGAL_STATE")
	check("Unlock(running)", d.Unlock(pid), gpu.ErrIllegalState)
	check("Restore(running)", d.Restore(pid, nil), gpu.ErrIllegalState)
	f.force(pid, 3, int32(ErrorNotSupported))
	if err := d.Lock(pid, time.Second); err != nil {
		t.Fatal(err)
	}
	check("Checkpoint(MIG)", d.Checkpoint(pid), gpu.ErrUnsupported, "CUDA_ERROR_NOT_SUPPORTED")
	if err := d.Lock(pid, 0); err == nil {
		t.Error("Lock with zero timeout: no error")
	}
	if err := d.Restore(pid, []gpu.UUIDPair{{Old: "GPU-bad", New: newUUID}}); err == nil || !strings.Contains(err.Error(), "GPU-bad") {
		t.Errorf("Restore(bad UUID) = %v", err)
	}
	// An unmapped code keeps its number.
	f.force(pid, 5, 999)
	err = d.Unlock(pid)
	var ce *Error
	if !errors.As(err, &ce) || ce.Code != ErrorUnknown || !strings.Contains(err.Error(), "CUresult 999") {
		t.Errorf("Unlock = %v, want CUresult 999", err)
	}
}

func TestFakeInitFails(t *testing.T) {
	lib := buildFake(t, true)
	f := openFake(t, lib)
	f.setInitResult(int32(ErrorNoDevice))
	_, err := Load(lib, WithVersionFile(versionFile(t, "580.65.06")))
	if !errors.Is(err, gpu.ErrUnsupported) || !strings.Contains(err.Error(), "cuInit") {
		t.Fatalf("Load = %v, want ErrUnsupported naming cuInit", err)
	}
}

// TestMain removes the directory the fake libraries were built in.
func TestMain(m *testing.M) {
	code := m.Run()
	if fakeDir != "" {
		os.RemoveAll(fakeDir)
	}
	os.Exit(code)
}
