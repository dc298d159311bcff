package helper

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/topology"
)

// InventoryCommand is the helper's command-line argument for serving a CUDA node's GPU inventory
// (NVML) to the shim, in one process that answers the shim's calls until they have been idle for
// InventoryIdle (Inventory, ServeInventory).
const InventoryCommand = "gpu-inventory"

// Ops of an InventoryRequest: one per gpu.Inventory and gpu.Topologist method, and InvOpen.
const (
	// InvOpen opens the inventory (NVML's nvmlInit) if no request did yet, and answers nothing.
	InvOpen = "open"
	// InvDevices asks for gpu.Inventory.Devices (InventoryAnswer.Devices).
	InvDevices = "devices"
	// InvVersions asks for gpu.Inventory.Versions (InventoryAnswer.Versions).
	InvVersions = "versions"
	// InvProcessMemory asks for gpu.Inventory.ProcessMemory of InventoryRequest.PID
	// (InventoryAnswer.Memory).
	InvProcessMemory = "process-memory"
	// InvTopology asks for gpu.Topologist.Topology (InventoryAnswer.Topology; null when the
	// inventory is not a Topologist or does not know the links).
	InvTopology = "topology"
)

// InventoryRequest is one line the shim writes to a gpu-inventory helper's standard input: Op
// (an Inv* op) and, for InvProcessMemory, the host PID.
type InventoryRequest struct {
	Op  string `json:"op"`
	PID int    `json:"pid,omitempty"`
}

// InventoryAnswer is what the helper answers one InventoryRequest with, on one line of its
// standard output: the field of the request's op, always present for InvDevices, InvVersions and
// InvProcessMemory (an empty list or map when there is nothing; a missing one is a protocol
// error to the shim, never read as "none"), device memory in bytes keyed by GPU UUID; or the error
// the inventory met (crossing as Error does for the other requests).
type InventoryAnswer struct {
	Devices  []gpu.Device       `json:"devices,omitzero"`
	Versions *Versions          `json:"versions,omitempty"`
	Memory   map[string]uint64  `json:"memory,omitzero"`
	Topology *topology.Topology `json:"topology,omitempty"`
	Error    *Error             `json:"error,omitempty"`
}

// Versions is gpu.Versions as it crosses the boundary (gpu.Versions does not encode DriverMajor).
type Versions struct {
	Driver      string `json:"driver"`
	DriverMajor int    `json:"driverMajor"`
	CUDA        string `json:"cuda"`
}

// DefaultInventoryDeadline is Inventory.Deadline when unset: far above what NVML takes to answer
// (milliseconds; its first open, some seconds), far below a pause a workload would notice as lost.
const DefaultInventoryDeadline = 30 * time.Second

// InventoryIdle is how long `berth-shim-helper gpu-inventory` waits for the shim's next request
// before it exits (the next call starts a new one): a shim's GPU calls come in bursts, one
// checkpoint or restore, and a container may run for months after its restore.
const InventoryIdle = time.Minute

// ServeInventory answers the InventoryRequests read from in (one JSON object each), each with
// one InventoryAnswer on out, until in ends (the shim closed it or exited) or no request came for
// idle (0: no limit). The inventory is opened with open by the first request, and by the next
// one again after a failed open (a driver still loading at boot), whose error every request until
// then answers with; it is closed on return when it is an io.Closer (nvmlShutdown). It returns
// the helper's exit status: 0 when in ended or it was idle, 2 when a request could not be read
// or an answer not written.
func ServeInventory(in io.Reader, out io.Writer, open func() (gpu.Inventory, error), idle time.Duration) int {
	type request struct {
		req InventoryRequest
		err error
	}
	reqs := make(chan request)
	go func() {
		dec := json.NewDecoder(in)
		for {
			var r request
			r.err = dec.Decode(&r.req)
			reqs <- r
			if r.err != nil {
				return
			}
		}
	}()
	enc := json.NewEncoder(out)
	var inv gpu.Inventory
	defer func() {
		if c, ok := inv.(io.Closer); ok {
			_ = c.Close()
		}
	}()
	var timeout <-chan time.Time
	for {
		if idle > 0 {
			timeout = time.After(idle)
		}
		var r request
		select {
		case r = <-reqs:
		case <-timeout:
			return 0
		}
		req := r.req
		if err := r.err; err != nil {
			if errors.Is(err, io.EOF) {
				return 0
			}
			fmt.Fprintf(os.Stderr, "%s %s: read a request from standard input: %v\n", Name, InventoryCommand, err)
			return 2
		}
		var a InventoryAnswer
		var err error
		if inv == nil {
			if inv, err = open(); err != nil {
				inv = nil // not kept, even as a typed nil: the next request opens again
			}
		}
		if err == nil {
			a, err = answerInventory(inv, req)
		}
		if err != nil {
			a = InventoryAnswer{Error: EncodeError(err)}
		}
		if err := enc.Encode(a); err != nil {
			fmt.Fprintf(os.Stderr, "%s %s: write the answer: %v\n", Name, InventoryCommand, err)
			return 2
		}
	}
}

