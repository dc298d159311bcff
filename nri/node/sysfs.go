package node

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-dev/berth/gpu/topology"
)

// DefaultSysfsRoot is where sysfs is mounted on a Linux host.
const DefaultSysfsRoot = "/sys"

// maxSysfsFile bounds how much of one sysfs file is read (bytes); the files read are a few
// hundred bytes, meminfo a few kilobytes.
const maxSysfsFile = 1 << 20

// ReadSysfs reads the CPUs and NUMA nodes of the node whose sysfs is mounted at root ("/sys", or
// a fixture directory holding the same paths). It reads:
//
//   - devices/system/cpu/online: the online CPU ids;
//   - devices/system/cpu/cpu<N>/topology/physical_package_id, core_id and thread_siblings_list
//     for every online CPU (a CPU without a topology directory is its own core on socket 0);
//   - devices/system/node/online, and node<N>/cpulist, node<N>/distance and node<N>/meminfo
//     ("Node <N> MemTotal: <kB> kB") for every online NUMA node. Without devices/system/node (a
//     kernel without NUMA) all CPUs form NUMA node 0 with unknown memory.
//
// The result has no GPUs; add them with WithGPUs. Errors wrap ErrSysfs (a file missing or
// malformed, naming the file) or ErrInconsistent (the files disagree).
func ReadSysfs(root string) (*Node, error) {
	cpuDir := filepath.Join(root, "devices", "system", "cpu")
	nodeDir := filepath.Join(root, "devices", "system", "node")
	online, err := readIDList(filepath.Join(cpuDir, "online"))
	if err != nil {
		return nil, err
	}
	onlineSet := map[int]bool{}
	for _, id := range online {
		onlineSet[id] = true
	}
	cpus := make([]CPU, 0, len(online))
	for _, id := range online {
		c := CPU{ID: id, Siblings: []int{id}}
		topo := filepath.Join(cpuDir, "cpu"+strconv.Itoa(id), "topology")
		if _, err := os.Stat(topo); err == nil {
			if c.Socket, err = readInt(filepath.Join(topo, "physical_package_id")); err != nil {
				return nil, err
			}
			if c.Core, err = readInt(filepath.Join(topo, "core_id")); err != nil {
				return nil, err
			}
			sib, err := readIDList(filepath.Join(topo, "thread_siblings_list"))
			if err != nil {
				return nil, err
			}
			c.Siblings = slices.DeleteFunc(sib, func(s int) bool { return !onlineSet[s] })
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %w", ErrSysfs, err)
		} else {
			c.Core = id
		}
		cpus = append(cpus, c)
	}

	var numa []NUMANode
	if _, err := os.Stat(nodeDir); errors.Is(err, fs.ErrNotExist) {
		numa = []NUMANode{{ID: 0, CPUs: online, Distance: map[int]int{0: 10}}}
	} else {
		ids, err := readIDList(filepath.Join(nodeDir, "online"))
		if err != nil {
			return nil, err
		}
		for _, id := range ids {
			m, err := readNUMANode(filepath.Join(nodeDir, "node"+strconv.Itoa(id)), id, ids, onlineSet)
			if err != nil {
				return nil, err
			}
			numa = append(numa, m)
		}
	}
	owner := map[int]int{}
	for _, m := range numa {
		for _, c := range m.CPUs {
			if o, dup := owner[c]; dup {
				return nil, fmt.Errorf("%w: CPU %d is listed by NUMA nodes %d and %d", ErrInconsistent, c, o, m.ID)
			}
			owner[c] = m.ID
		}
	}
	for i := range cpus {
		o, ok := owner[cpus[i].ID]
		if !ok {
			return nil, fmt.Errorf("%w: online CPU %d is in no NUMA node's cpulist under %s", ErrInconsistent, cpus[i].ID, nodeDir)
		}
		cpus[i].NUMA = o
	}
	n, err := build(cpus, numa, "sysfs "+root)
	if err != nil {
		return nil, fmt.Errorf("read node topology from %s: %w", root, err)
	}
	return n, nil
}

func readNUMANode(dir string, id int, all []int, online map[int]bool) (NUMANode, error) {
	m := NUMANode{ID: id, Distance: map[int]int{}}
	cpus, err := readIDList(filepath.Join(dir, "cpulist"))
	if err != nil {
		return m, err
	}
	m.CPUs = slices.DeleteFunc(cpus, func(c int) bool { return !online[c] })
	dpath := filepath.Join(dir, "distance")
	b, err := readFile(dpath)
	if err != nil {
		return m, err
	}
	fields := strings.Fields(string(b))
	if len(fields) != len(all) {
		return m, fmt.Errorf("%w: %s has %d distances for %d online NUMA nodes (%q)", ErrSysfs, dpath, len(fields), len(all), strings.TrimSpace(string(b)))
	}
	for i, f := range fields {
		d, err := strconv.Atoi(f)
		if err != nil || d <= 0 {
			return m, fmt.Errorf("%w: %s: distance %q is not a positive integer", ErrSysfs, dpath, f)
		}
		m.Distance[all[i]] = d
	}
	mpath := filepath.Join(dir, "meminfo")
	b, err = readFile(mpath)
	if err != nil {
		return m, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		// "Node 0 MemTotal:       11495628 kB"
		f := strings.Fields(sc.Text())
		if len(f) >= 4 && f[0] == "Node" && f[2] == "MemTotal:" {
			kb, err := strconv.ParseUint(f[3], 10, 64)
			if err != nil || kb > 1<<50 {
				return m, fmt.Errorf("%w: %s: MemTotal %q is not a size in kB", ErrSysfs, mpath, f[3])
			}
			m.MemTotal = kb * 1024
			return m, nil
		}
	}
	return m, fmt.Errorf("%w: %s has no \"Node %d MemTotal:\" line", ErrSysfs, mpath, id)
}

