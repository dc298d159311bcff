// Package seccompbpf compares seccomp filters by what they decide: whether the filters a
// checkpointed process carries (CRIU's seccomp.img, classic BPF as the kernel keeps it) ever let
// a system call through that the destination's profile, compiled by runc, would not. CRIU restores
// a process's own filters, never the destination's, so the restore is safe only when they are at
// least as strict; two compilations of one profile by runc differ in their bytes (runc orders
// its ENOSYS stub by map iteration), so the comparison is by decision, not by digest.
//
// What belongs here: decoding classic BPF as seccomp accepts it, evaluating a program on
// seccomp_data with the system call's arguments left unknown, and Compare. What does not: reading
// CRIU images (criu/images) or compiling a profile (a process that loads it: shim/helper/serve).
// Pure Go, no cgo, no I/O.
package seccompbpf

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
)

// Errors.
var (
	// ErrBadProgram: bytes that are not a classic BPF program seccomp would accept (a length not
	// a multiple of 8, an instruction seccomp refuses, a jump out of the program, a path that
	// runs off its end).
	ErrBadProgram = errors.New("not a seccomp BPF program")
	// ErrTooComplex: evaluating the program with unknown arguments took more than maxSteps
	// steps; the comparison refuses rather than guesses.
	ErrTooComplex = errors.New("seccomp filter too complex to compare")
	// ErrMorePermissive: a filter lets a system call do more than the profile's filter would.
	ErrMorePermissive = errors.New("seccomp filter more permissive than the destination's profile")
	// ErrCompile: the destination's profile could not be compiled into the filter runc would
	// install (oci/privilege/seccompload), so nothing can be compared with it.
	ErrCompile = errors.New("compile the seccomp profile")
)

// Inst is one classic BPF instruction (struct sock_filter).
type Inst struct {
	Code   uint16
	Jt, Jf uint8
	K      uint32
}

// Program is a decoded seccomp filter.
type Program []Inst

// MaxInstructions is the kernel's BPF_MAXINSNS: no seccomp filter is longer.
const MaxInstructions = 4096

// Parse decodes raw, a struct sock_filter array in this machine's byte order (what
// PTRACE_SECCOMP_GET_FILTER returns and CRIU stores), and checks that every instruction is one
// seccomp accepts and every jump lands inside the program. Errors wrap ErrBadProgram.
func Parse(raw []byte) (Program, error) {
	if len(raw) == 0 || len(raw)%8 != 0 || len(raw)/8 > MaxInstructions {
		return nil, fmt.Errorf("%w: %d bytes", ErrBadProgram, len(raw))
	}
	p := make(Program, len(raw)/8)
	for i := range p {
		b := raw[i*8:]
		p[i] = Inst{Code: binary.NativeEndian.Uint16(b), Jt: b[2], Jf: b[3], K: binary.NativeEndian.Uint32(b[4:])}
	}
	for pc, in := range p {
		if err := check(p, pc, in); err != nil {
			return nil, fmt.Errorf("%w: instruction %d (code %#04x): %s", ErrBadProgram, pc, in.Code, err)
		}
	}
	return p, nil
}

// Classic BPF opcodes (linux/bpf_common.h, linux/filter.h).
const (
	clsLD, clsLDX, clsST, clsSTX, clsALU, clsJMP, clsRET, clsMISC = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07

	sizeW                              = 0x00
	modeIMM, modeABS, modeMEM, modeLEN = 0x00, 0x20, 0x60, 0x80

	aluADD, aluSUB, aluMUL, aluDIV, aluOR, aluAND, aluLSH, aluRSH, aluNEG, aluMOD, aluXOR = 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0
	jmpJA, jmpJEQ, jmpJGT, jmpJGE, jmpJSET                                                = 0x00, 0x10, 0x20, 0x30, 0x40
	srcX                                                                                  = 0x08
	retK, retA                                                                            = 0x00, 0x10
	miscTAX, miscTXA                                                                      = 0x00, 0x80

	// dataLen is sizeof(struct seccomp_data): nr, arch, instruction_pointer, args[6].
	dataLen = 64
	// offArgs is the offset of args[0] in struct seccomp_data.
	offArgs = 16
)