// answerInventory runs req on inv.
func answerInventory(inv gpu.Inventory, req InventoryRequest) (InventoryAnswer, error) {
	var a InventoryAnswer
	var err error
	switch req.Op {
	case InvOpen:
	case InvDevices:
		if a.Devices, err = inv.Devices(); err == nil && a.Devices == nil {
			a.Devices = []gpu.Device{}
		}
	case InvVersions:
		var v gpu.Versions
		if v, err = inv.Versions(); err == nil {
			a.Versions = &Versions{Driver: v.Driver, DriverMajor: v.DriverMajor, CUDA: v.CUDA}
		}
	case InvProcessMemory:
		if a.Memory, err = inv.ProcessMemory(req.PID); err == nil && a.Memory == nil {
			a.Memory = map[string]uint64{}
		}
	case InvTopology:
		if t, ok := inv.(gpu.Topologist); ok {
			a.Topology, err = t.Topology()
		}
	default:
		err = fmt.Errorf("unknown inventory op %q (want %s, %s, %s, %s or %s)", req.Op, InvOpen, InvDevices, InvVersions, InvProcessMemory, InvTopology)
	}
	return a, err
}

// Inventory is a CUDA node's GPU inventory (gpu.Inventory and gpu.Topologist) read by a
// `berth-shim-helper gpu-inventory` process, so that the shim does not link NVML (go-nvml keeps
// all of its bindings linked, about 1.4 MB that every container's shim would carry resident).
// The process is started by the first call (Open, from the shim's lazy GPU backend: the first
// checkpoint or restore that needs the GPUs), opens NVML once and then answers each call over its
// standard input and output (a pipe round trip, no process start per call), until the shim
// exits, Close is called, or no call came for InventoryIdle (the helper then exits, so that a
// container's shim does not keep it, and NVML, for the months the container may run after its
// restore). A call whose helper exited or broke the protocol stops it and is sent once more to
// a new helper (every request only reads); when that fails too, the call returns an error
// naming the helper with the end of its standard error. An answer without its op's field
// (InventoryAnswer) is such a break. A helper that does not answer within Deadline (NVML hung
// on a GPU fallen off the bus) is killed and the call fails at once, naming the op and the
// deadline (a containerd task may be paused meanwhile); the next call starts a new helper.
// Calls are serialised.
//
// Path is the helper (Find, when empty). Deadline is how long one call waits for the helper to
// take its request and answer (0: DefaultInventoryDeadline). Start starts cmd and returns a function that waits for
// its exit (the shim starts it through containerd's reaper, which owns every child of a shim);
// nil runs cmd.Start and cmd.Wait.
type Inventory struct {
	Path     string
	Start    func(cmd *exec.Cmd) (wait func() error, err error)
	Deadline time.Duration

	mu sync.Mutex
	p  *inventoryProcess
}

// inventoryProcess is a running gpu-inventory helper.
type inventoryProcess struct {
	cmd    *exec.Cmd
	stdin  *os.File
	stdout *os.File
	enc    *json.Encoder
	dec    *json.Decoder
	stderr *lockedTail
	exited chan struct{} // closed when the process was waited for
}

// Open starts the helper if none runs and has it open NVML; it returns i, or the error NVML's
// open met (the helper's, decoded: a missing library wraps gpu.ErrUnsupported) or why the helper
// gave no answer. It is the shim's backend.InventoryOpener.
func (i *Inventory) Open() (gpu.Inventory, error) {
	if _, err := i.call(InventoryRequest{Op: InvOpen}); err != nil {
		return nil, err
	}
	return i, nil
}

// Devices is gpu.Inventory.Devices, read by the helper.
func (i *Inventory) Devices() ([]gpu.Device, error) {
	a, err := i.call(InventoryRequest{Op: InvDevices})
	if err != nil {
		return nil, err
	}
	return a.Devices, nil
}

// Versions is gpu.Inventory.Versions, read by the helper.
func (i *Inventory) Versions() (gpu.Versions, error) {
	a, err := i.call(InventoryRequest{Op: InvVersions})
	if err != nil {
		return gpu.Versions{}, err
	}
	return gpu.Versions{Driver: a.Versions.Driver, DriverMajor: a.Versions.DriverMajor, CUDA: a.Versions.CUDA}, nil
}

// ProcessMemory is gpu.Inventory.ProcessMemory, read by the helper: bytes per GPU UUID, an empty
// map for a process without CUDA state; errors wrap gpu.ErrUnsupported as the inventory's do.
func (i *Inventory) ProcessMemory(pid int) (map[string]uint64, error) {
	a, err := i.call(InventoryRequest{Op: InvProcessMemory, PID: pid})
	if err != nil {
		return nil, err
	}
	return a.Memory, nil
}

// Topology is gpu.Topologist.Topology, read by the helper; nil when unknown.
func (i *Inventory) Topology() (*topology.Topology, error) {
	a, err := i.call(InventoryRequest{Op: InvTopology})
	if err != nil {
		return nil, err
	}
	return a.Topology, nil
}

