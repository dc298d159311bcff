package shim

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// checkpointCRIU returns the PIDs of the CRIU processes that runc's checkpoint of task id runs
// for the shim whose PID is self: a child of self whose command line is runc's "checkpoint"
// of id (its last argument), and that process's descendants named "criu". Facts come from
// procRoot ("/proc" on a node): each PID's stat (the parent PID, the name) and cmdline. Processes
// that end while it reads are skipped; none found is an empty slice.
func checkpointCRIU(procRoot string, self int, id string) []int {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	names := map[int]string{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(procRoot, e.Name(), "stat"))
		if err != nil {
			continue
		}
		// "PID (NAME) STATE PPID ...": NAME may hold spaces and parentheses; it ends at the last ')'
		open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
		if open < 0 || end < open {
			continue
		}
		f := strings.Fields(string(b[end+1:]))
		if len(f) < 2 {
			continue
		}
		ppid, err := strconv.Atoi(f[1])
		if err != nil {
			continue
		}
		children[ppid] = append(children[ppid], pid)
		names[pid] = string(b[open+1 : end])
	}
	var out []int
	for _, runc := range children[self] {
		b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(runc), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		isCheckpoint := false
		for _, a := range args[1:] {
			if a == "checkpoint" {
				isCheckpoint = true
			}
		}
		if !isCheckpoint || args[len(args)-1] != id {
			continue
		}
		for queue := children[runc]; len(queue) > 0; queue = queue[1:] {
			pid := queue[0]
			if names[pid] == "criu" {
				out = append(out, pid)
			}
			queue = append(queue, children[pid]...)
		}
	}
	return out
}
