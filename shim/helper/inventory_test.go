package helper

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/fake"
)

// serveInventoryForTest is the test binary as `berth-shim-helper gpu-inventory`, serving the fake
// GPU node at $BERTH_HELPER_FAKE_ROOT (fake.Open: it fails while the node is not set up).
// $BERTH_HELPER_IDLE is its idle limit (a duration; none when unset); with
// $BERTH_HELPER_CRASH set it writes to standard error and exits 3 on its first request; with
// $BERTH_HELPER_HANG set it reads a request and never answers (NVML hung on a lost GPU); with
// $BERTH_HELPER_ANSWER (a file) it answers every request with that file's line.
func serveInventoryForTest() int {
	root := os.Getenv("BERTH_HELPER_FAKE_ROOT")
	if os.Getenv("BERTH_HELPER_HANG") != "" {
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		time.Sleep(time.Hour)
		return 0
	}
	if f := os.Getenv("BERTH_HELPER_ANSWER"); f != "" {
		answer, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			if _, err := os.Stdout.Write(answer); err != nil {
				return 2
			}
		}
		return 0
	}
	if os.Getenv("BERTH_HELPER_CRASH") != "" {
		_, _ = io.ReadAll(io.LimitReader(os.Stdin, 1))
		fmt.Fprintln(os.Stderr, "inventory helper crashed on purpose")
		return 3
	}
	idle, _ := time.ParseDuration(os.Getenv("BERTH_HELPER_IDLE"))
	return ServeInventory(os.Stdin, os.Stdout, func() (gpu.Inventory, error) { return openFake(root) }, idle)
}

// openFake opens the fake node at root as an inventory (nil, not a typed nil, on error).
func openFake(root string) (gpu.Inventory, error) {
	n, err := fake.Open(root)
	if err != nil {
		return nil, err
	}
	return n, nil
}

// sameJSON reports whether a and b encode to the same JSON: what crosses the pipe (an empty
// slice comes back nil where the field is omitempty).
func sameJSON(a, b any) bool {
	ja, erra := json.Marshal(a)
	jb, errb := json.Marshal(b)
	return erra == nil && errb == nil && bytes.Equal(ja, jb)
}

// fakeNodeSpec is a node of two NVLinked fake GPUs.
func fakeNodeSpec() fake.NodeSpec {
	return fake.NodeSpec{Driver: "580.65.06", CUDA: "12.8",
		GPUs: []fake.GPUSpec{
			{UUID: "GPU-aaaa", Name: "Fake H200", MemoryBytes: 1 << 30, Arch: "hopper", ComputeCapability: "9.0"},
			{UUID: "GPU-bbbb", Name: "Fake H200", MemoryBytes: 1 << 30},
		},
		Links: [][]string{{"X", "NV4"}, {"NV4", "X"}}}
}

// selfInventory runs this test binary as the gpu-inventory helper for the fake node at root,
// with the extra environment entries env.
func selfInventory(t *testing.T, root string, env ...string) *Inventory {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	inv := &Inventory{Path: exe, Start: func(cmd *exec.Cmd) (func() error, error) {
		cmd.Env = append(append(os.Environ(), "BERTH_HELPER_TEST=inventory", "BERTH_HELPER_FAKE_ROOT="+root), env...)
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		return cmd.Wait, nil
	}}
	t.Cleanup(func() { _ = inv.Close() })
	return inv
}

// helperPID is the PID of the running helper (0 when none).
func (i *Inventory) helperPID() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.p == nil {
		return 0
	}
	return i.p.cmd.Process.Pid
}

