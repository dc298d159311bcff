// Package nodetest writes synthetic sysfs trees (the files node.ReadSysfs reads) for tests and
// benchmarks of berth-nri: any number of sockets, NUMA nodes per socket, cores and SMT threads,
// numbered the way Linux numbers them on Intel (all first threads, then all second threads) or
// on AMD (siblings adjacent).
//
// What belongs here: generators of test inputs for the node model. What does not: reading them
// (package node) or anything a production binary uses.
package nodetest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/node"
)

// Spec describes a synthetic machine. CPU ids: with SiblingsAdjacent, core c's threads are
// c*Threads .. c*Threads+Threads-1; otherwise thread t of core c is t*TotalCores + c (Intel's
// numbering). Cores are numbered socket by socket, NUMA node by NUMA node within a socket.
type Spec struct {
	Sockets, NUMAPerSocket, CoresPerNUMA, Threads int
	// SiblingsAdjacent numbers SMT siblings next to each other (AMD style).
	SiblingsAdjacent bool
	// MemPerNUMA is each NUMA node's memory in kB (meminfo's unit).
	MemPerNUMA uint64
	// Offline lists CPU ids to leave out of cpu/online (and out of the NUMA cpulists).
	Offline []int
}

// TotalCores is the number of cores of the machine.
func (s Spec) TotalCores() int { return s.Sockets * s.NUMAPerSocket * s.CoresPerNUMA }

// TotalCPUs is the number of logical CPUs (online or not).
func (s Spec) TotalCPUs() int { return s.TotalCores() * s.Threads }

// CPUID returns the CPU id of thread t of global core c.
func (s Spec) CPUID(core, thread int) int {
	if s.SiblingsAdjacent {
		return core*s.Threads + thread
	}
	return thread*s.TotalCores() + core
}

// NUMACPUs returns the CPU ids of NUMA node m (online or not), ascending.
func (s Spec) NUMACPUs(m int) []int {
	var ids []int
	for c := m * s.CoresPerNUMA; c < (m+1)*s.CoresPerNUMA; c++ {
		for t := range s.Threads {
			ids = append(ids, s.CPUID(c, t))
		}
	}
	return sorted(ids)
}

// Distance is the NUMA distance the generator writes: 10 local, 12 within a socket, 32 across.
func (s Spec) Distance(a, b int) int {
	switch {
	case a == b:
		return 10
	case a/s.NUMAPerSocket == b/s.NUMAPerSocket:
		return 12
	}
	return 32
}

// WriteSysfs writes the spec's sysfs files under root (root/devices/system/{cpu,node}).
func WriteSysfs(root string, s Spec) error {
	if s.Sockets < 1 || s.NUMAPerSocket < 1 || s.CoresPerNUMA < 1 || s.Threads < 1 {
		return fmt.Errorf("nodetest: invalid spec %+v", s)
	}
	offline := map[int]bool{}
	for _, c := range s.Offline {
		offline[c] = true
	}
	cpuDir := filepath.Join(root, "devices", "system", "cpu")
	nodeDir := filepath.Join(root, "devices", "system", "node")
	var online []int
	coresPerSocket := s.NUMAPerSocket * s.CoresPerNUMA
	for c := range s.TotalCores() {
		var sib []int
		for t := range s.Threads {
			if id := s.CPUID(c, t); !offline[id] {
				sib = append(sib, id)
			}
		}
		for t := range s.Threads {
			id := s.CPUID(c, t)
			if offline[id] {
				continue
			}
			online = append(online, id)
			dir := filepath.Join(cpuDir, "cpu"+strconv.Itoa(id), "topology")
			files := map[string]string{
				"physical_package_id":  strconv.Itoa(c / coresPerSocket),
				"core_id":              strconv.Itoa(c % coresPerSocket),
				"thread_siblings_list": topology.FormatIDList(sib),
			}
			if err := writeFiles(dir, files); err != nil {
				return err
			}
		}
	}
	if err := writeFiles(cpuDir, map[string]string{
		"online":   topology.FormatIDList(online),
		"possible": fmt.Sprintf("0-%d", s.TotalCPUs()-1),
	}); err != nil {
		return err
	}
	nodes := s.Sockets * s.NUMAPerSocket
	if err := writeFiles(nodeDir, map[string]string{"online": fmt.Sprintf("0-%d", nodes-1)}); err != nil {
		return err
	}
	for m := range nodes {
		var cpus, dist []string
		var ids []int
		for _, id := range s.NUMACPUs(m) {
			if !offline[id] {
				ids = append(ids, id)
			}
		}
		cpus = append(cpus, topology.FormatIDList(ids))
		for o := range nodes {
			dist = append(dist, strconv.Itoa(s.Distance(m, o)))
		}
		mem := fmt.Sprintf("Node %d MemTotal:       %d kB\nNode %d MemFree:        %d kB\n", m, s.MemPerNUMA, m, s.MemPerNUMA/2)
		if err := writeFiles(filepath.Join(nodeDir, "node"+strconv.Itoa(m)), map[string]string{
			"cpulist":  strings.Join(cpus, ""),
			"distance": strings.Join(dist, " "),
			"meminfo":  mem,
		}); err != nil {
			return err
		}
	}
	return nil
}

