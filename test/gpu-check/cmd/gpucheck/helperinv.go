package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/berth-dev/berth/gpu"
)

// helperCalls is how many Devices calls the helper-inventory command times on each side.
const helperCalls = 20

// HelperInventoryReport is the JSON of helper-inventory: the GPU inventory as the shim reads it
// (berth-shim-helper gpu-inventory, package shim/helper) against NVML opened in this process, as
// berthctl reads it. Seconds: NVMLOpen is nvml.OpenInventory here (nvmlInit), HelperOpen the
// helper's start plus its own nvmlInit (what the shim's first GPU call pays), the two Call
// figures the median of helperCalls Devices calls. Compared lists what was compared (devices
// without MemoryUsed, which moves; versions; topology; the device memory of PID), Mismatches what
// differed, with both values.
type HelperInventoryReport struct {
	Helper            string   `json:"helper"`
	NVMLOpenSeconds   float64  `json:"nvmlOpenSeconds"`
	HelperOpenSeconds float64  `json:"helperOpenSeconds"`
	NVMLCallSeconds   float64  `json:"nvmlCallSeconds"`
	HelperCallSeconds float64  `json:"helperCallSeconds"`
	PID               int      `json:"pid"`
	Compared          []string `json:"compared"`
	Mismatches        []string `json:"mismatches,omitempty"`
	Error             string   `json:"error,omitempty"`
}

// runHelperInventory compares the helper's inventory with NVML's in this process and times both.
// pid 0 compares this process's device memory (none).
func runHelperInventory(helperPath string, pid int, stdout io.Writer, d deps) int {
	r := HelperInventoryReport{Helper: helperPath, PID: pid}
	if r.PID == 0 {
		r.PID = os.Getpid()
	}
	err := compareHelperInventory(&r, d)
	if err != nil {
		r.Error = err.Error()
	}
	writeJSON(stdout, r)
	if err == nil && len(r.Mismatches) > 0 {
		return exitFailed
	}
	return status(err)
}

func compareHelperInventory(r *HelperInventoryReport, d deps) error {
	start := time.Now()
	local, err := d.openNVML()
	if err != nil {
		return fmt.Errorf("NVML in this process: %w", err)
	}
	r.NVMLOpenSeconds = time.Since(start).Seconds()
	start = time.Now()
	remote, closeHelper, err := d.openHelper(r.Helper)
	if err != nil {
		return fmt.Errorf("NVML through %s: %w", r.Helper, err)
	}
	defer func() { _ = closeHelper() }()
	r.HelperOpenSeconds = time.Since(start).Seconds()

	compare := func(what string, get func(gpu.Inventory) (any, error)) error {
		a, err := get(local)
		if err != nil {
			return fmt.Errorf("%s in this process: %w", what, err)
		}
		b, err := get(remote)
		if err != nil {
			return fmt.Errorf("%s through the helper: %w", what, err)
		}
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		r.Compared = append(r.Compared, what)
		if string(ja) != string(jb) {
			r.Mismatches = append(r.Mismatches, fmt.Sprintf("%s: here %s, helper %s", what, ja, jb))
		}
		return nil
	}
	steps := []struct {
		what string
		get  func(gpu.Inventory) (any, error)
	}{
		{"devices", func(inv gpu.Inventory) (any, error) {
			devs, err := inv.Devices()
			for i := range devs {
				devs[i].MemoryUsed = 0
			}
			return devs, err
		}},
		{"versions", func(inv gpu.Inventory) (any, error) { return inv.Versions() }},
		{"topology", func(inv gpu.Inventory) (any, error) {
			t, ok := inv.(gpu.Topologist)
			if !ok {
				return nil, nil
			}
			return t.Topology()
		}},
		{"process-memory", func(inv gpu.Inventory) (any, error) { return inv.ProcessMemory(r.PID) }},
	}
	for _, s := range steps {
		if err := compare(s.what, s.get); err != nil {
			return err
		}
	}
	var err2 error
	r.NVMLCallSeconds, err = medianCall(local)
	if err != nil {
		return err
	}
	r.HelperCallSeconds, err2 = medianCall(remote)
	return err2
}

// medianCall times helperCalls Devices calls on inv and returns the median, in seconds.
func medianCall(inv gpu.Inventory) (float64, error) {
	var ts []float64
	for range helperCalls {
		start := time.Now()
		if _, err := inv.Devices(); err != nil {
			return 0, err
		}
		ts = append(ts, time.Since(start).Seconds())
	}
	slices.Sort(ts)
	return ts[len(ts)/2], nil
}