// TestInventoryRunsHelper reads a fake GPU node through a gpu-inventory helper process: every
// answer equals the node's own (as JSON encodes it), errors keep their message and
// gpu.ErrUnsupported, one process answers every call, a failed open is retried by the next call,
// and a call whose helper died goes to a new one.
func TestInventoryRunsHelper(t *testing.T) {
	root := filepath.Join(t.TempDir(), "gpus")
	inv := selfInventory(t, root)

	_, err := inv.Open()
	if err == nil || !strings.Contains(err.Error(), root) {
		t.Fatalf("Open before the node exists: %v; want the fake's error naming %s", err, root)
	}
	first := inv.helperPID()
	node, err := fake.Setup(root, fakeNodeSpec())
	if err != nil {
		t.Fatal(err)
	}
	if got, err := inv.Open(); err != nil || got != gpu.Inventory(inv) {
		t.Fatalf("Open after setup: %v %v; want the failed open retried", got, err)
	}
	if inv.helperPID() != first || first == 0 {
		t.Fatalf("helper %d after the retried open, was %d; want the same process", inv.helperPID(), first)
	}

	wantDevs, _ := node.Devices()
	if devs, err := inv.Devices(); err != nil || len(devs) != 2 || !sameJSON(devs, wantDevs) {
		t.Fatalf("Devices: %+v %v\nwant %+v", devs, err, wantDevs)
	}
	wantV, _ := node.Versions()
	if v, err := inv.Versions(); err != nil || v != wantV || v.DriverMajor != 580 {
		t.Fatalf("Versions: %+v %v; want %+v", v, err, wantV)
	}
	wantT, _ := node.Topology()
	if topo, err := inv.Topology(); err != nil || wantT == nil || !reflect.DeepEqual(topo, wantT) {
		t.Fatalf("Topology: %v %v\nwant %v", topo, err, wantT)
	}
	if use, err := inv.ProcessMemory(os.Getpid()); err != nil || use == nil || len(use) != 0 {
		t.Fatalf("ProcessMemory of a process without device memory: %v %v; want an empty map", use, err)
	}
	if err := node.SetProcessMemoryUnavailable(true); err != nil {
		t.Fatal(err)
	}
	_, wantErr := node.ProcessMemory(os.Getpid())
	if _, err := inv.ProcessMemory(os.Getpid()); !errors.Is(err, gpu.ErrUnsupported) || wantErr == nil || err.Error() != wantErr.Error() {
		t.Fatalf("ProcessMemory where it is unavailable: %v; want %v", err, wantErr)
	}
	if inv.helperPID() != first {
		t.Fatalf("helper %d, was %d: one process should answer every call", inv.helperPID(), first)
	}

	// a helper that died: the call goes to a new one
	inv.mu.Lock()
	_ = inv.p.cmd.Process.Kill()
	exited := inv.p.exited
	inv.mu.Unlock()
	<-exited
	if devs, err := inv.Devices(); err != nil || len(devs) != 2 || inv.helperPID() == first || inv.helperPID() == 0 {
		t.Fatalf("Devices after the helper died: %v %v (helper %d, was %d); want a new helper's answer", devs, err, inv.helperPID(), first)
	}
	if err := inv.Close(); err != nil || inv.helperPID() != 0 {
		t.Fatalf("Close: %v, helper %d", err, inv.helperPID())
	}
}

// TestInventoryHelperIdle: a helper left idle exits by itself, and the next call starts another.
func TestInventoryHelperIdle(t *testing.T) {
	root := t.TempDir()
	if _, err := fake.Setup(root, fakeNodeSpec()); err != nil {
		t.Fatal(err)
	}
	inv := selfInventory(t, root, "BERTH_HELPER_IDLE=200ms")
	if _, err := inv.Devices(); err != nil {
		t.Fatal(err)
	}
	first := inv.helperPID()
	inv.mu.Lock()
	exited := inv.p.exited
	inv.mu.Unlock()
	select {
	case <-exited:
	case <-time.After(20 * time.Second):
		t.Fatal("the idle helper did not exit")
	}
	if v, err := inv.Versions(); err != nil || v.Driver != "580.65.06" || inv.helperPID() == first {
		t.Fatalf("Versions after the idle exit: %+v %v (helper %d, was %d); want a new helper's answer", v, err, inv.helperPID(), first)
	}
}

// TestInventoryHelperCrashes: a helper that dies on every request: the call is tried on a second
// one, then fails naming the command, the op and the helper's standard error.
func TestInventoryHelperCrashes(t *testing.T) {
	inv := selfInventory(t, t.TempDir(), "BERTH_HELPER_CRASH=1")
	_, err := inv.Devices()
	if err == nil || !strings.Contains(err.Error(), InventoryCommand+" "+InvDevices) || !strings.Contains(err.Error(), "crashed on purpose") {
		t.Fatalf("Devices from a crashing helper: %v; want an error naming %s %s and its standard error", err, InventoryCommand, InvDevices)
	}
	if inv.helperPID() != 0 {
		t.Fatalf("helper %d kept after it crashed", inv.helperPID())
	}
}

// TestInventoryHelperHangs: a helper that takes a request and never answers is killed at the
// call's deadline, the call fails naming the op and the deadline, and the next call starts a new
// helper (killed in turn).
func TestInventoryHelperHangs(t *testing.T) {
	inv := selfInventory(t, t.TempDir(), "BERTH_HELPER_HANG=1")
	inv.Deadline = 300 * time.Millisecond
	var cmds []*exec.Cmd
	var reaped []chan struct{}
	start := inv.Start
	inv.Start = func(cmd *exec.Cmd) (func() error, error) {
		wait, err := start(cmd)
		if err != nil {
			return nil, err
		}
		done := make(chan struct{})
		cmds, reaped = append(cmds, cmd), append(reaped, done)
		return func() error { defer close(done); return wait() }, nil
	}
	for n := 1; n <= 2; n++ {
		errc := make(chan error, 1)
		go func() { _, err := inv.ProcessMemory(os.Getpid()); errc <- err }()
		var err error
		select {
		case err = <-errc:
		case <-time.After(20 * time.Second):
			t.Fatalf("call %d: ProcessMemory of a hung helper has not returned after 20 s", n)
		}
		if err == nil || !strings.Contains(err.Error(), InventoryCommand+" "+InvProcessMemory) || !strings.Contains(err.Error(), "300ms") {
			t.Fatalf("call %d: ProcessMemory of a hung helper: %v; want an error naming %s and the deadline", n, err, InvProcessMemory)
		}
		if !errors.Is(err, gpu.ErrTimeout) { // the shim's errdefs table makes it Unavailable
			t.Fatalf("call %d: ProcessMemory of a hung helper: %v; want gpu.ErrTimeout", n, err)
		}
		if len(cmds) != n {
			t.Fatalf("call %d: %d helpers started; want one per call", n, len(cmds))
		}
		select {
		case <-reaped[n-1]:
		case <-time.After(10 * time.Second):
			t.Fatalf("call %d: the hung helper (pid %d) was not killed", n, cmds[n-1].Process.Pid)
		}
		if ws, ok := cmds[n-1].ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
			t.Errorf("call %d: helper ended %v; want killed", n, cmds[n-1].ProcessState)
		}
		if inv.helperPID() != 0 {
			t.Fatalf("call %d: helper %d kept after its deadline", n, inv.helperPID())
		}
	}
}

