// Package helper is the protocol between the shim and berth-shim-helper, the binary the shim runs
// for work whose code it does not keep loaded: parsing a berth.dev/restore-from=oci://... value
// (oras-go's reference grammar, whose regular expressions compile at init), resolving its tag
// and pulling its checkpoint from a registry (oras-go, net/http's client and TLS),
// and reading the credentials of a checkpoint's processes from its CRIU images at restore
// (go-criu's image bindings, which register every CRIU image type at init), comparing a
// checkpoint's seccomp filters with the destination's profile as runc compiles it (runc's
// seccomp code and libseccomp, through a child process that loads it), and, on a CUDA node,
// reading the GPU inventory through NVML (Inventory). Every container has its own long-running
// shim process, and a Go process's resident memory grows with its binary (the kernel maps nearly
// all of the binary's text and read-only data into it), so code linked into the shim costs every
// container its size: about 1.9 MB for the registry client, 0.4 MB for the image bindings and 1.4
// MB for NVML's bindings, to serve the few restores and checkpoints that need them. A request
// costs a process start, about 10 ms; the inventory's process is started once, by the shim's
// first GPU call, and answers the calls that follow over a pipe until they pause for a minute.
//
// One call is one run of the helper (`berth-shim-helper serve`; the inventory is the exception,
// `berth-shim-helper gpu-inventory`: one process, one JSON request and answer per line, see
// Inventory): the shim writes a Request as one JSON object to its
// standard input; the helper answers with one Answer on its standard output and exits 0 (also
// when the answer is an error), or non-zero when it could not answer. An error crosses the
// boundary as its message and the names of the sentinel errors it matched (Error.Kinds), so the
// shim's one table from sentinels to errdefs classes still classifies it (errors.Is works on the
// decoded error). The shim stops the helper with SIGTERM when the caller cancels; the helper
// then removes what it staged, as an in-process pull would.
//
// What belongs here: the requests, answers and error kinds, the clients (Client, Inventory) and
// the serving loops (Serve, ServeInventory). What does not: the work itself (package
// shim/helper/serve wires oci/registry, criu/images and gpu/nvml into the helper) and what the
// shim does with the answers (package shim).
package helper

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/privilege"
	"github.com/berth-dev/berth/oci/privilege/seccompbpf"
	"github.com/berth-dev/berth/oci/registry/regdef"
)

// Name is the helper's file name. Find looks for it beside the shim's executable, then in PATH.
const Name = "berth-shim-helper"

// Command is the helper's one command-line argument.
const Command = "serve"

// Ops of a Request.
const (
	// OpResolve asks for the digest ("sha256:<hex>") of the OCI manifest Request.Ref names.
	OpResolve = "resolve"
	// OpPull pulls the checkpoint Request.Ref names into the new directory Request.Dir
	// (registry.Pull: every digest verified, nothing left at Dir on failure).
	OpPull = "pull"
	// OpReadProcesses asks for the credentials of every thread in the CRIU images directory
	// Request.Dir (images.ReadProcesses).
	OpReadProcesses = "read-processes"
	// OpParseRestoreFrom parses the berth.dev/restore-from value Request.Ref (with its oci://
	// scheme, as the annotation holds it) with reference.ParseRestoreFrom, the one parser of
	// registry references (oras-go's grammar), and answers it in Answer.RestoreFrom; its
	// errors are ParseRestoreFrom's (they match checkpoint.ErrInvalidRef).
	OpParseRestoreFrom = "parse-restore-from"
	// OpCheckSeccomp compares the seccomp filters of every process in the CRIU images directory
	// Request.Dir with the filter runc installs for the profile Request.Seccomp (seccompbpf.Compare
	// against seccompload.Compile): an error names each system call a process's filters let do
	// more, and matches seccompbpf.ErrMorePermissive.
	OpCheckSeccomp = "check-seccomp"
)

// RegistryOptions say how to reach a registry: PlainHTTP talks HTTP instead of HTTPS,
// DockerConfig is the path of a Docker config.json with credentials ("" is anonymous), and
// Limits bound what a pull accepts (file count, largest file and total, in bytes).
type RegistryOptions struct {
	PlainHTTP    bool           `json:"plainHTTP,omitempty"`
	DockerConfig string         `json:"dockerConfig,omitempty"`
	Limits       archive.Limits `json:"limits"`
}