// Close ends the helper, if one runs: it closes its standard input, on which the helper exits,
// and waits for it. It returns nil; a later call starts a new helper.
func (i *Inventory) Close() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.p != nil {
		_ = i.p.stdin.Close()
		<-i.p.exited
		_ = i.p.stdout.Close()
		i.p = nil
	}
	return nil
}

// errMissingField is an answer without its op's field (InventoryAnswer).
var errMissingField = errors.New("answer without its field")

// missingField returns an error wrapping errMissingField when a, the answer to op, lacks the
// field op always has (InventoryAnswer); nil otherwise.
func missingField(op string, a *InventoryAnswer) error {
	var field string
	switch {
	case op == InvDevices && a.Devices == nil:
		field = "devices"
	case op == InvVersions && a.Versions == nil:
		field = "versions"
	case op == InvProcessMemory && a.Memory == nil:
		field = "memory"
	default:
		return nil
	}
	return fmt.Errorf("%w %q", errMissingField, field)
}

// call sends req to the helper, starting one if none runs, and returns its answer or the error
// it answered with (decoded). A helper that cannot be written to, gives no answer or an answer
// without its field is stopped; one that gives none within the deadline is killed.
func (i *Inventory) call(req InventoryRequest) (*InventoryAnswer, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	deadline := i.Deadline
	if deadline <= 0 {
		deadline = DefaultInventoryDeadline
	}
	for attempt := 1; ; attempt++ {
		if i.p == nil {
			p, err := i.start()
			if err != nil {
				return nil, err
			}
			i.p = p
		}
		p := i.p
		var a InventoryAnswer
		// the pipes are the poller's (os.Pipe): a deadline ends a blocked write or read
		err := errors.Join(p.stdin.SetWriteDeadline(time.Now().Add(deadline)), p.stdout.SetReadDeadline(time.Now().Add(deadline)))
		if err == nil {
			err = p.enc.Encode(req)
		}
		if err == nil {
			err = p.dec.Decode(&a)
		}
		if err == nil {
			if a.Error != nil {
				return nil, a.Error.Err()
			}
			if err = missingField(req.Op, &a); err == nil {
				return &a, nil
			}
		}
		i.p = nil
		p.stop()
		select { // so that its standard error is read to the end
		case <-p.exited:
		case <-time.After(2 * time.Second):
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("no answer within %v: helper (pid %d) killed: %w (%w)", deadline, p.cmd.Process.Pid, gpu.ErrTimeout, err)
			attempt = 2 // a hung GPU hangs the next helper too: fail now, the next call starts one
		}
		if attempt < 2 {
			continue // it was idle and exited, or died: once more, with a new helper
		}
		if errors.Is(err, io.EOF) {
			err = errors.New("it exited without an answer")
		}
		if msg := strings.TrimSpace(p.stderr.String()); msg != "" {
			return nil, fmt.Errorf("%s %s %s: %w: %s", Name, InventoryCommand, req.Op, err, msg)
		}
		return nil, fmt.Errorf("%s %s %s: %w", Name, InventoryCommand, req.Op, err)
	}
}

// start starts a gpu-inventory helper on two pipes.
func (i *Inventory) start() (_ *inventoryProcess, retErr error) {
	path := i.Path
	if path == "" {
		p, err := Find()
		if err != nil {
			return nil, err
		}
		path = p
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		_ = inR.Close()
		_ = inW.Close()
		return nil, err
	}
	defer func() {
		_ = inR.Close() // the child's ends: it holds its own copies once started
		_ = outW.Close()
		if retErr != nil {
			_ = inW.Close()
			_ = outR.Close()
		}
	}()
	p := &inventoryProcess{
		cmd:    exec.Command(path, InventoryCommand),
		stdin:  inW,
		stdout: outR,
		enc:    json.NewEncoder(inW),
		dec:    json.NewDecoder(outR),
		stderr: &lockedTail{t: tailBuffer{max: maxStderr}},
		exited: make(chan struct{}),
	}
	p.cmd.Stdin = inR
	p.cmd.Stdout = outW
	p.cmd.Stderr = p.stderr
	start := i.Start
	if start == nil {
		start = func(cmd *exec.Cmd) (func() error, error) {
			if err := cmd.Start(); err != nil {
				return nil, err
			}
			return cmd.Wait, nil
		}
	}
	wait, err := start(p.cmd)
	if err != nil {
		return nil, fmt.Errorf("start %s %s: %w", path, InventoryCommand, err)
	}
	go func() {
		_ = wait() // its exit is seen by the next call, as a broken pipe or EOF
		close(p.exited)
	}()
	return p, nil
}

// stop kills the process and closes the shim's ends of its pipes; the waiting goroutine reaps it.
func (p *inventoryProcess) stop() {
	_ = p.stdin.Close()
	_ = p.stdout.Close()
	if p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
	}
}

// lockedTail is a tailBuffer that the exec package's copying goroutine may write while a call
// reads it.
type lockedTail struct {
	mu sync.Mutex
	t  tailBuffer
}

func (l *lockedTail) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.t.Write(p)
}

func (l *lockedTail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.t.String()
}
