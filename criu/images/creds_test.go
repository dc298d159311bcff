package images

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/berth-dev/berth/criu/internal/criutest"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/creds"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

var updateImages = flag.Bool("update-images", false,
	"TestReadProcessesLive: write its dumps' pstree and core images and want.json into testdata/images")

// credsHelperEnv makes the test binary run credsHelper instead of the tests (TestMain).
const credsHelperEnv = "BERTH_CRIU_CREDS_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(credsHelperEnv) == "1" {
		credsHelper()
		return
	}
	os.Exit(m.Run())
}

// credsHelper is the process TestReadProcessesLive dumps: a multi-threaded Go program in which
// one thread ("berth-odd") has its own fsuid (1234) and a seccomp filter (allow everything),
// which no other thread has. It prints that thread's tid and sleeps.
func credsHelper() {
	runtime.LockOSThread() // keep the main goroutine on the main thread, the odd one off it
	tids := make(chan int)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread keeps its credentials to itself
		name := []byte("berth-odd\x00")
		_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&name[0])), 0, 0, 0)
		_, _, _ = unix.RawSyscall(unix.SYS_SETFSUID, 1234, 0, 0)
		allow := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW}}
		prog := unix.SockFprog{Len: 1, Filter: &allow[0]}
		if err := unix.Prctl(unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&prog)), 0, 0); err != nil {
			fmt.Println("seccomp:", err)
			os.Exit(1)
		}
		tids <- unix.Gettid()
		for {
			time.Sleep(time.Hour)
		}
	}()
	fmt.Println(<-tids)
	for {
		time.Sleep(time.Hour)
	}
}

// readWant reads dir/want.json.
func readWant(t *testing.T, dir string) []privilege.Process {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "want.json"))
	if err != nil {
		t.Fatal(err)
	}
	var want []privilege.Process
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	return want
}

// sameProcesses reports the differences between got and want, thread by thread.
func sameProcesses(t *testing.T, got, want []privilege.Process) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%d threads, want %d", len(got), len(want))
	}
	for i := range min(len(got), len(want)) {
		if !reflect.DeepEqual(got[i], want[i]) {
			g, _ := json.Marshal(got[i])
			w, _ := json.Marshal(want[i])
			t.Errorf("thread %d:\n got %s\nwant %s", i, g, w)
		}
	}
}

// grantExactly is a spec that grants what p holds and no more.
func grantExactly(p privilege.Process) *specs.Spec {
	return &specs.Spec{Process: &specs.Process{
		User:            specs.User{UID: p.UID, GID: p.GID, AdditionalGids: p.Groups},
		NoNewPrivileges: p.NoNewPrivs,
		Capabilities: &specs.LinuxCapabilities{
			Effective: p.CapEff.Names(), Permitted: p.CapPrm.Names(), Inheritable: p.CapInh.Names(),
			Bounding: p.CapBnd.Names(), Ambient: p.CapAmb.Names(),
		},
	}}
}