func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSysfs, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSysfsFile))
	if err != nil {
		return nil, fmt.Errorf("%w: read %s: %w", ErrSysfs, path, err)
	}
	return b, nil
}

func readIDList(path string) ([]int, error) {
	b, err := readFile(path)
	if err != nil {
		return nil, err
	}
	ids, err := topology.ParseIDList(string(b))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrSysfs, path, err)
	}
	return ids, nil
}

func readInt(path string) (int, error) {
	b, err := readFile(path)
	if err != nil {
		return 0, err
	}
	s := strings.TrimSpace(string(b))
	v, err := strconv.Atoi(s)
	if err != nil || v < -1 || v > topology.MaxID {
		return 0, fmt.Errorf("%w: %s: %q is not an id", ErrSysfs, path, s)
	}
	return v, nil
}

// FromTopology synthesises a node from a GPU topology alone, for planning with a pasted
// `nvidia-smi topo -m` (berthctl plan). Its CPUs are the union of the GPUs' CPU affinities, each
// its own core on the socket of its NUMA node (SMT siblings are not in the text). A CPU belongs
// to the NUMA node of a GPU that lists it and names exactly one NUMA node; otherwise to the
// lowest NUMA node its GPU names; CPUs of GPUs with unknown NUMA affinity form synthetic NUMA
// nodes, one per distinct CPU affinity set, numbered after the highest real id. Distances are 10
// local and 20 remote; memory is unknown. Errors wrap ErrInconsistent (a CPU listed by GPUs on
// two different single NUMA nodes, or no CPU affinity at all) or the topology's ErrMalformed.
func FromTopology(t *topology.Topology) (*Node, error) {
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("model node from GPU topology: %w", err)
	}
	maxReal := -1
	for _, g := range t.GPUs {
		for _, m := range g.NUMA {
			maxReal = max(maxReal, m)
		}
	}
	numaSet := map[int]bool{}
	cpuNUMA := map[int]int{}
	groups := map[string]int{}
	// Pass 1: GPUs with exactly one NUMA node are authoritative for their CPUs.
	for _, g := range t.GPUs {
		for _, m := range g.NUMA {
			numaSet[m] = true
		}
		if len(g.NUMA) != 1 {
			continue
		}
		for _, c := range g.CPUs {
			if prev, ok := cpuNUMA[c]; ok && prev != g.NUMA[0] {
				return nil, fmt.Errorf("model node from GPU topology: %w: CPU %d is close to GPUs on NUMA nodes %d and %d",
					ErrInconsistent, c, prev, g.NUMA[0])
			}
			cpuNUMA[c] = g.NUMA[0]
		}
	}
	// Pass 2: the others fill in CPUs not placed yet.
	for _, g := range t.GPUs {
		if len(g.NUMA) == 1 || len(g.CPUs) == 0 {
			continue
		}
		node := 0
		if len(g.NUMA) > 0 {
			node = g.NUMA[0]
		} else {
			key := topology.FormatIDList(g.CPUs)
			id, ok := groups[key]
			if !ok {
				id = maxReal + 1 + len(groups)
				groups[key] = id
			}
			node = id
		}
		for _, c := range g.CPUs {
			if _, ok := cpuNUMA[c]; !ok {
				cpuNUMA[c] = node
				numaSet[node] = true
			}
		}
	}
	if len(cpuNUMA) == 0 {
		return nil, fmt.Errorf("model node from GPU topology: %w: no GPU lists a CPU affinity, so there are no CPUs to plan with", ErrInconsistent)
	}
	var cpus []CPU
	for c, m := range cpuNUMA {
		cpus = append(cpus, CPU{ID: c, Socket: m, Core: c, NUMA: m, Siblings: []int{c}})
	}
	slices.SortFunc(cpus, func(a, b CPU) int { return a.ID - b.ID })
	var ids []int
	for m := range numaSet {
		ids = append(ids, m)
	}
	slices.Sort(ids)
	numa := make([]NUMANode, len(ids))
	for i, id := range ids {
		numa[i] = NUMANode{ID: id, Distance: map[int]int{}}
		for _, o := range ids {
			numa[i].Distance[o] = 20
		}
		numa[i].Distance[id] = 10
	}
	for _, c := range cpus {
		i := slices.Index(ids, c.NUMA)
		numa[i].CPUs = append(numa[i].CPUs, c.ID)
	}
	n, err := build(cpus, numa, "nvidia-smi topo -m text")
	if err != nil {
		return nil, fmt.Errorf("model node from GPU topology: %w", err)
	}
	return n.WithGPUs(t, nil)
}