// Request is what the shim writes to the helper's standard input: Op (OpResolve, OpPull,
// OpReadProcesses or OpParseRestoreFrom), the reference ("host[:port]/repository:tag" or
// "...@sha256:<hex>"; the annotation's value, "oci://...", for OpParseRestoreFrom) and the
// registry options for the registry ops, and Dir: the directory to create for OpPull, the CRIU
// images directory for OpReadProcesses.
type Request struct {
	Op       string          `json:"op"`
	Ref      string          `json:"ref"`
	Dir      string          `json:"dir,omitempty"`
	Registry RegistryOptions `json:"registry"`
	// Seccomp is the destination spec's profile, for OpCheckSeccomp.
	Seccomp *specs.LinuxSeccomp `json:"seccomp,omitempty"`
}

// Answer is what the helper writes to its standard output: the digest for OpResolve, the
// processes for OpReadProcesses, the parsed value for OpParseRestoreFrom, or the error the
// request met.
type Answer struct {
	Digest      string              `json:"digest,omitempty"`
	RestoreFrom *regdef.RestoreFrom `json:"restoreFrom,omitempty"`
	Processes   []privilege.Process `json:"processes,omitempty"`
	Error       *Error              `json:"error,omitempty"`
}

// Error is an error as it crosses the boundary: its message, and the names (from the kinds
// table) of every sentinel error it matched.
type Error struct {
	Message string   `json:"message"`
	Kinds   []string `json:"kinds,omitempty"`
}

// kinds names the sentinel errors a registry request can meet that the shim classifies,
// context's, so a canceled pull stays canceled, and the GPU inventory's (gpu.ErrUnsupported: NVML
// missing, or a value it cannot report).
var kinds = []struct {
	name string
	err  error
}{
	{"registry-unauthorized", regdef.ErrUnauthorized},
	{"registry-not-checkpoint", regdef.ErrNotCheckpoint},
	{"registry-layer-mismatch", regdef.ErrLayerMismatch},
	{"registry-no-tag", regdef.ErrNoTag},
	{"registry-credentials-in-reference", regdef.ErrCredentialsInReference},
	{"not-found", regdef.ErrNotFound},
	{"invalid-argument", errdefs.ErrInvalidArgument},
	{"checkpoint-invalid-ref", checkpoint.ErrInvalidRef},
	{"checkpoint-digest-mismatch", checkpoint.ErrDigestMismatch},
	{"checkpoint-missing-file", checkpoint.ErrMissingFile},
	{"checkpoint-extra-file", checkpoint.ErrExtraFile},
	{"checkpoint-truncated", checkpoint.ErrTruncated},
	{"checkpoint-size-mismatch", checkpoint.ErrSizeMismatch},
	{"checkpoint-invalid-manifest", checkpoint.ErrInvalidManifest},
	{"checkpoint-unsupported-version", checkpoint.ErrUnsupportedVersion},
	{"checkpoint-unsupported-file", checkpoint.ErrUnsupportedFile},
	{"archive-unsafe-path", archive.ErrUnsafePath},
	{"archive-link", archive.ErrLink},
	{"archive-special-file", archive.ErrSpecialFile},
	{"archive-file-too-large", archive.ErrFileTooLarge},
	{"archive-total-too-large", archive.ErrTotalTooLarge},
	{"archive-too-many-entries", archive.ErrTooManyEntries},
	{"archive-duplicate-entry", archive.ErrDuplicateEntry},
	{"not-exist", os.ErrNotExist},
	{"exist", os.ErrExist},
	{"canceled", context.Canceled},
	{"deadline-exceeded", context.DeadlineExceeded},
	{"gpu-unsupported", gpu.ErrUnsupported},
	{"seccomp-more-permissive", seccompbpf.ErrMorePermissive},
	{"seccomp-compile", seccompbpf.ErrCompile},
	{"seccomp-bad-program", seccompbpf.ErrBadProgram},
	{"seccomp-too-complex", seccompbpf.ErrTooComplex},
}

// EncodeError returns err as it crosses the boundary; nil for nil.
func EncodeError(err error) *Error {
	if err == nil {
		return nil
	}
	e := &Error{Message: err.Error()}
	for _, k := range kinds {
		if errors.Is(err, k.err) {
			e.Kinds = append(e.Kinds, k.name)
		}
	}
	return e
}

// Err returns the error e stands for: its message, matching (errors.Is) the sentinels its kinds
// name; unknown kinds are ignored. nil for nil.
func (e *Error) Err() error {
	if e == nil {
		return nil
	}
	r := remoteError{msg: e.Message}
	for _, name := range e.Kinds {
		for _, k := range kinds {
			if k.name == name {
				r.is = append(r.is, k.err)
			}
		}
	}
	return r
}