// The fixtures in testdata/images are pstree.img and core-*.img from CRIU 4.2.1 dumps by
// TestReadProcessesLive -update-images, with want.json taken from /proc before the dump:
//   - root: `sleep` as root with every capability this machine has;
//   - reduced: the credsHelper under setpriv (no_new_privs, a few capabilities, an ambient
//     one, SECBIT_NO_SETUID_FIXUP, groups 10 and 20), one thread with fsuid 1234 and a filter;
//     its seccomp.img was written by hand (one allow-all filter, what that thread loaded) when
//     the reader began to refuse a filter-mode thread without its filter, an image CRIU cannot
//     restore: the update then kept only pstree.img and the cores (it keeps seccomp.img now).
func TestReadProcessesFixtures(t *testing.T) {
	for _, tc := range []struct {
		dir string
		// refused edits a spec granting exactly the first thread's credentials; the check
		// must then name these fields.
		refused func(*specs.Spec)
		fields  []string
	}{
		{dir: "root", refused: func(s *specs.Spec) {
			s.Process.Capabilities.Effective = slices.DeleteFunc(s.Process.Capabilities.Effective, func(c string) bool { return c == "CAP_SYS_ADMIN" })
		}, fields: []string{"cap_eff"}},
		{dir: "reduced", refused: func(s *specs.Spec) {
			s.Process.Capabilities.Ambient = nil
			s.Linux = &specs.Linux{Seccomp: &specs.LinuxSeccomp{DefaultAction: specs.ActErrno}}
		}, fields: []string{"cap_amb", "seccomp"}},
	} {
		t.Run(tc.dir, func(t *testing.T) {
			dir := filepath.Join("testdata", "images", tc.dir)
			got, err := ReadProcesses(dir)
			if err != nil {
				t.Fatal(err)
			}
			sameProcesses(t, got, readWant(t, dir))

			// Every thread of a fixture holds what its main thread holds, or less, apart from
			// fsuid: a spec granting the main thread's credentials (and any fsuid, being uid 0)
			// passes, and one granting less is refused, field by field.
			if err := privilege.CheckProcesses(got, grantExactly(got[0])); err != nil {
				t.Errorf("spec granting exactly: %v", err)
			}
			s := grantExactly(got[0])
			tc.refused(s)
			err = privilege.CheckProcesses(got, s)
			var perr *privilege.Error
			if !errors.As(err, &perr) {
				t.Fatalf("narrower spec: got %v, want a *privilege.Error", err)
			}
			for _, v := range perr.Violations {
				if !slices.Contains(tc.fields, v.Field) {
					t.Errorf("unexpected violation %s", v)
				}
			}
			t.Log(err)
		})
	}
}

// img builds an image file in CRIU's layout: IMG_COMMON, the magic, then each entry's
// size and bytes. An entry is a proto.Message or raw []byte.
func img(t *testing.T, magicName string, entries ...any) []byte {
	t.Helper()
	b := binary.LittleEndian.AppendUint32(nil, uint32(imgMagic.ByName["IMG_COMMON"]))
	b = binary.LittleEndian.AppendUint32(b, uint32(imgMagic.ByName[magicName]))
	for _, e := range entries {
		raw, ok := e.([]byte)
		if !ok {
			var err error
			if raw, err = proto.Marshal(e.(proto.Message)); err != nil {
				t.Fatal(err)
			}
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(raw)))
		b = append(b, raw...)
	}
	return b
}

// credsOf returns creds as CRIU 4.2 writes them for a root thread holding caps, with
// no_new_privs and cap_amb (fields go-criu v7 does not know) appended as raw fields.
func credsOf(caps uint64, nnp uint64, amb []uint32) *creds.CredsEntry {
	w := []uint32{uint32(caps), uint32(caps >> 32)}
	c := &creds.CredsEntry{
		Uid: proto.Uint32(0), Gid: proto.Uint32(0), Euid: proto.Uint32(0), Egid: proto.Uint32(0),
		Suid: proto.Uint32(0), Sgid: proto.Uint32(0), Fsuid: proto.Uint32(0), Fsgid: proto.Uint32(0),
		CapInh: []uint32{0, 0}, CapPrm: w, CapEff: w, CapBnd: w, Secbits: proto.Uint32(0),
	}
	var raw []byte
	if nnp != 0 {
		raw = protowire.AppendTag(raw, 18, protowire.VarintType)
		raw = protowire.AppendVarint(raw, nnp)
	}
	for _, a := range amb {
		raw = protowire.AppendTag(raw, 19, protowire.VarintType)
		raw = protowire.AppendVarint(raw, uint64(a))
	}
	c.ProtoReflect().SetUnknown(raw)
	return c
}

// core is a core entry for a thread with credentials c; main threads carry a task core.
func core(comm string, main bool, state uint32, c *creds.CredsEntry) *criucore.CoreEntry {
	e := &criucore.CoreEntry{Mtype: criucore.CoreEntry_X86_64.Enum()}
	if main {
		e.Tc = &criucore.TaskCoreEntry{TaskState: proto.Uint32(state), ExitCode: proto.Uint32(0),
			Personality: proto.Uint32(0), Flags: proto.Uint32(0), BlkSigset: proto.Uint64(0), Comm: proto.String(comm)}
	}
	if state != taskStateDead {
		e.ThreadCore = &criucore.ThreadCoreEntry{FutexRla: proto.Uint64(0), FutexRlaLen: proto.Uint32(0), Creds: c}
	}
	return e
}

func tree(entries ...*pstree.PstreeEntry) []any {
	out := make([]any, len(entries))
	for i, e := range entries {
		out[i] = e
	}
	return out
}

func ps(pid uint32, threads ...uint32) *pstree.PstreeEntry {
	return &pstree.PstreeEntry{Pid: proto.Uint32(pid), Ppid: proto.Uint32(0), Pgid: proto.Uint32(pid),
		Sid: proto.Uint32(pid), Threads: threads}
}

const (
	capSysAdmin = 1 << 21
	// secbitNoSetuidFixup is SECBIT_NO_SETUID_FIXUP (linux/securebits.h).
	secbitNoSetuidFixup = 1 << 2
)

func TestReadProcessesSynthetic(t *testing.T) {
	// A process (1) with a second thread (2) whose seccomp mode is strict and that holds
	// CAP_SYS_ADMIN in an ambient set; a zombie (3) whose core has no thread core; a process
	// (4) from before per-thread seccomp (the mode in its task core).
	files := map[string][]byte{
		"pstree.img": img(t, "PSTREE", tree(ps(1, 1, 2), ps(3, 3), ps(4, 4))...),
		"core-1.img": img(t, "CORE", core("main", true, 1, credsOf(0x3, 1, nil))),
		"core-2.img": img(t, "CORE", func() *criucore.CoreEntry {
			e := core("", false, 1, credsOf(0x3|capSysAdmin, 0, []uint32{capSysAdmin, 0}))
			e.ThreadCore.SeccompMode = criucore.SeccompMode_strict.Enum()
			return e
		}()),
		"core-3.img": img(t, "CORE", core("zombie", true, taskStateDead, nil)),
		"core-4.img": img(t, "CORE", func() *criucore.CoreEntry {
			e := core("old", true, 1, credsOf(0, 0, nil))
			e.Tc.OldSeccompMode = criucore.SeccompMode_filter.Enum()
			return e
		}()),
		"seccomp.img": img(t, "SECCOMP", &seccomp.SeccompEntry{SeccompFilters: []*seccomp.SeccompFilter{{Filter: allowAll}}}),
	}
	dir := t.TempDir()
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := ReadProcesses(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []privilege.Process{
		{PID: 1, TID: 1, Comm: "main", CapEff: 3, CapPrm: 3, CapBnd: 3, NoNewPrivs: true},
		{PID: 1, TID: 2, Comm: "main", CapEff: 3 | capSysAdmin, CapPrm: 3 | capSysAdmin, CapBnd: 3 | capSysAdmin,
			CapAmb: capSysAdmin, Seccomp: privilege.SeccompStrict},
		{PID: 4, TID: 4, Comm: "old", Seccomp: privilege.SeccompFilter},
	}
	sameProcesses(t, got, want)
}

func TestReadProcessesErrors(t *testing.T) {
	good := func(t *testing.T) map[string][]byte {
		return map[string][]byte{
			"pstree.img": img(t, "PSTREE", tree(ps(1, 1, 2))...),
			"core-1.img": img(t, "CORE", core("main", true, 1, credsOf(3, 0, nil))),
			"core-2.img": img(t, "CORE", core("main", false, 1, credsOf(3, 0, nil))),
		}
	}
	for _, tc := range []struct {
		name    string
		edit    func(t *testing.T, dir string, files map[string][]byte)
		is      error
		mention string
	}{
		{name: "no pstree", is: fs.ErrNotExist, mention: "pstree.img",
			edit: func(t *testing.T, dir string, f map[string][]byte) { delete(f, "pstree.img") }},
		{name: "a thread without its core", is: fs.ErrNotExist, mention: "core-2.img",
			edit: func(t *testing.T, dir string, f map[string][]byte) { delete(f, "core-2.img") }},
		{name: "pstree a symbolic link", is: ErrBadImage, mention: "a symbolic link",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				delete(f, "pstree.img")
				if err := os.Symlink("/dev/zero", filepath.Join(dir, "pstree.img")); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "core a FIFO", is: ErrBadImage, mention: "core-1.img: malformed criu image: not a regular file",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				delete(f, "core-1.img")
				if err := unix.Mkfifo(filepath.Join(dir, "core-1.img"), 0o644); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "core over its limit", is: ErrBadImage, mention: "over the limit of 1048576",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["core-2.img"] = append(f["core-2.img"], make([]byte, maxCoreImage)...)
			}},
		{name: "wrong magic", is: ErrBadImage, mention: "core-1.img: malformed criu image: magic",
			edit: func(t *testing.T, dir string, f map[string][]byte) { f["core-1.img"] = img(t, "PSTREE", ps(1, 1)) }},
		{name: "empty file", is: ErrBadImage, mention: "shorter than a magic",
			edit: func(t *testing.T, dir string, f map[string][]byte) { f["pstree.img"] = nil }},
		{name: "entry larger than the file", is: ErrBadImage, mention: "entry of 4294967295 bytes",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["pstree.img"] = append(img(t, "PSTREE"), 0xff, 0xff, 0xff, 0xff, 1, 2)
			}},
		{name: "stray bytes", is: ErrBadImage, mention: "pstree.img: malformed criu image: 2 stray bytes",
			edit: func(t *testing.T, dir string, f map[string][]byte) { f["pstree.img"] = append(f["pstree.img"], 0, 0) }},
		{name: "two cores in one file", is: ErrBadImage, mention: "more than 1 entries",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				c := core("main", false, 1, credsOf(3, 0, nil))
				f["core-2.img"] = img(t, "CORE", c, c)
			}},
		{name: "not protobuf", is: ErrBadImage, mention: "entry 0 at offset 8",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["core-1.img"] = img(t, "CORE", []byte{0xff, 0xff})
			}},
		{name: "thread listed twice", is: ErrBadImage, mention: "thread 2 listed twice",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["pstree.img"] = img(t, "PSTREE", tree(ps(1, 1, 2), ps(2, 2))...)
			}},
		{name: "too many threads", is: ErrBadImage, mention: "pstree.img: malformed criu image: more than 65536 threads",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				threads := []uint32{1}
				for tid := range uint32(maxThreads) {
					threads = append(threads, tid+2)
				}
				f["pstree.img"] = img(t, "PSTREE", ps(1, threads...))
			}},
		{name: "process not among its threads", is: ErrBadImage, mention: "process 1 has threads [2], without itself",
			edit: func(t *testing.T, dir string, f map[string][]byte) { f["pstree.img"] = img(t, "PSTREE", ps(1, 2)) }},
		{name: "no credentials", is: ErrBadImage, mention: "thread 2 has no credentials",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["core-2.img"] = img(t, "CORE", core("main", false, 1, nil))
			}},
		{name: "main thread without task core", is: ErrBadImage, mention: "main thread without task core",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				f["core-1.img"] = img(t, "CORE", core("main", false, 1, credsOf(3, 0, nil)))
			}},
		{name: "a capability past 63", is: ErrBadImage, mention: "thread 2 cap_bnd: capability bits 0x1 in word 2",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				c := credsOf(3, 0, nil)
				c.CapBnd = []uint32{3, 0, 1}
				f["core-2.img"] = img(t, "CORE", core("main", false, 1, c))
			}},
		{name: "a creds field from a newer CRIU", is: ErrBadImage, mention: "thread 1 creds: creds field 20 (wire type 0) not understood",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				c := credsOf(3, 1, []uint32{1, 0})
				c.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(c.ProtoReflect().GetUnknown(), 20, protowire.VarintType), 1))
				f["core-1.img"] = img(t, "CORE", core("main", true, 1, c))
			}},
		{name: "no_new_privs of the wrong wire type", is: ErrBadImage, mention: "thread 1 creds: creds field 18 (wire type 2)",
			edit: func(t *testing.T, dir string, f map[string][]byte) {
				c := credsOf(3, 0, nil)
				c.ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 18, protowire.BytesType), []byte("x")))
				f["core-1.img"] = img(t, "CORE", core("main", true, 1, c))
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			files := good(t)
			tc.edit(t, dir, files)
			for name, b := range files {
				if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			_, err := ReadProcesses(dir)
			if !errors.Is(err, tc.is) {
				t.Fatalf("got %v, want %v", err, tc.is)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("error %q does not mention %q", err, tc.mention)
			}
			t.Log(err)
		})
	}
}