func writeFiles(dir string, files map[string]string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content+"\n"), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func sorted(ids []int) []int {
	for i := 1; i < len(ids); i++ {
		for j := i; j > 0 && ids[j] < ids[j-1]; j-- {
			ids[j], ids[j-1] = ids[j-1], ids[j]
		}
	}
	return ids
}

// Topology returns a GPU topology for spec: gpusPerNUMA GPUs on every NUMA node (GPU i on
// node i/gpusPerNUMA, with that node's CPUs as its CPU affinity) and link(i, j) between GPUs
// i < j.
func Topology(s Spec, gpusPerNUMA int, link func(i, j int) topology.Link) *topology.Topology {
	nodes := s.Sockets * s.NUMAPerSocket
	n := nodes * gpusPerNUMA
	t := &topology.Topology{GPUs: make([]topology.GPU, n), Links: make([][]topology.Link, n)}
	for i := range n {
		m := i / gpusPerNUMA
		t.GPUs[i] = topology.GPU{Index: i, CPUs: s.NUMACPUs(m), NUMA: []int{m}, GPUNUMA: -1}
		t.Links[i] = make([]topology.Link, n)
		for j := range n {
			switch {
			case i == j:
				t.Links[i][j] = topology.Self
			case i < j:
				t.Links[i][j] = link(i, j)
			default:
				t.Links[i][j] = link(j, i)
			}
		}
	}
	return t
}

// DGXH100 is an 8-GPU, 2-socket, 224-CPU node like NVIDIA's DGX H100: 56 cores x 2 threads per
// socket (CPUs 0-55,112-167 on NUMA node 0, 56-111,168-223 on node 1), GPUs 0-3 on node 0 and
// 4-7 on node 1, every GPU pair NV18 through NVSwitch, 1 TiB per NUMA node.
func DGXH100() (Spec, *topology.Topology) {
	s := Spec{Sockets: 2, NUMAPerSocket: 1, CoresPerNUMA: 56, Threads: 2, MemPerNUMA: 1 << 30}
	return s, Topology(s, 4, func(int, int) topology.Link { return topology.NV(18) })
}

// Build writes spec's sysfs under a temporary directory of tb, reads it with node.ReadSysfs
// and adds the GPU topology t (nil: none), failing tb on any error.
func Build(tb testing.TB, s Spec, t *topology.Topology) *node.Node {
	tb.Helper()
	root := tb.TempDir()
	if err := WriteSysfs(root, s); err != nil {
		tb.Fatal(err)
	}
	n, err := node.ReadSysfs(root)
	if err != nil {
		tb.Fatal(err)
	}
	if t != nil {
		if n, err = n.WithGPUs(t, nil); err != nil {
			tb.Fatal(err)
		}
	}
	return n
}