// remoteError is an error the helper answered with.
type remoteError struct {
	msg string
	is  []error
}

func (r remoteError) Error() string { return r.msg }

// Is reports whether target is one of the sentinels the helper said the error matched.
func (r remoteError) Is(target error) bool {
	for _, s := range r.is {
		if s == target {
			return true
		}
	}
	return false
}

// Find returns the helper's path: Name beside the running executable (the shim), else Name in
// PATH. Its error says where it looked and how to install the helper.
func Find() (string, error) {
	var looked []string
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), Name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
		looked = append(looked, p)
	}
	if p, err := exec.LookPath(Name); err == nil {
		return p, nil
	}
	looked = append(looked, "PATH")
	return "", fmt.Errorf("%s not found (looked at %s): install it beside containerd-shim-berth-v2 (make build writes both to _output/bin): %w",
		Name, strings.Join(looked, ", "), errdefs.ErrFailedPrecondition)
}

// Client runs the helper once per call. Path is the helper (Find, when empty); Run starts cmd,
// waits for it and returns its standard output and an error for a non-zero exit (the shim runs
// it through containerd's reaper, which owns every child of a shim); nil runs cmd.Output.
type Client struct {
	Path string
	Run  func(cmd *exec.Cmd) ([]byte, error)
}

// Resolve returns the digest ("sha256:<hex>") of the OCI manifest ref names (registry.Resolve in
// the helper). Errors: the registry's, decoded (Error.Err), or why the helper gave no answer.
func (c Client) Resolve(ctx context.Context, ref string, o RegistryOptions) (string, error) {
	a, err := c.call(ctx, Request{Op: OpResolve, Ref: ref, Registry: o})
	if err != nil {
		return "", err
	}
	if a.Digest == "" {
		return "", fmt.Errorf("%s resolved %s to no digest", Name, ref)
	}
	return a.Digest, nil
}

// Pull pulls the checkpoint ref names into the new directory dir (registry.Pull in the helper:
// every digest verified; nothing is left at dir on failure). Errors as Resolve's.
func (c Client) Pull(ctx context.Context, ref, dir string, o RegistryOptions) error {
	_, err := c.call(ctx, Request{Op: OpPull, Ref: ref, Dir: dir, Registry: o})
	return err
}

// ParseRestoreFrom parses the berth.dev/restore-from value v (reference.ParseRestoreFrom in the
// helper, so that oras-go's reference grammar is not part of the shim). Errors:
// ParseRestoreFrom's, decoded (they match checkpoint.ErrInvalidRef, and
// regdef.ErrCredentialsInReference for a reference with credentials), or why the helper gave no
// answer.
func (c Client) ParseRestoreFrom(ctx context.Context, v string) (regdef.RestoreFrom, error) {
	a, err := c.call(ctx, Request{Op: OpParseRestoreFrom, Ref: v})
	if err != nil {
		return regdef.RestoreFrom{}, err
	}
	if a.RestoreFrom == nil {
		return regdef.RestoreFrom{}, fmt.Errorf("%s parsed %s to nothing", Name, v)
	}
	return *a.RestoreFrom, nil
}

// ReadProcesses returns the credentials of every thread in the CRIU images directory dir
// (images.ReadProcesses in the helper), in pstree order. Errors: images.ReadProcesses's, decoded
// (a missing file matches fs.ErrNotExist), or why the helper gave no answer.
func (c Client) ReadProcesses(ctx context.Context, dir string) ([]privilege.Process, error) {
	a, err := c.call(ctx, Request{Op: OpReadProcesses, Dir: dir})
	if err != nil {
		return nil, err
	}
	return a.Processes, nil
}

// CheckSeccomp compares the seccomp filters of every process in the CRIU images directory dir
// with the filter runc installs for profile (OpCheckSeccomp). nil when none lets a system call do
// more; errors match seccompbpf's sentinels (ErrMorePermissive naming the process and the system
// calls, ErrCompile, ErrBadProgram, ErrTooComplex), or say why the helper gave no answer.
func (c Client) CheckSeccomp(ctx context.Context, dir string, profile *specs.LinuxSeccomp) error {
	_, err := c.call(ctx, Request{Op: OpCheckSeccomp, Dir: dir, Seccomp: profile})
	return err
}

// maxStderr bounds the helper's standard error kept for an error message, in bytes.
const maxStderr = 4 << 10