// procStatus reads the credentials of thread tid of pid from /proc, the kernel's own account,
// for comparison with what CRIU recorded. Securebits and the LSM profile are not in status:
// the caller supplies them.
func procStatus(t *testing.T, pid, tid int) privilege.Process {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/task/%d", pid, tid)
	comm, err := os.ReadFile(dir + "/comm")
	if err != nil {
		t.Fatal(err)
	}
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		t.Fatal(err)
	}
	p := privilege.Process{PID: pid, TID: tid, Comm: strings.TrimSpace(string(comm))}
	ids := func(v string) []uint32 {
		var out []uint32
		for _, f := range strings.Fields(v) {
			n, err := strconv.ParseUint(f, 10, 32)
			if err != nil {
				t.Fatalf("%s: %q: %v", dir, v, err)
			}
			out = append(out, uint32(n))
		}
		return out
	}
	caps := func(v string) privilege.CapSet {
		n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		if err != nil {
			t.Fatalf("%s: %q: %v", dir, v, err)
		}
		return privilege.CapSet(n)
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "Uid":
			u := ids(v)
			p.UID, p.EUID, p.SUID, p.FSUID = u[0], u[1], u[2], u[3]
		case "Gid":
			g := ids(v)
			p.GID, p.EGID, p.SGID, p.FSGID = g[0], g[1], g[2], g[3]
		case "Groups":
			p.Groups = ids(v)
		case "CapInh":
			p.CapInh = caps(v)
		case "CapPrm":
			p.CapPrm = caps(v)
		case "CapEff":
			p.CapEff = caps(v)
		case "CapBnd":
			p.CapBnd = caps(v)
		case "CapAmb":
			p.CapAmb = caps(v)
		case "NoNewPrivs":
			p.NoNewPrivs = strings.TrimSpace(v) == "1"
		case "Seccomp":
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			p.Seccomp = privilege.SeccompMode(n)
		}
	}
	return p
}

