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
		case aluLSH, aluRSH:
			if code&srcX == 0 && in.K >= 32 {
				return errors.New("a constant shift of 32 or more")
			}
		case aluADD, aluSUB, aluMUL, aluOR, aluAND, aluNEG, aluXOR:
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

// The kinds of a value during evaluation.
const (
	known  = iota // a number
	word          // a 32-bit word of seccomp_data the program loaded (the instruction pointer or an argument half), masked
	opaque        // derived from such a word by anything but a mask: unknown
)

// val is a register or scratch value.
type val struct {
	kind uint8
	v    uint32 // known: the value
	w    int    // word: the word's index (offset/4)
	mask uint32 // word: the mask applied (0xffffffff for none)
}

// cons is one comparison a path took of a masked word with a constant: (Words[w] & mask) op k
// was taken (true) or not.
type cons struct {
	w     int
	mask  uint32
	op    uint16
	k     uint32
	taken bool
}

// String writes the constraint as C ("args[1] & 0x7e020000 != 0").
func (c cons) String() string {
	name := fmt.Sprintf("args[%d]", (c.w-offArgs/4)/2)
	if c.w < offArgs/4 {
		name = "instruction_pointer"
	}
	if (c.w-offArgs/4)%2 == 1 || c.w == 3 {
		name += ">>32"
	}
	if c.mask != 0xffffffff {
		name += fmt.Sprintf(" & %#x", c.mask)
	}
	ops := map[uint16][2]string{jmpJEQ: {"==", "!="}, jmpJGT: {">", "<="}, jmpJGE: {">=", "<"}, jmpJSET: {"has bits of", "has none of"}}[c.op]
	op := ops[1]
	if c.taken {
		op = ops[0]
	}
	return fmt.Sprintf("%s %s %#x", name, op, c.k)
}

// leaf is one path of a program to a return: the action (unknown when it returns A derived
// from an argument) and the comparisons on arguments it took.
type leaf struct {
	act     Action
	unknown bool
	cons    []cons
}

// maxSteps bounds the instructions one exploration may run, over all its paths.
const maxSteps = 1 << 20

// maxCompareSteps bounds the instructions one Compare runs over all its explorations: a chain
// of many small filters that each fork on many argument bits would otherwise cost hours of a
// restore's CPU (runc's RuntimeDefault against another compilation of itself takes about
// 86,000: TestCompareBudget).
const maxCompareSteps = 1 << 24

