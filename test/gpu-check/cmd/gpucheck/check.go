package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/nvml"
)

// Exit statuses.
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitUnsupported = 3
)

// inventory is what gpucheck needs of gpu/nvml (a seam for tests).
type inventory interface {
	Snapshot() (nvml.Snapshot, error)
	Close() error
}

// deps are the real GPU paths; tests replace them.
type deps struct {
	loadDriver    func(lib string) (gpu.Driver, error)
	openInventory func(sysfs string) (inventory, error)
	// openNVML opens NVML in this process, openHelper the shim's inventory through the
	// berth-shim-helper at path (returning its Close), for helper-inventory.
	openNVML   func() (gpu.Inventory, error)
	openHelper func(path string) (gpu.Inventory, func() error, error)
}

// StepResult is one driver call: its name, wall time in seconds, the process state after it
// (cuCheckpointProcessGetState, not timed) and, when --bytes was given, bytes / seconds in GB/s
// (10^9 bytes per second).
type StepResult struct {
	Step    string  `json:"step"`
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gbps,omitempty"`
	State   string  `json:"state,omitempty"`
	TID     int     `json:"tid,omitempty"`
	Error   string  `json:"error,omitempty"`
}

// ProcessReport is the JSON a process command prints.
type ProcessReport struct {
	PID         int           `json:"pid"`
	Library     string        `json:"library"`
	LoadSeconds float64       `json:"loadSeconds"` // dlopen + cuInit + version reads
	Versions    *gpu.Versions `json:"versions,omitempty"`
	Bytes       int64         `json:"bytes,omitempty"`
	Steps       []StepResult  `json:"steps"`
	Error       string        `json:"error,omitempty"`
}

// InventoryReport is the JSON of inventory and fingerprint.
type InventoryReport struct {
	Seconds  float64      `json:"seconds"`
	Versions gpu.Versions `json:"versions"`
	Devices  []gpu.Device `json:"devices"`
	Error    string       `json:"error,omitempty"`
}

// Fingerprint is the GPU part of the node's fingerprint as this check sees it.
type Fingerprint struct {
	GPUModel        string   `json:"gpuModel"`
	GPUCount        int      `json:"gpuCount"`
	GPUArch         string   `json:"gpuArch,omitempty"`
	MemoryPerGPU    []uint64 `json:"memoryPerGpuBytes"`
	FreePerGPU      []uint64 `json:"freePerGpuBytes"`
	Driver          string   `json:"driver"`
	CUDA            string   `json:"cuda"`
	KernelRelease   string   `json:"kernelRelease,omitempty"`
	MIG             bool     `json:"migAnyGpu"`
	CheckpointAPI   string   `json:"checkpointApi"` // "ok", or why not
	UUIDRemap       string   `json:"uuidRemap"`     // "ok", or why not
	CUDALoadSeconds float64  `json:"cudaLoadSeconds,omitempty"`
	Error           string   `json:"error,omitempty"`
}

var processSteps = map[string]bool{"state": true, "tid": true, "lock": true, "checkpoint": true, "restore": true, "unlock": true}

func usage(w io.Writer) {
	fmt.Fprintln(w, `usage: gpucheck inventory|topology|fingerprint [--sysfs DIR] [--lib PATH]
       gpucheck state|tid|lock|checkpoint|restore|unlock --pid N [--timeout D] [--bytes B] [--pairs OLD=NEW,...] [--lib PATH]
       gpucheck steps --pid N --steps lock,checkpoint,restore,unlock [same flags]
       gpucheck helper-inventory --helper PATH [--pid N]`)
}

func run(args []string, stdout, stderr io.Writer, d deps) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	cmd := args[0]
	fs := flag.NewFlagSet(cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	sysfs := fs.String("sysfs", nvml.DefaultSysfsRoot, "sysfs root")
	lib := fs.String("lib", "", "CUDA driver library (default libcuda.so.1)")
	pid := fs.Int("pid", 0, "host PID of the CUDA process")
	timeout := fs.Duration("timeout", 10*time.Second, "lock timeout")
	bytes := fs.Int64("bytes", 0, "device memory the process holds, in bytes, for GB/s")
	pairs := fs.String("pairs", "", "restore GPU map: GPU-old=GPU-new,...")
	steps := fs.String("steps", "", "comma-separated steps for 'steps'")
	helperPath := fs.String("helper", "", "berth-shim-helper, for 'helper-inventory'")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	switch cmd {
	case "inventory", "fingerprint", "topology":
		return runInventory(cmd, *sysfs, *lib, stdout, d)
	case "helper-inventory":
		if *helperPath == "" {
			fmt.Fprintln(stderr, "gpucheck: helper-inventory needs --helper PATH (berth-shim-helper)")
			return exitUsage
		}
		return runHelperInventory(*helperPath, *pid, stdout, d)
	case "steps":
		return runSteps(strings.Split(*steps, ","), *pid, *lib, *timeout, *bytes, *pairs, stdout, stderr, d)
	default:
		if processSteps[cmd] {
			return runSteps([]string{cmd}, *pid, *lib, *timeout, *bytes, *pairs, stdout, stderr, d)
		}
	}
	fmt.Fprintf(stderr, "gpucheck: unknown command %q\n", cmd)
	usage(stderr)
	return exitUsage
}

func status(err error) int {
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, gpu.ErrUnsupported):
		return exitUnsupported
	}
	return exitFailed
}