// TestInventoryAnswerWithoutField: each answer of testdata/inventory-answers sent by a helper
// for an op: one without that op's field (or with null) is a protocol error, never "nothing"
// (an empty map of process memory would pass a restore's free-memory check); an empty list or
// map sent as such is an answer.
func TestInventoryAnswerWithoutField(t *testing.T) {
	for _, tc := range []struct {
		answer, op string
		wantErr    bool
	}{
		{"empty.json", InvProcessMemory, true},
		{"memory-null.json", InvProcessMemory, true},
		{"memory-empty.json", InvProcessMemory, false},
		{"memory.json", InvProcessMemory, false},
		{"empty.json", InvDevices, true},
		{"devices-empty.json", InvDevices, false},
		{"empty.json", InvVersions, true},
		{"versions.json", InvVersions, false},
		{"memory.json", InvDevices, true},
		{"empty.json", InvTopology, false},
		{"empty.json", InvOpen, false},
	} {
		t.Run(tc.op+"/"+tc.answer, func(t *testing.T) {
			file, err := filepath.Abs(filepath.Join("testdata", "inventory-answers", tc.answer))
			if err != nil {
				t.Fatal(err)
			}
			inv := selfInventory(t, t.TempDir(), "BERTH_HELPER_ANSWER="+file)
			var got any
			switch tc.op {
			case InvProcessMemory:
				got, err = inv.ProcessMemory(os.Getpid())
			case InvDevices:
				got, err = inv.Devices()
			case InvVersions:
				got, err = inv.Versions()
			case InvTopology:
				got, err = inv.Topology()
			case InvOpen:
				got, err = inv.Open()
			}
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), "without its field") || !strings.Contains(err.Error(), tc.op) {
					t.Fatalf("%s answered with %s: %v, %v; want a protocol error naming the op", tc.op, tc.answer, got, err)
				}
			} else if err != nil {
				t.Fatalf("%s answered with %s: %v", tc.op, tc.answer, err)
			}
		})
	}
}

// TestServeInventory: requests on one stream get one answer each, an unknown op is refused by
// name, and the stream's end ends the helper with status 0; unreadable input with 2.
func TestServeInventory(t *testing.T) {
	root := t.TempDir()
	if _, err := fake.Setup(root, fakeNodeSpec()); err != nil {
		t.Fatal(err)
	}
	open := func() (gpu.Inventory, error) { return openFake(root) }
	var out bytes.Buffer
	in := `{"op":"open"}` + "\n" + `{"op":"versions"}` + `{"op":"flush"}` + "\n" + `{"op":"devices"}` +
		fmt.Sprintf(`{"op":"process-memory","pid":%d}`, os.Getpid())
	if rc := ServeInventory(strings.NewReader(in), &out, open, 0); rc != 0 {
		t.Fatalf("exit %d", rc)
	}
	if !strings.Contains(out.String(), `"memory":{}`) {
		t.Errorf("process-memory of a process without device memory: %s; want the field, empty", out.String())
	}
	dec := json.NewDecoder(&out)
	var as []InventoryAnswer
	for {
		var a InventoryAnswer
		if err := dec.Decode(&a); err != nil {
			break
		}
		as = append(as, a)
	}
	if len(as) != 5 || as[0].Error != nil || as[1].Versions == nil || as[1].Versions.Driver != "580.65.06" ||
		as[2].Error == nil || !strings.Contains(as[2].Error.Message, `"flush"`) || len(as[3].Devices) != 2 || as[4].Memory == nil {
		t.Fatalf("answers: %+v", as)
	}
	if rc := ServeInventory(strings.NewReader("not json"), &bytes.Buffer{}, open, 0); rc != 2 {
		t.Errorf("unreadable request: exit %d, want 2", rc)
	}
}