// TestReadProcessesLive dumps real processes with the real CRIU (root only) and checks that
// ReadProcesses returns, thread by thread, the credentials /proc showed before the dump.
// With -update-images it stores the dumps' pstree and core images as fixtures.
func TestReadProcessesLive(t *testing.T) {
	criu := criutest.Path(t)
	if os.Geteuid() != 0 {
		criutest.SkipOrFail(t, "criu dump needs root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		criutest.SkipOrFail(t, "setpriv (util-linux) not found")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		argv       []string
		securebits uint32
		// odd says the child prints the tid of its thread with its own fsuid and filter.
		odd bool
	}{
		{name: "root", argv: []string{"sleep", "1000"}},
		{name: "reduced", argv: []string{setpriv, "--no-new-privs",
			"--bounding-set", "-all,+chown,+kill,+net_bind_service,+setuid",
			"--inh-caps", "-all,+chown,+net_bind_service", "--ambient-caps", "+net_bind_service",
			"--securebits", "+no_setuid_fixup", "--groups", "10,20",
			"--", self, "-test.run=^$"}, securebits: secbitNoSetuidFixup, odd: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.Command(tc.argv[0], tc.argv[1:]...)
			cmd.Env = append(os.Environ(), credsHelperEnv+"=1")
			cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			pid := cmd.Process.Pid
			t.Cleanup(func() {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
			})
			oddTID := 0
			if tc.odd {
				line, rerr := bufio.NewReader(out).ReadString('\n')
				if rerr != nil {
					t.Fatalf("helper's thread id: %v", rerr)
				}
				var err error
				if oddTID, err = strconv.Atoi(strings.TrimSpace(line)); err != nil {
					t.Fatalf("helper said %q: %v", line, err)
				}
			}
			time.Sleep(200 * time.Millisecond) // let the Go runtime start its threads

			// What the kernel says, main thread first.
			entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
			if err != nil {
				t.Fatal(err)
			}
			tids := []int{pid}
			for _, e := range entries {
				if tid, _ := strconv.Atoi(e.Name()); tid != pid {
					tids = append(tids, tid)
				}
			}
			var want []privilege.Process
			for _, tid := range tids {
				p := procStatus(t, pid, tid)
				p.Securebits = tc.securebits
				want = append(want, p)
			}
			if tc.odd && !slices.Contains(tids, oddTID) {
				t.Fatalf("thread %d not among %v", oddTID, tids)
			}

			dir := t.TempDir()
			dump := exec.CommandContext(ctx, criu, "dump", "-t", strconv.Itoa(pid), "-D", dir, "--shell-job", "-o", "dump.log")
			if out, err := dump.CombinedOutput(); err != nil {
				log, _ := os.ReadFile(filepath.Join(dir, "dump.log"))
				t.Fatalf("criu dump: %v\n%s\ndump.log tail:\n%s", err, out, criutest.Tail(log, 2000))
			}
			got, err := ReadProcesses(dir)
			if err != nil {
				t.Fatal(err)
			}
			// CRIU lists threads in its own order: compare by tid, main thread first.
			if len(got) > 0 {
				slices.SortFunc(got[1:], func(a, b privilege.Process) int { return a.TID - b.TID })
			}
			slices.SortFunc(want[1:], func(a, b privilege.Process) int { return a.TID - b.TID })
			sameProcesses(t, got, want)
			for _, p := range got {
				t.Logf("%s: uid %d fsuid %d cap_eff %s cap_amb %s nnp %v seccomp %s securebits %#x groups %v",
					p, p.UID, p.FSUID, p.CapEff, p.CapAmb, p.NoNewPrivs, p.Seccomp, p.Securebits, p.Groups)
				if tc.odd && p.TID == p.PID && p.TID == oddTID {
					t.Errorf("the odd thread is the main thread")
				}
				if odd := p.TID == oddTID; tc.odd && odd != (p.FSUID == 1234 && p.Seccomp == privilege.SeccompFilter) {
					t.Errorf("%s: fsuid %d seccomp %s; only thread %d has fsuid 1234 and a filter", p, p.FSUID, p.Seccomp, oddTID)
				}
			}

			if *updateImages {
				storeFixture(t, dir, filepath.Join("testdata", "images", tc.name), want)
			}
		})
	}
}