// explore follows every path of p for system call nr on architecture arch whose comparisons on
// arguments agree with given (a comparison given decides is not forked), and calls visit for
// each path's return; visit returning false stops it. Errors wrap ErrTooComplex.
// budget, when not nil, is decremented by every step and ends the exploration with
// ErrTooComplex at zero.
func (p Program) explore(arch, nr uint32, given []cons, budget *int, visit func(leaf) bool) error {
	type state struct {
		pc   int
		a, x val
		m    [16]val
		cons []cons
	}
	stack := []state{{cons: given}}
	steps := 0
	for len(stack) > 0 {
		s := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
	path:
		for {
			if steps++; steps > maxSteps {
				return fmt.Errorf("%w: more than %d steps for system call %d, arch %#x", ErrTooComplex, maxSteps, nr, arch)
			}
			if budget != nil {
				if *budget--; *budget < 0 {
					return fmt.Errorf("%w: the comparison ran more than %d steps in all (at system call %d, arch %#x)", ErrTooComplex, maxCompareSteps, nr, arch)
				}
			}
			in := p[s.pc]
			code := in.Code
			switch code & 0x07 {
			case clsLD, clsLDX:
				var v val
				switch code & 0xe0 {
				case modeIMM:
					v = val{kind: known, v: in.K}
				case modeMEM:
					v = s.m[in.K]
				case modeLEN:
					v = val{kind: known, v: dataLen}
				case modeABS:
					switch in.K / 4 {
					case 0:
						v = val{kind: known, v: nr}
					case 1:
						v = val{kind: known, v: arch}
					default:
						v = val{kind: word, w: int(in.K / 4), mask: 0xffffffff}
					}
				}
				if code&0x07 == clsLD {
					s.a = v
				} else {
					s.x = v
				}
			case clsST:
				s.m[in.K] = s.a
			case clsSTX:
				s.m[in.K] = s.x
			case clsALU:
				op := code & 0xf0
				operand := val{kind: known, v: in.K}
				if code&srcX != 0 {
					operand = s.x
				}
				if (op == aluDIV || op == aluMOD) && operand.kind != known {
					// a division by an X that may be 0 ends the program with 0 (KILL_THREAD)
					if !visit(leaf{act: 0, cons: s.cons}) {
						return nil
					}
					s.a = val{kind: opaque}
					break
				}
				if (op == aluDIV || op == aluMOD) && operand.v == 0 {
					if !visit(leaf{act: 0, cons: s.cons}) {
						return nil
					}
					break path
				}
				s.a = alu(op, s.a, operand)
			case clsJMP:
				op := code & 0xf0
				if op == jmpJA {
					s.pc += 1 + int(in.K)
					continue
				}
				operand := val{kind: known, v: in.K}
				if code&srcX != 0 {
					operand = s.x
				}
				t, f := s.pc+1+int(in.Jt), s.pc+1+int(in.Jf)
				if t == f {
					s.pc = t
					continue
				}
				taken, decided := decide(s.a, op, operand, s.cons)
				if decided {
					if taken {
						s.pc = t
					} else {
						s.pc = f
					}
					continue
				}
				alt := s
				alt.pc = f
				s.pc = t
				if s.a.kind == word && operand.kind == known {
					c := cons{w: s.a.w, mask: s.a.mask, op: op, k: operand.v}
					alt.cons = append(slices.Clone(s.cons), c)
					c.taken = true
					s.cons = append(slices.Clone(s.cons), c)
				}
				stack = append(stack, alt)
				continue
			case clsRET:
				l := leaf{act: Action(in.K), cons: s.cons}
				if code&0x18 == retA {
					l.act, l.unknown = Action(s.a.v), s.a.kind != known
				}
				if !visit(l) {
					return nil
				}
				break path
			case clsMISC:
				if code&0xf8 == miscTAX {
					s.x = s.a
				} else {
					s.a = s.x
				}
			}
			s.pc++
		}
	}
	return nil
}

// decide returns whether the comparison (a op b) holds, when the values or the path's
// constraints tell: both known; or a is a masked word the path compared the same way before, or
// found equal to a constant under a mask that covers a's.
func decide(a val, op uint16, b val, cs []cons) (taken, decided bool) {
	if b.kind != known {
		return false, false
	}
	switch a.kind {
	case known:
		return compare(a.v, op, b.v), true
	case word:
		for _, c := range cs {
			if c.w == a.w && c.mask == a.mask && c.op == op && c.k == b.v {
				return c.taken, true
			}
		}
		for _, c := range cs {
			if c.taken && c.op == jmpJEQ && c.w == a.w && a.mask&^c.mask == 0 {
				return compare(c.k&a.mask, op, b.v), true
			}
		}
	}
	return false, false
}

func compare(a uint32, op uint16, b uint32) bool {
	switch op {
	case jmpJEQ:
		return a == b
	case jmpJGT:
		return a > b
	case jmpJGE:
		return a >= b
	case jmpJSET:
		return a&b != 0
	}
	return false
}

// alu applies operation op to a and b as the kernel's classic BPF does (32-bit, shifts by X
// modulo 32; division by zero is the caller's): known with known is known, a word masked with a
// known constant stays a word, AND or multiplication with a known 0 is 0, anything else with
// an unknown value is opaque.
func alu(op uint16, a, b val) val {
	if op == aluNEG {
		if a.kind != known {
			return val{kind: opaque}
		}
		return val{kind: known, v: -a.v}
	}
	if (op == aluAND || op == aluMUL) && ((a.kind == known && a.v == 0) || (b.kind == known && b.v == 0)) {
		return val{kind: known, v: 0}
	}
	if op == aluAND && a.kind == word && b.kind == known {
		return val{kind: word, w: a.w, mask: a.mask & b.v}
	}
	if op == aluAND && b.kind == word && a.kind == known {
		return val{kind: word, w: b.w, mask: b.mask & a.v}
	}
	if a.kind != known || b.kind != known {
		return val{kind: opaque}
	}
	x, y := a.v, b.v
	var r uint32
	switch op {
	case aluADD:
		r = x + y
	case aluSUB:
		r = x - y
	case aluMUL:
		r = x * y
	case aluDIV:
		r = x / y
	case aluMOD:
		r = x % y
	case aluOR:
		r = x | y
	case aluAND:
		r = x & y
	case aluLSH:
		r = x << (y & 31)
	case aluRSH:
		r = x >> (y & 31)
	case aluXOR:
		r = x ^ y
	}
	return val{kind: known, v: r}
}

// Outcomes returns every action p can return for system call nr on architecture arch, whatever
// the instruction pointer and arguments (a path that depends on them is followed both ways),
// sorted from the most restrictive; a return of a value derived from an argument counts as
// ActAllow. Errors wrap ErrTooComplex.
func (p Program) Outcomes(arch, nr uint32) ([]Action, error) {
	var out []Action
	err := p.explore(arch, nr, nil, nil, func(l leaf) bool {
		a := l.act
		if l.unknown {
			a = ActAllow
		}
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
		return true
	})
	slices.SortFunc(out, func(a, b Action) int { return int(a.rank()) - int(b.rank()) })
	return out, err
}

// Run returns what p returns for d (every word known).
func (p Program) Run(d Data) Action {
	var a, x uint32
	var m [16]uint32
	pc := 0
	for {
		in := p[pc]
		code := in.Code
		switch code & 0x07 {
		case clsLD, clsLDX:
			var v uint32
			switch code & 0xe0 {
			case modeIMM:
				v = in.K
			case modeMEM:
				v = m[in.K]
			case modeLEN:
				v = dataLen
			case modeABS:
				v = d.Words[in.K/4]
			}
			if code&0x07 == clsLD {
				a = v
			} else {
				x = v
			}
		case clsST:
			m[in.K] = a
		case clsSTX:
			m[in.K] = x
		case clsALU:
			op := code & 0xf0
			b := in.K
			if code&srcX != 0 {
				b = x
			}
			if (op == aluDIV || op == aluMOD) && b == 0 {
				return 0
			}
			a = alu(op, val{kind: known, v: a}, val{kind: known, v: b}).v
		case clsJMP:
			op := code & 0xf0
			if op == jmpJA {
				pc += 1 + int(in.K)
				continue
			}
			b := in.K
			if code&srcX != 0 {
				b = x
			}
			if compare(a, op, b) {
				pc += 1 + int(in.Jt)
			} else {
				pc += 1 + int(in.Jf)
			}
			continue
		case clsRET:
			if code&0x18 == retA {
				return Action(a)
			}
			return Action(in.K)
		case clsMISC:
			if code&0xf8 == miscTAX {
				x = a
			} else {
				a = x
			}
		}
		pc++
	}
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
	// When, if not empty, says for which arguments (the chain's path to Have).
	When string
}

