package fake_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
	"github.com/berth-dev/berth/gpu/fake/fakecuda"
)

// childEnv makes the test binary a fake CUDA process (see TestMain):
// "devroot:sockdir:status[:exit]"; with ":exit" it exits (status 0, without freeing its device
// memory) after its third check.
const childEnv = "BERTH_FAKECUDA_CHILD"

func TestMain(m *testing.M) {
	if v := os.Getenv(childEnv); v != "" {
		os.Exit(child(v))
	}
	os.Exit(m.Run())
}

// child holds 4 MiB of device memory with a known pattern and, as GPU work every 10 ms, checks
// it and writes "ok N" (N checks so far) or what went wrong to the status file.
func child(arg string) int {
	parts := strings.SplitN(arg, ":", 4)
	status := parts[2]
	exitAfter := 0
	if len(parts) == 4 && parts[3] == "exit" {
		exitAfter = 3
	}
	report := func(s string) {
		_ = os.WriteFile(status+".tmp", []byte(s), 0o644)
		_ = os.Rename(status+".tmp", status)
	}
	c, err := fakecuda.InitWith(fakecuda.Options{DevRoot: parts[0], SocketDir: parts[1]})
	if err != nil {
		report("err " + err.Error())
		return 1
	}
	buf, err := c.Malloc(0, 4<<20)
	if err != nil {
		report("err " + err.Error())
		return 1
	}
	for i := range buf {
		buf[i] = byte(i * 13)
	}
	for n := 1; ; n++ {
		err := c.Do(func() {
			for i := range buf {
				if buf[i] != byte(i*13) {
					report(fmt.Sprintf("bad byte %d", i))
					os.Exit(2)
				}
			}
		})
		if err != nil {
			report("err " + err.Error())
			return 1
		}
		report(fmt.Sprintf("ok %d", n))
		if n == exitAfter {
			return 0 // as a process that never frees its device memory
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func criuPath(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 {
		skipOrFail(t, "CRIU needs root")
	}
	p := os.Getenv("BERTH_CRIU")
	if p == "" {
		p, _ = filepath.Abs("../../_output/stack/bin/criu")
	}
	if _, err := os.Stat(p); err != nil {
		if lp, lerr := exec.LookPath("criu"); lerr == nil {
			return lp
		}
		skipOrFail(t, fmt.Sprintf("no criu (%v); set BERTH_CRIU", err))
	}
	return p
}

// progress returns the child's check count, failing the test on a reported error.
func progress(t *testing.T, status string) int {
	t.Helper()
	b, _ := os.ReadFile(status)
	s := string(b)
	if s == "" {
		return 0
	}
	n, err := strconv.Atoi(strings.TrimPrefix(s, "ok "))
	if err != nil {
		t.Fatalf("child: %s", s)
	}
	return n
}

func waitProgress(t *testing.T, status string, than int, within time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if progress(t, status) > than+2 {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

// TestCRIUMove checkpoints a fake CUDA process with a real CRIU on "node 1" and restores it on
// "node 2" (node 1's GPU root deleted, the process's GPU directory repointed to node 2's GPU):
// with the GPU steps the data survives and the listening control socket works after restore;
// skipping the GPU checkpoint makes the CRIU restore fail; skipping the GPU restore leaves the
// process blocked.
func TestCRIUMove(t *testing.T) {
	criu := criuPath(t)
	tests := []struct {
		name          string
		gpuCheckpoint bool
		gpuRestore    bool
		wantRestore   bool // CRIU restore succeeds
		wantRuns      bool // the process makes progress with intact data afterwards
	}{
		{"gpu steps", true, true, true, true},
		{"gpu checkpoint skipped", false, false, false, false},
		{"gpu restore skipped", true, false, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tmp := t.TempDir()
			n1, err := fake.Setup(filepath.Join(tmp, "node1"), spec("580.65.06", "GPU-a"))
			if err != nil {
				t.Fatal(err)
			}
			n2, err := fake.Setup(filepath.Join(tmp, "node2"), spec("580.65.06", "GPU-b"))
			if err != nil {
				t.Fatal(err)
			}
			devRoot := container(t, n1, "GPU-a")
			sd := sockDir(t)
			status := filepath.Join(tmp, "status")
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"="+devRoot+":"+sd+":"+status)
			cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			pid := cmd.Process.Pid
			killed := false
			defer func() {
				if !killed {
					cmd.Process.Kill()
					cmd.Wait()
				}
			}()
			if !waitProgress(t, status, 0, 10*time.Second) {
				t.Fatalf("child made no progress: %d", progress(t, status))
			}
			drv := &fake.Driver{Node: n2, SocketDir: sd}
			if tt.gpuCheckpoint {
				if err := drv.Lock(pid, 5*time.Second); err != nil {
					t.Fatal(err)
				}
				if err := drv.Checkpoint(pid); err != nil {
					t.Fatal(err)
				}
			}
			img := filepath.Join(tmp, "img")
			os.Mkdir(img, 0o755)
			var out bytes.Buffer
			dump := exec.Command(criu, "dump", "-t", strconv.Itoa(pid), "-D", img, "-o", "dump.log", "-v4")
			dump.Stdout, dump.Stderr = &out, &out
			if err := dump.Run(); err != nil {
				log, _ := os.ReadFile(filepath.Join(img, "dump.log"))
				t.Fatalf("criu dump: %v\n%s\n%s", err, out.String(), tail(log))
			}
			cmd.Wait()
			killed = true
			before := progress(t, status)

			// The move: node 1's GPU is gone, the container's GPU 0 is node 2's GPU-b.
			if err := os.RemoveAll(n1.Root()); err != nil {
				t.Fatal(err)
			}
			g0 := filepath.Join(devRoot, "0")
			os.Remove(g0)
			d2, _ := n2.Dir("GPU-b")
			if err := os.Symlink(d2, g0); err != nil {
				t.Fatal(err)
			}
			pidFile := filepath.Join(tmp, "restored.pid")
			restore := exec.Command(criu, "restore", "-d", "-D", img, "-o", "restore.log", "-v4", "--pidfile", pidFile)
			out.Reset()
			restore.Stdout, restore.Stderr = &out, &out
			err = restore.Run()
			if err == nil {
				defer syscall.Kill(pid, syscall.SIGKILL)
			}
			if (err == nil) != tt.wantRestore {
				log, _ := os.ReadFile(filepath.Join(img, "restore.log"))
				t.Fatalf("criu restore: %v, want success %v\n%s\n%s", err, tt.wantRestore, out.String(), tail(log))
			}
			if err != nil {
				log, _ := os.ReadFile(filepath.Join(img, "restore.log"))
				if !strings.Contains(string(log), fakecuda.MemPrefix) {
					t.Fatalf("criu restore failed, but not on the device memory file:\n%s", tail(log))
				}
				t.Logf("criu restore failed as it should: %s", lastError(log))
				return
			}
			st, err := drv.State(pid)
			if err != nil {
				t.Fatalf("state after CRIU restore (listening socket restored?): %v", err)
			}
			if st != gpu.StateCheckpointed {
				t.Fatalf("state after CRIU restore %s, want checkpointed", st)
			}
			if tt.gpuRestore {
				if err := drv.Unlock(pid); !errors.Is(err, gpu.ErrIllegalState) {
					t.Fatalf("unlock before restore: %v, want illegal state", err)
				}
				if err := drv.Restore(pid, []gpu.UUIDPair{{Old: "GPU-a", New: "GPU-b"}}); err != nil {
					t.Fatal(err)
				}
				if err := drv.Unlock(pid); err != nil {
					t.Fatal(err)
				}
				if u, err := drv.Usage(pid); err != nil || u["GPU-b"] != 4<<20 {
					t.Errorf("usage after restore %v, %v", u, err)
				}
			}
			if got := waitProgress(t, status, before, 2*time.Second); got != tt.wantRuns {
				t.Fatalf("progress after restore: %v, want %v (status %d, before %d)", got, tt.wantRuns, progress(t, status), before)
			}
			if !tt.gpuRestore {
				return
			}
			// The moved process's memory is on node 2's GPU, accounted to it; killed, it leaves
			// no orphan there.
			if u, err := n2.ProcessMemory(pid); err != nil || len(u) != 1 || u["GPU-b"] != 4<<20 {
				t.Errorf("ProcessMemory of the restored process = %v, %v; want GPU-b: 4 MiB", u, err)
			}
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			var devs []gpu.Device
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				if devs, err = n2.Devices(); err != nil || devs[0].MemoryUsed == 0 {
					break
				}
			}
			if err != nil || devs[0].MemoryUsed != 0 {
				t.Errorf("node 2 after the moved process was killed: %+v, %v; want GPU-b free", devs, err)
			}
			if f := memFiles(t, d2); len(f) != 0 {
				t.Errorf("device memory files left on node 2: %v", f)
			}
		})
	}
}

func tail(b []byte) string {
	lines := strings.Split(string(b), "\n")
	return strings.Join(lines[max(0, len(lines)-25):], "\n")
}

func lastError(b []byte) string {
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") && strings.Contains(l, fakecuda.MemPrefix) {
			return l
		}
	}
	return ""
}

// skipOrFail skips a test whose prerequisite (root, CRIU) is missing, except under CI=true,
// where every tier this machine can run must run: there it fails.
func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal("CI is set but " + why)
	}
	t.Skip(why)
}
