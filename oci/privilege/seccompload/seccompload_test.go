package seccompload

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci/privilege/seccompbpf"
)

// envChild makes the test binary run Child, as berth-shim-helper seccomp-load does.
const envChild = "BERTH_SECCOMP_LOAD_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(envChild) == "1" {
		os.Exit(Child(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// need skips (fails under CI=true) without root, which PTRACE_SECCOMP_GET_FILTER needs.
func need(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true: the seccomp compile test needs root")
		}
		t.Skip("needs root (CAP_SYS_ADMIN for PTRACE_SECCOMP_GET_FILTER)")
	}
}

func profile(t *testing.T) *specs.LinuxSeccomp {
	t.Helper()
	b, err := os.ReadFile("testdata/runtime-default.json")
	if err != nil {
		t.Fatal(err)
	}
	var p specs.LinuxSeccomp
	if err := json.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	return &p
}

// TestCompile: containerd's default profile, compiled twice by runc's code in a child: two
// programs that may differ in their bytes and decide every system call alike; a filter that
// allows everything is refused against it.
func TestCompile(t *testing.T) {
	need(t)
	t.Setenv(envChild, "1")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var progs []seccompbpf.Program
	for range 2 {
		raw, err := Compile(ctx, profile(t), exe)
		if err != nil {
			t.Fatalf("Compile: %v (make test builds with -tags seccomp; go test needs it too)", err)
		}
		p, err := seccompbpf.Parse(raw)
		if err != nil {
			t.Fatal(err)
		}
		progs = append(progs, p)
	}
	arches := seccompbpf.HostArches()
	if err := seccompbpf.Compare(progs[:1], progs[1], arches); err != nil {
		t.Errorf("two compilations of one profile: %v", err)
	}
	allow, _ := seccompbpf.Parse([]byte{0x06, 0, 0, 0, 0, 0, 0xff, 0x7f})
	if err := seccompbpf.Compare([]seccompbpf.Program{allow}, progs[0], arches); !errors.Is(err, seccompbpf.ErrMorePermissive) {
		t.Errorf("RET ALLOW against the default profile: %v", err)
	}
}

// TestCompileRefusesABadProfile: a profile runc refuses fails the compilation, naming runc's reason.
func TestCompileRefusesABadProfile(t *testing.T) {
	need(t)
	t.Setenv(envChild, "1")
	exe, _ := os.Executable()
	bad := &specs.LinuxSeccomp{DefaultAction: "SCMP_ACT_NONSENSE"}
	_, err := Compile(context.Background(), bad, exe)
	if !errors.Is(err, ErrCompile) || !strings.Contains(err.Error(), "runc refuses the profile") {
		t.Fatalf("Compile of a bad profile: %v", err)
	}
}