// check refuses what the kernel's seccomp_check_filter refuses.
func check(p Program, pc int, in Inst) error {
	code := in.Code
	switch code & 0x07 {
	case clsLD, clsLDX:
		switch code & 0xe0 {
		case modeIMM:
		case modeMEM:
			if in.K >= 16 {
				return errors.New("scratch slot out of range")
			}
		case modeLEN:
		case modeABS:
			if code&0x07 != clsLD || in.K >= dataLen || in.K%4 != 0 {
				return errors.New("not an aligned 32-bit load inside seccomp_data")
			}
		default:
			return errors.New("addressing mode seccomp refuses")
		}
		if code&0x18 != sizeW {
			return errors.New("not a 32-bit load")
		}
	case clsST, clsSTX:
		if in.K >= 16 {
			return errors.New("scratch slot out of range")
		}
	case clsALU:
		switch code & 0xf0 {
		case aluADD, aluSUB, aluMUL, aluOR, aluAND, aluLSH, aluRSH, aluNEG, aluXOR:
		case aluDIV, aluMOD:
			if code&srcX == 0 && in.K == 0 {
				return errors.New("division by the constant 0")
			}
		default:
			return errors.New("ALU operation seccomp refuses")
		}
	case clsJMP:
		switch code & 0xf0 {
		case jmpJA:
			if uint64(pc)+1+uint64(in.K) >= uint64(len(p)) {
				return errors.New("jump out of the program")
			}
		case jmpJEQ, jmpJGT, jmpJGE, jmpJSET:
			if pc+1+int(in.Jt) >= len(p) || pc+1+int(in.Jf) >= len(p) {
				return errors.New("jump out of the program")
			}
		default:
			return errors.New("jump seccomp refuses")
		}
	case clsRET:
		if r := code & 0x18; r != retK && r != retA {
			return errors.New("return of something but a constant or A")
		}
	case clsMISC:
		if m := code & 0xf8; m != miscTAX && m != miscTXA {
			return errors.New("misc operation seccomp refuses")
		}
	}
	if pc == len(p)-1 && code&0x07 != clsRET {
		return errors.New("the program ends without a return")
	}
	return nil
}

// Action is a seccomp return value: SECCOMP_RET_ACTION_FULL in the high 16 bits, data below.
type Action uint32

// The actions, from the most restrictive (the kernel takes the lowest, as a signed 32-bit
// value, of every filter's result).
const (
	ActKillProcess Action = 0x80000000
	ActKillThread  Action = 0x00000000
	ActTrap        Action = 0x00030000
	ActErrno       Action = 0x00050000
	ActUserNotif   Action = 0x7fc00000
	ActTrace       Action = 0x7ff00000
	ActLog         Action = 0x7ffc0000
	ActAllow       Action = 0x7fff0000
)

// rank orders actions by what they let through: higher is more permissive. Data bits (an
// errno's value) do not count.
func (a Action) rank() int32 { return int32(uint32(a) & 0xffff0000) }

// String names the action as seccomp(2) does, with its data for ERRNO and TRACE.
func (a Action) String() string {
	switch Action(uint32(a) & 0xffff0000) {
	case ActKillProcess:
		return "KILL_PROCESS"
	case ActKillThread:
		return "KILL_THREAD"
	case ActTrap:
		return "TRAP"
	case ActErrno:
		return fmt.Sprintf("ERRNO(%d)", uint32(a)&0xffff)
	case ActUserNotif:
		return "USER_NOTIF"
	case ActTrace:
		return fmt.Sprintf("TRACE(%d)", uint32(a)&0xffff)
	case ActLog:
		return "LOG"
	case ActAllow:
		return "ALLOW"
	}
	return fmt.Sprintf("%#08x", uint32(a))
}

// Data is struct seccomp_data as a program reads it: the system call number, the audit
// architecture, and the instruction pointer and six arguments as 32-bit halves (low half first,
// as a little-endian machine lays them out; Words indexes them by offset/4).
type Data struct {
	Words [dataLen / 4]uint32
}

// NewData returns the data of system call nr on architecture arch with every argument 0.
func NewData(arch, nr uint32) Data {
	var d Data
	d.Words[0], d.Words[1] = nr, arch
	return d
}