// storeFixture copies pstree.img, core-*.img and seccomp.img (when there is one) from dir into
// fixture, with want.json.
func storeFixture(t *testing.T, dir, fixture string, want []privilege.Process) {
	t.Helper()
	if err := os.RemoveAll(fixture); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(fixture, 0o755); err != nil {
		t.Fatal(err)
	}
	names, err := filepath.Glob(filepath.Join(dir, "core-*.img"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, seccompImage)); err == nil {
		names = append(names, filepath.Join(dir, seccompImage))
	}
	for _, src := range append(names, filepath.Join(dir, pstreeImage)) {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(fixture, filepath.Base(src)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// want in ReadProcesses's order (pstree's: main thread first, then CRIU's thread order).
	got, err := ReadProcesses(fixture)
	if err != nil {
		t.Fatal(err)
	}
	byTID := map[int]privilege.Process{}
	for _, p := range want {
		byTID[p.TID] = p
	}
	ordered := make([]privilege.Process, 0, len(got))
	for _, p := range got {
		ordered = append(ordered, byTID[p.TID])
	}
	b, err := json.MarshalIndent(ordered, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fixture, "want.json"), append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s", fixture)
}

// TestReadProcessesSeccompTSync reads two CRIU 4.2.1 dumps of testdata/images/seccomp-tsync.c, a
// program that installs an allow-all seccomp filter and then starts three threads:
//   - seccomp-tsync: every thread has the main thread's filter, so CRIU keeps the chain on the
//     main thread only, marked SECCOMP_FILTER_FLAG_TSYNC, and records the other threads as
//     without seccomp; the restore gives it to all. Every thread must read as filtered (a reader
//     that missed this refused every legitimate restore of a multi-threaded process into a pod
//     with a seccomp profile).
//   - seccomp-mixed: run with an argument, it starts one thread before the filter; that thread
//     has none (/proc said "Seccomp: 0"), CRIU records each thread's own filter, and that thread
//     must read as disabled.
func TestReadProcessesSeccompTSync(t *testing.T) {
	for _, tc := range []struct {
		dir  string
		want []privilege.SeccompMode // by thread, in ReadProcesses' order (main thread first)
	}{
		{"seccomp-tsync", []privilege.SeccompMode{privilege.SeccompFilter, privilege.SeccompFilter, privilege.SeccompFilter, privilege.SeccompFilter}},
		{"seccomp-mixed", []privilege.SeccompMode{privilege.SeccompFilter, privilege.SeccompDisabled, privilege.SeccompFilter, privilege.SeccompFilter, privilege.SeccompFilter}},
	} {
		t.Run(tc.dir, func(t *testing.T) {
			got := seccompModes(t, filepath.Join("testdata", "images", tc.dir))
			if !slices.Equal(got, tc.want) {
				t.Fatalf("seccomp by thread = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestCredsTail decodes the two creds fields go-criu v7 does not know the way the protobuf
// runtime does: cap_amb one per field or packed, the last no_new_privs winning, and refuses
// anything else, including data cut short.
func TestCredsTail(t *testing.T) {
	tag := func(b []byte, num protowire.Number, typ protowire.Type) []byte {
		return protowire.AppendTag(b, num, typ)
	}
	var unpacked, packed, twice, cut []byte
	unpacked = protowire.AppendVarint(tag(unpacked, 18, protowire.VarintType), 1)
	unpacked = protowire.AppendVarint(tag(unpacked, 19, protowire.VarintType), 12)
	unpacked = protowire.AppendVarint(tag(unpacked, 19, protowire.VarintType), 21)
	packed = protowire.AppendBytes(tag(packed, 19, protowire.BytesType), protowire.AppendVarint(protowire.AppendVarint(nil, 12), 21))
	twice = protowire.AppendVarint(tag(twice, 18, protowire.VarintType), 1)
	twice = protowire.AppendVarint(tag(twice, 18, protowire.VarintType), 0)
	cut = tag(cut, 19, protowire.BytesType)
	cut = append(cut, 5, 1)
	for _, tc := range []struct {
		name string
		in   []byte
		nnp  bool
		amb  []uint32
		err  string
	}{
		{name: "none"},
		{name: "unpacked", in: unpacked, nnp: true, amb: []uint32{12, 21}},
		{name: "packed", in: packed, amb: []uint32{12, 21}},
		{name: "last no_new_privs wins", in: twice},
		{name: "cut short", in: cut, err: "unexpected EOF"},
		{name: "cap_amb as a fixed32", in: protowire.AppendFixed32(tag(nil, 19, protowire.Fixed32Type), 1), err: "creds field 19 (wire type 5) not understood"},
	} {
		nnp, amb, err := credsTail(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v; want an error containing %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || nnp != tc.nnp || !slices.Equal(amb, tc.amb) {
			t.Errorf("%s: nnp %v amb %v err %v; want %v %v", tc.name, nnp, amb, err, tc.nnp, tc.amb)
		}
	}
}

// allowAll is the one-instruction filter RET ALLOW; strictish one that returns ERRNO(1).
var (
	allowAll = []byte{0x06, 0, 0, 0, 0, 0, 0xff, 0x7f}
	denyAll  = []byte{0x06, 0, 0, 0, 1, 0, 0x05, 0x00}
)

// TestSeccompAsCRIURestoresIt (issue 19 review): what the reader says each thread runs is what
// CRIU's restore installs, not what the image appears to state: the main thread's
// old_seccomp_mode and old_seccomp_filter win over its thread core's fields, a filter-mode
// thread without a filter index gets filter 0, and a chain installed with TSYNC reaches the
// threads left without seccomp. Each case was a forged image whose processes' checks passed
// while CRIU restored RET ALLOW, or no seccomp at all.
func TestSeccompAsCRIURestoresIt(t *testing.T) {
	filters := &seccomp.SeccompEntry{SeccompFilters: []*seccomp.SeccompFilter{{Filter: allowAll}, {Filter: denyAll}}}
	filterMode := criucore.SeccompMode_filter.Enum()
	tests := []struct {
		name      string
		main, thr func(e *criucore.CoreEntry)
		wantModes []privilege.SeccompMode
		wantChain [][]byte // the first filter of each filtered thread's chain
	}{
		{name: "old_seccomp_mode disabled beside a filter mode",
			main: func(e *criucore.CoreEntry) {
				e.ThreadCore.SeccompMode, e.ThreadCore.SeccompFilter = filterMode, proto.Uint32(1)
				e.Tc.OldSeccompMode = criucore.SeccompMode_disabled.Enum()
			},
			wantModes: []privilege.SeccompMode{privilege.SeccompDisabled, privilege.SeccompDisabled}},
		{name: "old_seccomp_filter beside the thread's filter",
			main: func(e *criucore.CoreEntry) {
				e.ThreadCore.SeccompMode, e.ThreadCore.SeccompFilter = filterMode, proto.Uint32(1)
				e.Tc.OldSeccompFilter = proto.Uint32(0)
			},
			// the old filter, installed with TSYNC: both threads run RET ALLOW
			wantModes: []privilege.SeccompMode{privilege.SeccompFilter, privilege.SeccompFilter},
			wantChain: [][]byte{allowAll, allowAll}},
		{name: "a filter-mode thread without a filter index",
			main: func(e *criucore.CoreEntry) {
				e.ThreadCore.SeccompMode, e.ThreadCore.SeccompFilter = filterMode, proto.Uint32(1)
			},
			thr:       func(e *criucore.CoreEntry) { e.ThreadCore.SeccompMode = filterMode },
			wantModes: []privilege.SeccompMode{privilege.SeccompFilter, privilege.SeccompFilter},
			wantChain: [][]byte{denyAll, allowAll}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := core("main", true, 1, credsOf(0, 0, nil))
			th := core("", false, 1, credsOf(0, 0, nil))
			tc.main(m)
			if tc.thr != nil {
				tc.thr(th)
			}
			dir := t.TempDir()
			for name, b := range map[string][]byte{
				"pstree.img": img(t, "PSTREE", tree(ps(1, 1, 2))...), "core-1.img": img(t, "CORE", m),
				"core-2.img": img(t, "CORE", th), "seccomp.img": img(t, "SECCOMP", filters),
			} {
				if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			modes := seccompModes(t, dir)
			if !slices.Equal(modes, tc.wantModes) {
				t.Errorf("modes %v, want %v", modes, tc.wantModes)
			}
			chains, err := ReadSeccompChains(dir)
			if err != nil {
				t.Fatal(err)
			}
			if len(chains) != len(tc.wantChain) {
				t.Fatalf("%d chains, want %d", len(chains), len(tc.wantChain))
			}
			for i, c := range chains {
				if !slices.Equal(c.Filters[0], tc.wantChain[i]) {
					t.Errorf("thread %d: first filter %x, want %x", c.TID, c.Filters[0], tc.wantChain[i])
				}
			}
		})
	}
}

// TestReadSeccompChains: the filter chains of the seccomp-tsync and seccomp-mixed dumps (see
// TestReadProcessesSeccompTSync): every filtered thread has one filter, the allow-all program
// (one instruction, RET ALLOW); a thread that shares its main thread's synchronised chain gets
// that chain; the thread started before the filter has none and is not listed.
func TestReadSeccompChains(t *testing.T) {
	allow := allowAll
	for _, tc := range []struct {
		dir     string
		threads int
	}{{"seccomp-tsync", 4}, {"seccomp-mixed", 4}} {
		t.Run(tc.dir, func(t *testing.T) {
			chains, err := ReadSeccompChains(filepath.Join("testdata", "images", tc.dir))
			if err != nil {
				t.Fatal(err)
			}
			if len(chains) != tc.threads {
				t.Fatalf("%d chains, want %d (one per filtered thread): %+v", len(chains), tc.threads, chains)
			}
			for _, c := range chains {
				if len(c.Filters) != 1 || !slices.Equal(c.Filters[0], allow) {
					t.Errorf("thread %d: chain %x, want the one allow-all filter", c.TID, c.Filters)
				}
			}
		})
	}
}

// seccompModes is the seccomp mode of every thread ReadProcesses reads from dir, in its order.
func seccompModes(t *testing.T, dir string) []privilege.SeccompMode {
	t.Helper()
	ps, err := ReadProcesses(dir)
	if err != nil {
		t.Fatal(err)
	}
	var modes []privilege.SeccompMode
	for _, p := range ps {
		modes = append(modes, p.Seccomp)
	}
	return modes
}