func writeJSON(w io.Writer, v any) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func runInventory(cmd, sysfs, lib string, stdout io.Writer, d deps) int {
	start := time.Now()
	snap, err := func() (nvml.Snapshot, error) {
		inv, err := d.openInventory(sysfs)
		if err != nil {
			return nvml.Snapshot{}, err
		}
		defer inv.Close()
		return inv.Snapshot()
	}()
	secs := time.Since(start).Seconds()
	switch cmd {
	case "topology":
		if err != nil {
			fmt.Fprintf(stdout, "error: %v\n", err)
			return status(err)
		}
		fmt.Fprint(stdout, snap.Topology.String())
		return exitOK
	case "fingerprint":
		fp := fingerprint(snap, lib, d)
		if err != nil {
			fp.Error = err.Error()
		}
		writeJSON(stdout, fp)
		return status(err)
	}
	r := InventoryReport{Seconds: secs, Versions: snap.Versions, Devices: snap.Devices}
	if err != nil {
		r.Error = err.Error()
	}
	writeJSON(stdout, r)
	return status(err)
}

func fingerprint(snap nvml.Snapshot, lib string, d deps) Fingerprint {
	fp := Fingerprint{GPUCount: len(snap.Devices), Driver: snap.Versions.Driver, CUDA: snap.Versions.CUDA,
		MemoryPerGPU: []uint64{}, FreePerGPU: []uint64{}}
	for i, dev := range snap.Devices {
		if i == 0 {
			fp.GPUModel, fp.GPUArch = dev.Name, dev.Arch
		}
		fp.MemoryPerGPU = append(fp.MemoryPerGPU, dev.MemoryTotal)
		fp.FreePerGPU = append(fp.FreePerGPU, dev.MemoryFree())
		fp.MIG = fp.MIG || dev.MIG
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		fp.KernelRelease = strings.TrimSpace(string(b))
	}
	start := time.Now()
	drv, err := d.loadDriver(lib)
	fp.CUDALoadSeconds = time.Since(start).Seconds()
	if err != nil {
		fp.CheckpointAPI, fp.UUIDRemap = err.Error(), err.Error()
		return fp
	}
	fp.CheckpointAPI, fp.UUIDRemap = "ok", "ok"
	if v, err := drv.Versions(); err == nil {
		if err := gpu.CheckDriver(v, true); err != nil {
			fp.UUIDRemap = err.Error()
		}
	}
	return fp
}

// parsePairs reads "GPU-a=GPU-b,GPU-c=GPU-d".
func parsePairs(s string) ([]gpu.UUIDPair, error) {
	if s == "" {
		return nil, nil
	}
	var out []gpu.UUIDPair
	for p := range strings.SplitSeq(s, ",") {
		o, n, ok := strings.Cut(p, "=")
		if !ok || o == "" || n == "" {
			return nil, fmt.Errorf("pair %q: want GPU-old=GPU-new", p)
		}
		out = append(out, gpu.UUIDPair{Old: o, New: n})
	}
	return out, nil
}

func runSteps(steps []string, pid int, lib string, timeout time.Duration, bytes int64, pairsFlag string, stdout, stderr io.Writer, d deps) int {
	for _, s := range steps {
		if !processSteps[s] {
			fmt.Fprintf(stderr, "gpucheck: unknown step %q (want state, tid, lock, checkpoint, restore, unlock)\n", s)
			return exitUsage
		}
	}
	if pid <= 0 {
		fmt.Fprintln(stderr, "gpucheck: --pid is required")
		return exitUsage
	}
	pairs, err := parsePairs(pairsFlag)
	if err != nil {
		fmt.Fprintf(stderr, "gpucheck: --pairs: %v\n", err)
		return exitUsage
	}
	rep := ProcessReport{PID: pid, Library: lib, Bytes: bytes, Steps: []StepResult{}}
	if rep.Library == "" {
		rep.Library = "libcuda.so.1"
	}
	start := time.Now()
	drv, err := d.loadDriver(lib)
	rep.LoadSeconds = time.Since(start).Seconds()
	if err != nil {
		rep.Error = err.Error()
		writeJSON(stdout, rep)
		return status(err)
	}
	if v, err := drv.Versions(); err == nil {
		rep.Versions = &v
	}
	var firstErr error
	for _, s := range steps {
		r, err := doStep(drv, s, pid, timeout, pairs)
		if bytes > 0 && err == nil && r.Seconds > 0 && s != "state" && s != "tid" {
			r.GBps = float64(bytes) / r.Seconds / 1e9
		}
		if st, serr := drv.State(pid); serr == nil {
			r.State = st.String()
		}
		rep.Steps = append(rep.Steps, r)
		if err != nil {
			firstErr = err
			rep.Error = fmt.Sprintf("step %s: %v", s, err)
			break
		}
	}
	writeJSON(stdout, rep)
	return status(firstErr)
}

func doStep(drv gpu.Driver, step string, pid int, timeout time.Duration, pairs []gpu.UUIDPair) (StepResult, error) {
	r := StepResult{Step: step}
	start := time.Now()
	var err error
	switch step {
	case "state":
		_, err = drv.State(pid)
	case "tid":
		r.TID, err = drv.RestoreThreadID(pid)
	case "lock":
		err = drv.Lock(pid, timeout)
	case "checkpoint":
		err = drv.Checkpoint(pid)
	case "restore":
		err = drv.Restore(pid, pairs)
	case "unlock":
		err = drv.Unlock(pid)
	}
	r.Seconds = time.Since(start).Seconds()
	if err != nil {
		r.Error = err.Error()
	}
	return r, err
}
