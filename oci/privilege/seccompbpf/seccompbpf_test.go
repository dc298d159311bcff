package seccompbpf

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// The fixtures are runc v1.5.3's compilations of containerd's default (RuntimeDefault) seccomp
// profile (runtime-default.json) as a process that loaded them reads back through
// PTRACE_SECCOMP_GET_FILTER: -a and -b are two compilations of the same profile whose bytes
// differ (runc orders its ENOSYS stub by map iteration), -plus-mount the profile with mount,
// ptrace and bpf allowed too; allow.bpf is the one-instruction "RET ALLOW".
func load(t *testing.T, name string) Program {
	t.Helper()
	if runtime.GOARCH != "amd64" {
		t.Skip("the fixtures were compiled on amd64")
	}
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	p, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The x86_64 system call numbers the tests name.
const (
	nrRead  = 0
	nrMount = 165
	nrClone = 56
	nrBPF   = 321
)

func TestCompare(t *testing.T) {
	a, b := load(t, "runtime-default-a.bpf"), load(t, "runtime-default-b.bpf")
	plus, allow := load(t, "runtime-default-plus-mount.bpf"), load(t, "allow.bpf")
	tests := []struct {
		name    string
		chain   []Program
		profile Program
		mention []string // "" for a pass
	}{
		{name: "the same compilation", chain: []Program{a}, profile: a},
		{name: "another compilation of the same profile", chain: []Program{b}, profile: a},
		{name: "stricter: the process stacked the profile on top", chain: []Program{b, a}, profile: plus},
		{name: "stricter than the profile", chain: []Program{a}, profile: plus},
		{name: "RET ALLOW (issue 19)", chain: []Program{allow}, profile: a,
			mention: []string{"x86_64 system call 103: ALLOW where the profile gives ERRNO(1)", "more"}},
		{name: "a profile allowing mount and bpf too (ptrace it allows already)", chain: []Program{plus}, profile: a,
			mention: []string{"x86_64 system call 165: ALLOW where the profile gives ERRNO(1)", "x86_64 system call 321: ALLOW", "x32 system call 165"}},
		{name: "RET ALLOW stacked on the profile is the profile", chain: []Program{a, allow}, profile: a},
		{name: "no filter at all", chain: nil, profile: a, mention: []string{"ALLOW"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			err := Compare(tc.chain, tc.profile, HostArches())
			t.Logf("compared in %v", time.Since(start))
			if len(tc.mention) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			var e *Error
			if !errors.Is(err, ErrMorePermissive) || !errors.As(err, &e) {
				t.Fatalf("Compare = %v, want an *Error wrapping ErrMorePermissive", err)
			}
			for _, m := range tc.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("%q does not mention %q", err, m)
				}
			}
		})
	}
}

// TestOutcomes: the profile decides read alone, clone by its flags (RuntimeDefault allows clone
// without namespace flags only), and the x32 and i386 tables too.
func TestOutcomes(t *testing.T) {
	a := load(t, "runtime-default-a.bpf")
	got, err := a.Outcomes(auditArchX86_64, nrRead)
	if err != nil || len(got) != 1 || got[0] != ActAllow {
		t.Errorf("read: %v %v", got, err)
	}
	got, err = a.Outcomes(auditArchX86_64, nrClone)
	if err != nil || len(got) < 2 || got[len(got)-1] != ActAllow {
		t.Errorf("clone: %v %v, want ALLOW and a refusal, by its flags", got, err)
	}
	if r := a.Run(NewData(auditArchX86_64, nrMount)); Action(uint32(r)&0xffff0000) != ActErrno {
		t.Errorf("mount: %v", r)
	}
	d := NewData(auditArchX86_64, nrClone)
	d.Words[offArgs/4] = 0x10000000 // CLONE_NEWUSER
	if r := a.Run(d); r.rank() >= ActAllow.rank() {
		t.Errorf("clone(CLONE_NEWUSER): %v", r)
	}
	if r := a.Run(NewData(0xdead, nrRead)); r.rank() >= ActAllow.rank() {
		t.Errorf("read from an unknown architecture: %v", r)
	}
}

// TestParseRefuses: what seccomp itself would refuse is not compared.
func TestParseRefuses(t *testing.T) {
	inst := func(code uint16, jt, jf uint8, k uint32) []byte {
		b := make([]byte, 8)
		binary.NativeEndian.PutUint16(b, code)
		b[2], b[3] = jt, jf
		binary.NativeEndian.PutUint32(b[4:], k)
		return b
	}
	ret := inst(0x06, 0, 0, uint32(ActAllow))
	for name, raw := range map[string][]byte{
		"empty":             nil,
		"odd length":        ret[:7],
		"no return at end":  inst(0x20, 0, 0, 0),
		"jump out":          append(inst(0x15, 5, 0, 1), ret...),
		"byte load":         append(inst(0x30, 0, 0, 0), ret...),
		"load past data":    append(inst(0x20, 0, 0, 64), ret...),
		"unaligned load":    append(inst(0x20, 0, 0, 2), ret...),
		"division by zero":  append(inst(0x34, 0, 0, 0), ret...),
		"scratch too far":   append(inst(0x02, 0, 0, 16), ret...),
		"indirect load":     append(inst(0x40, 0, 0, 0), ret...),
		"return of X (not)": inst(0x0e, 0, 0, 0),
	} {
		if _, err := Parse(raw); !errors.Is(err, ErrBadProgram) {
			t.Errorf("%s: Parse = %v, want ErrBadProgram", name, err)
		}
	}
}

// encode writes p as the kernel's struct sock_filter array.
func encode(p Program) []byte {
	var b []byte
	for _, in := range p {
		b = binary.NativeEndian.AppendUint16(b, in.Code)
		b = append(b, in.Jt, in.Jf)
		b = binary.NativeEndian.AppendUint32(b, in.K)
	}
	return b
}