func (c Client) call(ctx context.Context, req Request) (*Answer, error) {
	path := c.Path
	if path == "" {
		p, err := Find()
		if err != nil {
			return nil, err
		}
		path = p
	}
	in, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, path, Command)
	cmd.Stdin = bytes.NewReader(in)
	stderr := &tailBuffer{max: maxStderr}
	cmd.Stderr = stderr
	// SIGTERM, not SIGKILL: the helper then removes what it staged
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	run := c.Run
	if run == nil {
		run = (*exec.Cmd).Output
	}
	out, runErr := run(cmd)
	var a Answer
	if jerr := json.Unmarshal(bytes.TrimSpace(out), &a); jerr == nil {
		if a.Error != nil {
			return nil, a.Error.Err()
		}
		if runErr == nil {
			return &a, nil
		}
	}
	if cerr := ctx.Err(); cerr != nil {
		return nil, fmt.Errorf("%s %s %s: %w", Name, req.Op, req.Ref, cerr)
	}
	msg := strings.TrimSpace(stderr.String())
	if runErr == nil {
		runErr = errors.New("no answer on its standard output")
	}
	if msg != "" {
		return nil, fmt.Errorf("%s %s %s: %w: %s", Name, req.Op, req.Ref, runErr, msg)
	}
	return nil, fmt.Errorf("%s %s %s: %w", Name, req.Op, req.Ref, runErr)
}

// Handlers do the work of Serve: Resolve returns the digest of the OCI manifest a reference
// names, Pull pulls a checkpoint into a new directory (registry.Resolve and registry.Pull),
// ReadProcesses reads the credentials in a CRIU images directory (images.ReadProcesses),
// ParseRestoreFrom parses a berth.dev/restore-from value (reference.ParseRestoreFrom).
type Handlers struct {
	ParseRestoreFrom func(v string) (regdef.RestoreFrom, error)
	Resolve          func(ctx context.Context, ref string, o RegistryOptions) (string, error)
	Pull             func(ctx context.Context, ref, dir string, o RegistryOptions) error
	ReadProcesses    func(ctx context.Context, dir string) ([]privilege.Process, error)
	CheckSeccomp     func(ctx context.Context, dir string, profile *specs.LinuxSeccomp) error
}

// Serve reads one Request from in, runs it with h, and writes its Answer to out. It returns the
// helper's exit status: 0 when it answered (also with an error), 2 when the request could not
// be read or the answer not written.
func Serve(ctx context.Context, in io.Reader, out io.Writer, h Handlers) int {
	var req Request
	if err := json.NewDecoder(io.LimitReader(in, 1<<20)).Decode(&req); err != nil {
		fmt.Fprintf(os.Stderr, "%s: read the request from standard input: %v\n", Name, err)
		return 2
	}
	var a Answer
	var err error
	switch req.Op {
	case OpResolve:
		a.Digest, err = h.Resolve(ctx, req.Ref, req.Registry)
	case OpPull:
		if req.Dir == "" {
			err = fmt.Errorf("pull %s: no directory: %w", req.Ref, errdefs.ErrInvalidArgument)
		} else {
			err = h.Pull(ctx, req.Ref, req.Dir, req.Registry)
		}
	case OpParseRestoreFrom:
		var r regdef.RestoreFrom
		if r, err = h.ParseRestoreFrom(req.Ref); err == nil {
			a.RestoreFrom = &r
		}
	case OpReadProcesses:
		if req.Dir == "" {
			err = fmt.Errorf("read processes: no images directory: %w", errdefs.ErrInvalidArgument)
		} else {
			a.Processes, err = h.ReadProcesses(ctx, req.Dir)
		}
	case OpCheckSeccomp:
		if req.Dir == "" || req.Seccomp == nil || h.CheckSeccomp == nil {
			err = fmt.Errorf("check seccomp: no images directory, profile or handler: %w", errdefs.ErrInvalidArgument)
		} else {
			err = h.CheckSeccomp(ctx, req.Dir, req.Seccomp)
		}
	default:
		err = fmt.Errorf("unknown op %q (want %s, %s, %s, %s or %s): %w", req.Op, OpResolve, OpPull, OpReadProcesses, OpParseRestoreFrom, OpCheckSeccomp, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		a = Answer{Error: EncodeError(err)}
	}
	if err := json.NewEncoder(out).Encode(a); err != nil {
		fmt.Fprintf(os.Stderr, "%s: write the answer: %v\n", Name, err)
		return 2
	}
	return 0
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = t.b[len(t.b)-t.max:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }
