package fingerprint

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"sync"
)

// ErrNoVersion is returned (wrapped) by the probes ExecVersion builds when the command ran but
// the first line of its output holds no version token.
var ErrNoVersion = errors.New("no version in command output")

// ErrNoCPU is returned (wrapped) by Collect when the cpuinfo file holds no processor block.
var ErrNoCPU = errors.New("no processor block in cpuinfo")

// VersionProbe reports one component's version, normalized as ExecVersion documents
// ("1.5.3", "2.4.2"). It must honor ctx.
type VersionProbe func(ctx context.Context) (string, error)

// Sources are where Collect gets its facts. Everything is injected so that tests can use a fake
// /proc and fake probes; the zero value collects the kernel and CPU of this node and leaves the
// version fields empty.
type Sources struct {
	// ProcRoot is the procfs mount to read; "" means "/proc". Collect reads
	// ProcRoot/sys/kernel/osrelease and ProcRoot/cpuinfo.
	ProcRoot string
	// CRIUVersion returns CRIU's version as "major.minor.sublevel" (berth's criu package:
	// Client.Version(ctx).String(), which asks CRIU over its RPC). nil leaves Fingerprint.CRIU
	// empty.
	CRIUVersion VersionProbe
	// RuncVersion returns runc's version, e.g. ExecVersion(runcPath, "--version"). nil leaves
	// Fingerprint.Runc empty.
	RuncVersion VersionProbe
	// ContainerdVersion returns containerd's version, e.g. from containerd's version API or
	// ExecVersion(containerdPath, "--version"). nil leaves Fingerprint.Containerd empty.
	ContainerdVersion VersionProbe
	// Arch is the machine architecture in GOARCH form; "" means runtime.GOARCH.
	Arch string
}

// Collect builds this node's fingerprint from src: Version is this package's Version, Kernel
// comes from ProcRoot/sys/kernel/osrelease (trimmed), CPU from the first processor block of
// ProcRoot/cpuinfo (see CPUFlagRelevant for which flags are kept), CRIU, Runc and Containerd
// from the probes, Arch from src.Arch. ImageDigest and GPUs are left empty (a checkpoint's
// writer and the GPU inventory fill them).
//
// Collect reads everything it can: on error the returned Fingerprint still holds every field
// that was collected, and the error joins one wrapped error per failed source, each naming the
// field and, for files, the path (a missing file matches fs.ErrNotExist; an empty cpuinfo
// matches ErrNoCPU; probe errors are wrapped as returned). If ctx is done before the probes
// run, Collect returns ctx.Err() (wrapped) among its errors.
func Collect(ctx context.Context, src Sources) (Fingerprint, error) {
	root := src.ProcRoot
	if root == "" {
		root = "/proc"
	}
	fp := Fingerprint{Version: Version, Arch: src.Arch}
	if fp.Arch == "" {
		fp.Arch = runtime.GOARCH
	}
	var errs []error

	release := filepath.Join(root, "sys", "kernel", "osrelease")
	if b, err := os.ReadFile(release); err != nil {
		errs = append(errs, fmt.Errorf("fingerprint: kernel: %w", err))
	} else {
		fp.Kernel = strings.TrimSpace(string(b))
	}

	cpuinfo := filepath.Join(root, "cpuinfo")
	if b, err := os.ReadFile(cpuinfo); err != nil {
		errs = append(errs, fmt.Errorf("fingerprint: cpu: %w", err))
	} else if cpu, err := parseCPUInfo(b); err != nil {
		errs = append(errs, fmt.Errorf("fingerprint: cpu: %s: %w", cpuinfo, err))
	} else {
		fp.CPU = cpu
	}

	probes := []struct {
		name  string
		probe VersionProbe
		dst   *string
	}{
		{"criu", src.CRIUVersion, &fp.CRIU},
		{"runc", src.RuncVersion, &fp.Runc},
		{"containerd", src.ContainerdVersion, &fp.Containerd},
	}
	for _, p := range probes {
		if p.probe == nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			errs = append(errs, fmt.Errorf("fingerprint: %s: %w", p.name, err))
			break
		}
		v, err := p.probe(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("fingerprint: %s: %w", p.name, err))
			continue
		}
		*p.dst = v
	}
	return fp, errors.Join(errs...)
}

// parseCPUInfo reads the first processor block of a /proc/cpuinfo (lines up to the first
// blank line after some content). x86 keys: vendor_id, cpu family, model, model name, flags.
// arm64 keys: CPU implementer (-> Vendor), CPU architecture (-> Family), CPU part (-> Model),
// Features (-> Flags, all kept: every arm64 hwcap names something user space may use).
func parseCPUInfo(b []byte) (CPU, error) {
	var cpu CPU
	seen := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			if seen {
				break
			}
			continue
		}
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		seen = true
		key = strings.TrimSpace(key)
		val = strings.TrimSpace(val)
		switch key {
		case "vendor_id":
			cpu.Vendor = val
		case "cpu family":
			cpu.Family = val
		case "model":
			cpu.Model = val
		case "model name":
			cpu.ModelName = val
		case "flags":
			cpu.Flags = filterFlags(strings.Fields(val), CPUFlagRelevant)
		case "CPU implementer":
			cpu.Vendor = val
		case "CPU architecture":
			cpu.Family = val
		case "CPU part":
			cpu.Model = val
		case "Features":
			cpu.Flags = filterFlags(strings.Fields(val), func(string) bool { return true })
		}
	}
	if err := sc.Err(); err != nil {
		return CPU{}, err
	}
	if !seen {
		return CPU{}, ErrNoCPU
	}
	return cpu, nil
}

// filterFlags returns the flags keep accepts, deduplicated and sorted; never nil.
func filterFlags(flags []string, keep func(string) bool) []string {
	out := []string{}
	seen := map[string]bool{}
	for _, f := range flags {
		if keep(f) && !seen[f] {
			seen[f] = true
			out = append(out, f)
		}
	}
	sort.Strings(out)
	return out
}

// relevantFlags are the x86 /proc/cpuinfo flags (kernel names) that change which instructions
// a process may execute, or the size and layout of the FPU/xsave state CRIU saves and restores.
// A process restored on a CPU lacking one of them may fault (SIGILL) or lose state.
var relevantFlags = map[string]bool{
	// Baseline and legacy extensions.
	"cmov": true, "cx8": true, "cx16": true, "mmx": true, "mmxext": true, "lahf_lm": true,
	"3dnow": true, "3dnowext": true, "3dnowprefetch": true, "rdtscp": true,
	// SSE family ("pni" is the kernel's name for SSE3).
	"sse": true, "sse2": true, "pni": true, "ssse3": true, "sse4_1": true, "sse4_2": true,
	"sse4a": true, "misalignsse": true,
	// Scalar and bit-manipulation extensions ("abm" is LZCNT).
	"abm": true, "popcnt": true, "bmi1": true, "bmi2": true, "adx": true, "movbe": true,
	"tbm": true, "fma": true, "fma4": true, "xop": true, "f16c": true,
	// Cryptography and random numbers.
	"aes": true, "vaes": true, "pclmulqdq": true, "vpclmulqdq": true, "gfni": true,
	"sha_ni": true, "sha512": true, "sm3": true, "sm4": true, "rdrand": true, "rdseed": true,
	// XSAVE state management (decides the xsave frame CRIU writes and restores).
	"xsave": true, "xsaveopt": true, "xsavec": true, "xsaves": true, "xgetbv1": true,
	// User-mode instructions.
	"fsgsbase": true, "rdpid": true, "clflushopt": true, "clwb": true, "clzero": true,
	"movdiri": true, "movdir64b": true, "serialize": true, "waitpkg": true, "cldemote": true,
	"enqcmd": true, "wbnoinvd": true, "pku": true, "ospke": true, "uintr": true,
	// Fast string operations.
	"erms": true, "fsrm": true, "fzrm": true, "fsrs": true, "fsrc": true,
	// APX extended registers.
	"apx": true,
}

// CPUFlagRelevant reports whether an x86 /proc/cpuinfo flag is kept in CPU.Flags: those that
// change what a restored process may execute or the FPU state CRIU moves. The list:
//
//   - every flag starting with "avx" (avx, avx2, avx512f, avx512_bf16, avx_vnni, ...) or
//     "amx" (amx_tile, amx_bf16, amx_int8, ...);
//   - baseline/legacy: cmov cx8 cx16 mmx mmxext lahf_lm 3dnow 3dnowext 3dnowprefetch rdtscp;
//   - SSE: sse sse2 pni (SSE3) ssse3 sse4_1 sse4_2 sse4a misalignsse;
//   - scalar/bit: abm (LZCNT) popcnt bmi1 bmi2 adx movbe tbm fma fma4 xop f16c;
//   - crypto/random: aes vaes pclmulqdq vpclmulqdq gfni sha_ni sha512 sm3 sm4 rdrand rdseed;
//   - xsave: xsave xsaveopt xsavec xsaves xgetbv1;
//   - user-mode instructions: fsgsbase rdpid clflushopt clwb clzero movdiri movdir64b
//     serialize waitpkg cldemote enqcmd wbnoinvd pku ospke uintr;
//   - fast strings: erms fsrm fzrm fsrs fsrc;
//   - apx.
//
// Everything else (virtualization, power management, mitigations, topology, "hypervisor")
// is dropped: it differs between hosts without affecting a restored process.
func CPUFlagRelevant(flag string) bool {
	return relevantFlags[flag] || strings.HasPrefix(flag, "avx") || strings.HasPrefix(flag, "amx")
}

// versionRE matches a version token: optional "v", then dotted decimals, then optional
// pre-release ("-rc.1") and build ("+unknown") parts.
var versionRE = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^v?([0-9]+(?:\.[0-9]+)+(?:-[0-9A-Za-z.-]+)?)(?:\+[0-9A-Za-z.-]*)?$`)
})

// ExecVersion returns a VersionProbe that runs path with args (e.g. ExecVersion("runc",
// "--version")) under the probe's ctx, and returns the first version token of the first line of
// its standard output. Normalization: the leading "v" and any "+build" suffix are dropped,
// a pre-release suffix is kept, so "runc version 1.5.3" gives "1.5.3", "containerd
// github.com/containerd/containerd/v2 v2.4.2 abc123" gives "2.4.2", "containerd ... 2.4.2+unknown"
// gives "2.4.2", and "Version: 4.2" (criu --version) gives "4.2".
//
// The probe's errors: the command's start or exit error (wrapped; a missing binary matches
// exec.ErrNotFound or fs.ErrNotExist), including up to 200 bytes of its standard error; ctx's
// error when ctx ends first; ErrNoVersion (wrapped, quoting the line) when the first line has
// no version token. path is looked up in PATH when it has no slash.
func ExecVersion(path string, args ...string) VersionProbe {
	return ExecVersionWith(nil, path, args...)
}

// Runner runs cmd (its Stdout unset, its Stderr set) to completion and returns its standard
// output, like (*exec.Cmd).Output. A containerd shim, which reaps every child itself, passes one
// built on its reaper.
type Runner func(cmd *exec.Cmd) ([]byte, error)

// ExecVersionWith is ExecVersion with the command run by run (nil: (*exec.Cmd).Output).
func ExecVersionWith(run Runner, path string, args ...string) VersionProbe {
	if run == nil {
		run = (*exec.Cmd).Output
	}
	return func(ctx context.Context) (string, error) {
		cmd := exec.CommandContext(ctx, path, args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := run(cmd)
		if ctx.Err() != nil {
			return "", fmt.Errorf("%s %s: %w", path, strings.Join(args, " "), ctx.Err())
		}
		if err != nil {
			msg := strings.TrimSpace(stderr.String())
			if len(msg) > 200 {
				msg = msg[:200]
			}
			if msg != "" {
				return "", fmt.Errorf("%s %s: %w: %s", path, strings.Join(args, " "), err, msg)
			}
			return "", fmt.Errorf("%s %s: %w", path, strings.Join(args, " "), err)
		}
		first, _, _ := strings.Cut(string(out), "\n")
		v, ok := versionToken(first)
		if !ok {
			return "", fmt.Errorf("%s %s: %w: %q", path, strings.Join(args, " "), ErrNoVersion, first)
		}
		return v, nil
	}
}

// versionToken returns the first whitespace-separated token of line that is a version,
// normalized as ExecVersion documents.
func versionToken(line string) (string, bool) {
	for _, tok := range strings.Fields(line) {
		if m := versionRE().FindStringSubmatch(tok); m != nil {
			return m[1], true
		}
	}
	return "", false
}

// NodeSources returns the Sources of a real node: procRoot (normally "/proc"), runtime.GOARCH,
// and the versions printed by `CRIU --version` (criuPath, "" meaning criu from PATH),
// `runc --version` and `containerd --version`, each run by run (nil: (*exec.Cmd).Output).
func NodeSources(procRoot, criuPath string, run Runner) Sources {
	if criuPath == "" {
		criuPath = "criu"
	}
	return Sources{
		ProcRoot:          procRoot,
		Arch:              runtime.GOARCH,
		CRIUVersion:       ExecVersionWith(run, criuPath, "--version"),
		RuncVersion:       ExecVersionWith(run, "runc", "--version"),
		ContainerdVersion: ExecVersionWith(run, "containerd", "--version"),
	}
}