// TestCompareHostilePrefixes (the issue 19 review's forgeries): the RuntimeDefault program with a
// prefix that returns ALLOW in a case the comparison once missed:
//   - a shift by X = 32, which the kernel takes modulo 32 (1 << 32 is 1, not 0);
//   - clone when its tls argument (args[4]) is 0x1337, whatever its flags: trying one argument
//     at a time at the programs' constants never combined that with CLONE_NEWUSER.
//
// Each must be refused; the same prefix that returns the profile's own answer passes.
func TestCompareHostilePrefixes(t *testing.T) {
	a := load(t, "runtime-default-a.bpf")
	allow := Inst{Code: clsRET, K: uint32(ActAllow)}
	shift := Program{
		{Code: clsLDX | modeIMM, K: 32},             // ldx #32
		{Code: clsLD | modeIMM, K: 1},               // ld #1
		{Code: clsALU | aluLSH | srcX},              // lsh x: 1 in the kernel
		{Code: clsJMP | jmpJEQ, Jt: 1, Jf: 0, K: 0}, // jeq #0 -> the profile
		allow,
	}
	clone := Program{
		{Code: clsLD | modeABS, K: 4},                             // ld arch
		{Code: clsJMP | jmpJEQ, Jt: 0, Jf: 5, K: auditArchX86_64}, // not x86_64 -> the profile
		{Code: clsLD | modeABS, K: 0},                             // ld nr
		{Code: clsJMP | jmpJEQ, Jt: 0, Jf: 3, K: nrClone},         // not clone -> the profile
		{Code: clsLD | modeABS, K: offArgs + 4*8},                 // ld args[4], low half
		{Code: clsJMP | jmpJEQ, Jt: 0, Jf: 1, K: 0x1337},          // not 0x1337 -> the profile
		allow,
	}
	// the same shape as clone's, refusing clone with tls 0x1337: stricter than the profile
	honest := slices.Clone(clone)
	honest[6] = Inst{Code: clsRET, K: uint32(ActErrno | 1)}
	for _, tc := range []struct {
		name    string
		prefix  Program
		mention string // "" for a pass
	}{
		{"a shift by X of 32", shift, "ALLOW where the profile gives"},
		{"clone with tls 0x1337", clone, "x86_64 system call 56: ALLOW where the profile gives ERRNO(1) (when args[4] == 0x1337"},
		{"clone with tls 0x1337 refused", honest, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forged, err := Parse(encode(append(slices.Clone(tc.prefix), a...)))
			if err != nil {
				t.Fatal(err)
			}
			err = Compare([]Program{forged}, a, HostArches())
			if tc.mention == "" {
				if err != nil {
					t.Fatalf("Compare = %v, want a pass", err)
				}
				return
			}
			if !errors.Is(err, ErrMorePermissive) || !strings.Contains(err.Error(), tc.mention) {
				t.Fatalf("Compare = %v, want ErrMorePermissive mentioning %q", err, tc.mention)
			}
		})
	}
	// Run follows the kernel: the shift prefix returns ALLOW for every system call
	forged, _ := Parse(encode(append(slices.Clone(shift), a...)))
	if r := forged.Run(NewData(auditArchX86_64, nrMount)); r != ActAllow {
		t.Errorf("Run of the shift prefix: %v, want ALLOW (1 << (32 & 31) == 1)", r)
	}
	// a constant shift of 32 the kernel refuses to load
	if _, err := Parse(encode(Program{{Code: clsALU | aluLSH, K: 32}, allow})); !errors.Is(err, ErrBadProgram) {
		t.Errorf("lsh #32: %v, want ErrBadProgram", err)
	}
}

// TestCompareBudget: runc's RuntimeDefault against another compilation of itself stays far
// inside maxCompareSteps, and a chain of filters that each fork on many argument bits is
// refused as too complex instead of running for hours.
func TestCompareBudget(t *testing.T) {
	a, b := load(t, "runtime-default-a.bpf"), load(t, "runtime-default-b.bpf")
	budget := maxCompareSteps
	for _, arch := range HostArches() {
		for n := uint32(0); n < MaxSyscall; n++ {
			if _, ok, err := compareCall([]Program{a}, b, arch.Audit, arch.Base+n, &budget); err != nil || !ok {
				t.Fatalf("%s %d: %v %v", arch.Name, n, ok, err)
			}
		}
	}
	used := maxCompareSteps - budget
	t.Logf("RuntimeDefault against itself: %d steps of %d", used, maxCompareSteps)
	if used > maxCompareSteps/8 {
		t.Errorf("an honest comparison uses %d of %d steps: too little headroom", used, maxCompareSteps)
	}

	// a filter that tests 15 bits of args[0] one after another, each both ways (2^15 paths, each
	// within maxSteps alone), and kills on every path: no more permissive than the profile, but
	// thousands of such explorations would take hours
	var fork Program
	fork = append(fork, Inst{Code: clsLD | modeABS | sizeW, K: 16}) // args[0], low word
	for bit := range 15 {                                           // set: skip the LDX; clear: run it; both go on
		fork = append(fork, Inst{Code: clsJMP | jmpJSET, K: 1 << bit, Jt: 1}, Inst{Code: clsLDX | modeIMM, K: uint32(bit)})
	}
	fork = append(fork, Inst{Code: clsRET, K: uint32(ActKillProcess)})
	start := time.Now()
	err := Compare([]Program{fork}, b, HostArches())
	if !errors.Is(err, ErrTooComplex) {
		t.Fatalf("Compare of a forking filter = %v, want ErrTooComplex", err)
	}
	t.Logf("forking filter refused in %v: %v", time.Since(start).Round(time.Millisecond), err)
}