// String is the violation in one line: the system call, both actions and the argument
// constraints under which they differ.
func (v Violation) String() string {
	s := fmt.Sprintf("%s system call %d: %s where the profile gives %s", v.Arch, v.Nr, v.Have, v.Want)
	if v.When != "" {
		s += " (when " + v.When + ")"
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

// Error is ErrMorePermissive's text and the violations, "; "-separated (Violation.String).
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

// Compare returns nil when the filter chain (a process's filters: the kernel applies each and
// takes the most restrictive result) never lets a system call do more than profile does, for
// every system call number below MaxSyscall of every architecture in arches and every
// instruction pointer and argument, else an *Error.
//
// Both programs are explored with the arguments unknown: each comparison of an argument forks
// the path, and a path remembers the comparisons it took. For a system call the profile decides
// without its arguments, some filter of the chain must return nothing more permissive on any
// path. For one it decides by argument (runc's profiles do so for clone, socket, personality),
// each path of a filter is followed into the profile under the same comparisons, and the
// filter's action must be no more permissive than anything the profile returns there; where the
// profile compares an argument in a way the path does not decide, both ways count, so a filter
// that decides like the profile passes and one that differs on any arguments does not. A chain
// passes when one of its filters passes alone. The check is sound: it never passes a chain that
// can return more than the profile for some arguments, but may refuse one that combines several
// filters to be strict enough. Errors wrap ErrTooComplex, or are an *Error (wrapping
// ErrMorePermissive).
func Compare(chain []Program, profile Program, arches []Arch) error {
	if len(chain) == 0 {
		return &Error{Violations: []Violation{{Arch: "any", Have: ActAllow, Want: profile.Run(NewData(0, 0))}}}
	}
	e := &Error{}
	record := func(v Violation) {
		if len(e.Violations) < maxViolations {
			e.Violations = append(e.Violations, v)
		} else {
			e.More++
		}
	}
	budget := maxCompareSteps
	for _, arch := range arches {
		for n := uint32(0); n < MaxSyscall; n++ {
			v, ok, err := compareCall(chain, profile, arch.Audit, arch.Base+n, &budget)
			if err != nil {
				return err
			}
			if !ok {
				v.Arch, v.Nr = arch.Name, n
				record(v)
			}
		}
	}
	if len(e.Violations) > 0 {
		return e
	}
	return nil
}

// profileAct is a profile leaf's action: a return derived from an argument counts as the most
// restrictive (the comparison must never lean on what it cannot read).
func profileAct(l leaf) Action {
	if l.unknown {
		return ActKillProcess
	}
	return l.act
}

// filterAct is a filter leaf's action: a return derived from an argument counts as ActAllow.
func filterAct(l leaf) Action {
	if l.unknown {
		return ActAllow
	}
	return l.act
}

// compareCall compares the chain with the profile for system call nr on architecture arch, its
// explorations drawing on budget (steps left to the whole Compare); ok is
// false, with the first filter's violation, when no filter of the chain is at most as
// permissive as the profile on every path.
func compareCall(chain []Program, profile Program, arch, nr uint32, budget *int) (Violation, bool, error) {
	var want []Action
	if err := profile.explore(arch, nr, nil, budget, func(l leaf) bool {
		if a := profileAct(l); !slices.Contains(want, a) {
			want = append(want, a)
		}
		return true
	}); err != nil {
		return Violation{}, false, err
	}
	least := want[0]
	for _, a := range want {
		if a.rank() < least.rank() {
			least = a
		}
	}
	var first Violation
	for fi, f := range chain {
		var bad *Violation
		err := f.explore(arch, nr, nil, budget, func(l leaf) bool {
			have := filterAct(l)
			if have.rank() <= least.rank() {
				return true // no more than the profile's most restrictive answer
			}
			if len(want) == 1 {
				bad = &Violation{Have: have, Want: want[0], When: describe(l.cons)}
				return false
			}
			// the profile decides by argument: follow it under this path's comparisons
			perr := profile.explore(arch, nr, l.cons, budget, func(pl leaf) bool {
				if w := profileAct(pl); have.rank() > w.rank() {
					bad = &Violation{Have: have, Want: w, When: describe(append(slices.Clone(l.cons), pl.cons[len(l.cons):]...))}
					return false
				}
				return true
			})
			if perr != nil {
				bad = &Violation{Have: have, Want: least, When: perr.Error()}
			}
			return bad == nil
		})
		if err != nil {
			return Violation{}, false, err
		}
		if bad == nil {
			return Violation{}, true, nil
		}
		if fi == 0 {
			first = *bad
		}
	}
	return first, false, nil
}

// describe writes a path's comparisons ("args[0] & 0x7e020000 has none of 0x7e020000 and ...").
func describe(cs []cons) string {
	var parts []string
	for _, c := range cs {
		parts = append(parts, c.String())
	}
	return strings.Join(parts, " and ")
}