// val is a register or scratch value: known, or derived from the instruction pointer or an
// argument (unknown).
type val struct {
	known bool
	v     uint32
}

// maxSteps bounds the instructions one evaluation with unknown arguments may run, over all its
// paths.
const maxSteps = 1 << 20

// Outcomes returns every action p can return for system call nr on architecture arch, whatever
// the instruction pointer and arguments (a path that depends on them is followed both ways),
// sorted from the most restrictive; RetA of an unknown value counts as ActAllow. Errors wrap
// ErrTooComplex.
func (p Program) Outcomes(arch, nr uint32) ([]Action, error) {
	type state struct {
		pc   int
		a, x val
		m    [16]val
	}
	var out []Action
	add := func(a Action) {
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	known := NewData(arch, nr)
	stack := []state{{}}
	steps := 0
	for len(stack) > 0 {
		s := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for {
			if steps++; steps > maxSteps {
				return nil, fmt.Errorf("%w: more than %d steps for system call %d, arch %#x", ErrTooComplex, maxSteps, nr, arch)
			}
			in := p[s.pc]
			next, fork, ret, done := step(in, s.pc, &s.a, &s.x, &s.m, func(off uint32) val {
				if off < offArgs && off != 8 && off != 12 {
					return val{true, known.Words[off/4]}
				}
				return val{} // the instruction pointer and the arguments: unknown
			})
			if done {
				if ret.known {
					add(Action(ret.v))
				} else {
					add(ActAllow)
				}
				break
			}
			if fork >= 0 {
				alt := s
				alt.pc = fork
				stack = append(stack, alt)
			}
			s.pc = next
		}
	}
	slices.SortFunc(out, func(a, b Action) int { return int(a.rank()) - int(b.rank()) })
	return out, nil
}

// Run returns what p returns for d.
func (p Program) Run(d Data) Action {
	var a, x val
	var m [16]val
	pc := 0
	for {
		next, _, ret, done := step(p[pc], pc, &a, &x, &m, func(off uint32) val { return val{true, d.Words[off/4]} })
		if done {
			return Action(ret.v)
		}
		pc = next
	}
}

// step runs instruction in at pc. It returns the next pc, and a second one (fork >= 0) when a
// jump depends on an unknown value and both ways must be followed; or, for a return, the value
// and done.
func step(in Inst, pc int, a, x *val, m *[16]val, load func(off uint32) val) (next, fork int, ret val, done bool) {
	code := in.Code
	next, fork = pc+1, -1
	switch code & 0x07 {
	case clsLD, clsLDX:
		var v val
		switch code & 0xe0 {
		case modeIMM:
			v = val{true, in.K}
		case modeMEM:
			v = m[in.K]
		case modeLEN:
			v = val{true, dataLen}
		case modeABS:
			v = load(in.K)
		}
		if code&0x07 == clsLD {
			*a = v
		} else {
			*x = v
		}
	case clsST:
		m[in.K] = *a
	case clsSTX:
		m[in.K] = *x
	case clsALU:
		operand := val{true, in.K}
		if code&srcX != 0 {
			operand = *x
		}
		*a = alu(code&0xf0, *a, operand)
	case clsJMP:
		op := code & 0xf0
		if op == jmpJA {
			return pc + 1 + int(in.K), -1, val{}, false
		}
		operand := val{true, in.K}
		if code&srcX != 0 {
			operand = *x
		}
		t, f := pc+1+int(in.Jt), pc+1+int(in.Jf)
		if !a.known || !operand.known {
			if t == f {
				return t, -1, val{}, false
			}
			return t, f, val{}, false
		}
		var cond bool
		switch op {
		case jmpJEQ:
			cond = a.v == operand.v
		case jmpJGT:
			cond = a.v > operand.v
		case jmpJGE:
			cond = a.v >= operand.v
		case jmpJSET:
			cond = a.v&operand.v != 0
		}
		if cond {
			return t, -1, val{}, false
		}
		return f, -1, val{}, false
	case clsRET:
		if code&0x18 == retA {
			return 0, -1, *a, true
		}
		return 0, -1, val{true, in.K}, true
	case clsMISC:
		if code&0xf8 == miscTAX {
			*x = *a
		} else {
			*a = *x
		}
	}
	return next, fork, val{}, false
}

// alu applies operation op to a and b (unknown if either is, but AND with a known 0 and
// multiplication by a known 0, which are 0 whatever the other is).
func alu(op uint16, a, b val) val {
	if op == aluNEG {
		if !a.known {
			return val{}
		}
		return val{true, -a.v}
	}
	if (op == aluAND || op == aluMUL) && ((a.known && a.v == 0) || (b.known && b.v == 0)) {
		return val{true, 0}
	}
	if !a.known || !b.known {
		return val{}
	}
	switch op {
	case aluADD:
		return val{true, a.v + b.v}
	case aluSUB:
		return val{true, a.v - b.v}
	case aluMUL:
		return val{true, a.v * b.v}
	case aluDIV:
		if b.v == 0 {
			return val{true, 0} // the kernel's classic BPF returns 0 for the program; never reached: check refuses a constant 0
		}
		return val{true, a.v / b.v}
	case aluMOD:
		if b.v == 0 {
			return val{true, 0}
		}
		return val{true, a.v % b.v}
	case aluOR:
		return val{true, a.v | b.v}
	case aluAND:
		return val{true, a.v & b.v}
	case aluLSH:
		if b.v >= 32 {
			return val{true, 0}
		}
		return val{true, a.v << b.v}
	case aluRSH:
		if b.v >= 32 {
			return val{true, 0}
		}
		return val{true, a.v >> b.v}
	case aluXOR:
		return val{true, a.v ^ b.v}
	}
	return val{}
}

// constants returns the constants p compares against or masks with (jump and ALU operands),
// at most limit of them.
func (p Program) constants(limit int) []uint32 {
	var out []uint32
	for _, in := range p {
		c := in.Code & 0x07
		if (c == clsJMP && in.Code&0xf0 != jmpJA || c == clsALU) && in.Code&srcX == 0 && !slices.Contains(out, in.K) {
			out = append(out, in.K)
			if len(out) == limit {
				break
			}
		}
	}
	return out
}

// Arch is an audit architecture and the system call numbers a check covers on it.
type Arch struct {
	// Name is the architecture's name for messages ("x86_64").
	Name string
	// Audit is its AUDIT_ARCH_* value (seccomp_data.arch).
	Audit uint32
	// Base is added to every system call number (x32's __X32_SYSCALL_BIT).
	Base uint32
}

// The audit architectures (linux/audit.h).
const (
	auditArchX86_64  = 0xc000003e
	auditArchI386    = 0x40000003
	auditArchAARCH64 = 0xc00000b7
	auditArchARM     = 0x40000028
	x32SyscallBit    = 0x40000000
)

// HostArches are the architectures whose system calls a process on this machine can make:
// x86_64, x32 and i386 on amd64; aarch64 and arm on arm64.
func HostArches() []Arch {
	switch runtime.GOARCH {
	case "arm64":
		return []Arch{{"aarch64", auditArchAARCH64, 0}, {"arm", auditArchARM, 0}}
	default:
		return []Arch{{"x86_64", auditArchX86_64, 0}, {"x32", auditArchX86_64, x32SyscallBit}, {"i386", auditArchI386, 0}}
	}
}

// MaxSyscall bounds the system call numbers Compare checks (each architecture's table is
// shorter: x86_64 has fewer than 500).
const MaxSyscall = 1024

// Violation is one system call a filter chain lets do more than the profile.
type Violation struct {
	// Arch names the architecture, Nr the system call number (without x32's bit).
	Arch string
	Nr   uint32
	// Have is the most permissive action the chain can return for it; Want the profile's.
	Have, Want Action
	// ByArgument reports that the two differ only for some arguments (Args is one such set).
	ByArgument bool
	Args       [6]uint64
}

func (v Violation) String() string {
	s := fmt.Sprintf("%s system call %d: %s where the profile gives %s", v.Arch, v.Nr, v.Have, v.Want)
	if v.ByArgument {
		s += fmt.Sprintf(" (arguments %#x)", v.Args)
	}
	return s
}

// Error lists the violations Compare found (at most maxViolations of them, and how many more).
type Error struct {
	Violations []Violation
	More       int
}

// maxViolations bounds the violations an Error lists.
const maxViolations = 5

func (e *Error) Error() string {
	var parts []string
	for _, v := range e.Violations {
		parts = append(parts, v.String())
	}
	s := ErrMorePermissive.Error() + ": " + strings.Join(parts, "; ")
	if e.More > 0 {
		s += fmt.Sprintf("; and %d more", e.More)
	}
	return s
}

// Unwrap returns ErrMorePermissive.
func (e *Error) Unwrap() error { return ErrMorePermissive }

// maxConstants bounds the constants Compare tries as arguments.
const maxConstants = 512

// Compare returns nil when the filter chain (a process's filters: the kernel applies each and
// takes the most restrictive result) never lets a system call do more than profile does, for
// every system call number below MaxSyscall of every architecture in arches, else an *Error.
//
// For a system call the profile decides without looking at its arguments (one outcome), the
// check is exact: some filter of the chain must never return anything more permissive, whatever
// the arguments. For one it decides by argument (runc's profiles do so for a few, such as clone
// and personality), each argument's low and high half is tried, one at a time, at every constant
// either program compares against, one below and one above it, the others 0: a chain that
// decides those system calls differently only for argument values neither program names is not
// caught. Errors wrap ErrTooComplex, or are an *Error (wrapping ErrMorePermissive).
func Compare(chain []Program, profile Program, arches []Arch) error {
	if len(chain) == 0 {
		return &Error{Violations: []Violation{{Arch: "any", Have: ActAllow, Want: profile.Run(NewData(0, 0))}}}
	}
	var consts []uint32
	for _, p := range append([]Program{profile}, chain...) {
		for _, c := range p.constants(maxConstants) {
			if len(consts) < maxConstants && !slices.Contains(consts, c) {
				consts = append(consts, c)
			}
		}
	}
	e := &Error{}
	record := func(v Violation) {
		if len(e.Violations) < maxViolations {
			e.Violations = append(e.Violations, v)
		} else {
			e.More++
		}
	}
	for _, arch := range arches {
		for n := uint32(0); n < MaxSyscall; n++ {
			nr := arch.Base + n
			want, err := profile.Outcomes(arch.Audit, nr)
			if err != nil {
				return err
			}
			if len(want) == 1 {
				// the chain returns the most restrictive of its filters' results: at most the
				// least permissive of their most permissive outcomes
				best := ActAllow
				for _, f := range chain {
					have, err := f.Outcomes(arch.Audit, nr)
					if err != nil {
						return err
					}
					if top := have[len(have)-1]; top.rank() < best.rank() {
						best = top
					}
				}
				if best.rank() > want[0].rank() {
					record(Violation{Arch: arch.Name, Nr: n, Have: best, Want: want[0]})
				}
				continue
			}
			if v, ok := compareByArgument(chain, profile, arch, nr, consts); !ok {
				v.Nr = n
				record(v)
			}
		}
	}
	if len(e.Violations) > 0 {
		return e
	}
	return nil
}

// compareByArgument tries system call nr with each argument half set, one at a time, to every
// constant and its neighbours; ok is false, with the first violation, when the chain's result is
// more permissive than the profile's for one of them.
func compareByArgument(chain []Program, profile Program, arch Arch, nr uint32, consts []uint32) (Violation, bool) {
	try := func(d Data) (Violation, bool) {
		want := profile.Run(d)
		have := ActAllow
		for _, f := range chain {
			if r := f.Run(d); r.rank() < have.rank() {
				have = r
			}
		}
		if have.rank() <= want.rank() {
			return Violation{}, true
		}
		v := Violation{Arch: arch.Name, Have: have, Want: want, ByArgument: true}
		for i := range 6 {
			v.Args[i] = uint64(d.Words[(offArgs/4)+2*i]) | uint64(d.Words[(offArgs/4)+2*i+1])<<32
		}
		return v, false
	}
	base := NewData(arch.Audit, nr)
	if v, ok := try(base); !ok {
		return v, false
	}
	for w := offArgs / 4; w < dataLen/4; w++ {
		for _, c := range consts {
			for _, x := range []uint32{c, c - 1, c + 1} {
				d := base
				d.Words[w] = x
				if v, ok := try(d); !ok {
					return v, false
				}
			}
		}
	}
	return Violation{}, true
}
