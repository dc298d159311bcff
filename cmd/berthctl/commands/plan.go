package commands

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/plan"
	"github.com/berth-dev/berth/nri/plugin"
)

// Plan is `berthctl plan`.
func Plan() *cobra.Command {
	var (
		topoFile, sysfs, policy, occupied, occupiedCPUs, reserved string
		gpus, cpus                                                int
		output                                                    *format
	)
	cmd := &cobra.Command{
		Use:   "plan --topology FILE --gpus N [--cpus M] [--policy P] [--occupied 0,3] [-o text|json]",
		Short: "Show where berth-nri would place a container on a node described by `nvidia-smi topo -m` text",
		Long: "plan reads a node from the text `nvidia-smi topo -m` prints (paste your own) and prints the GPUs,\n" +
			"CPUs and NUMA nodes berth-nri would give a container, and why. Without --sysfs the CPUs are\n" +
			"those of the GPUs' CPU affinity (no SMT information); with --sysfs DIR they come from that\n" +
			"sysfs tree (this node: /sys). -o json prints the GPU indices, CPU ids and NUMA node ids.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			for _, n := range []struct {
				flag string
				v    int
			}{{"--gpus", gpus}, {"--cpus", cpus}} {
				if n.v < 0 {
					return fmt.Errorf("%s %d: must not be negative", n.flag, n.v)
				}
			}
			pol, err := alloc.ParsePolicy(policy)
			if err != nil {
				return fmt.Errorf("--policy: %w", err)
			}
			req := plan.Request{GPUs: gpus, ExclusiveCPUs: cpus, Policy: pol}
			for _, l := range []struct {
				flag, s string
				dst     *[]int
			}{{"--occupied", occupied, &req.OccupiedGPUs}, {"--occupied-cpus", occupiedCPUs, &req.OccupiedCPUs}, {"--reserved-cpus", reserved, &req.ReservedCPUs}} {
				if *l.dst, err = topology.ParseIDList(l.s); err != nil {
					return fmt.Errorf("%s: %w", l.flag, err)
				}
			}
			n, err := planNode(topoFile, sysfs)
			if err != nil {
				return err
			}
			res, err := plan.Plan(n, req)
			if err != nil {
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			res.WriteText(cmd.OutOrStdout())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&topoFile, "topology", "", "file with the output of `nvidia-smi topo -m` (required)")
	f.StringVar(&sysfs, "sysfs", "", "sysfs root to take the CPUs and NUMA nodes from (default: the topology's CPU affinity)")
	f.IntVar(&gpus, "gpus", 0, "GPUs to choose")
	f.IntVar(&cpus, "cpus", 0, "exclusive CPUs (0: the container shares the pool)")
	f.StringVar(&policy, "policy", string(alloc.PolicyBestEffort), "NUMA policy: none, best-effort, restricted, single-numa-node")
	f.StringVar(&occupied, "occupied", "", "GPU indices already taken (\"0,3\")")
	f.StringVar(&occupiedCPUs, "occupied-cpus", "", "CPU ids already held exclusively (\"0-7\")")
	f.StringVar(&reserved, "reserved-cpus", "", "CPU ids never given exclusively")
	output = addFormat(f, formatText, formatJSON)
	_ = cmd.MarkFlagRequired("topology")
	return cmd
}

// planNode reads the topology file and builds the node berthctl plan works on.
func planNode(topoFile, sysfs string) (*node.Node, error) {
	t, err := readTopology(topoFile)
	if err != nil {
		return nil, err
	}
	if sysfs == "" {
		n, err := node.FromTopology(t)
		if err != nil {
			return nil, fmt.Errorf("--topology %s: %w", topoFile, err)
		}
		return n, nil
	}
	n, err := node.ReadSysfs(sysfs)
	if err != nil {
		return nil, fmt.Errorf("--sysfs: %w", err)
	}
	return n.WithGPUs(t, nil)
}

// readTopology reads the `nvidia-smi topo -m` text of --topology.
func readTopology(file string) (*topology.Topology, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("--topology: %w", err)
	}
	defer f.Close()
	t, err := topology.Parse(f)
	if err != nil {
		return nil, fmt.Errorf("--topology %s: %w", file, err)
	}
	return t, nil
}

// Topology is `berthctl topology`.
func Topology() *cobra.Command {
	var (
		topoFile, sysfs, source string
		output                  *format
	)
	cmd := &cobra.Command{
		Use:   "topology [--topology FILE] [--sysfs /sys] [-o text|json]",
		Short: "Show this node's model as berth-nri sees it: CPUs, NUMA nodes, memory, GPUs and their links",
		Long: "topology builds the node model berth-nri would build: CPUs and NUMA nodes from sysfs, GPUs from\n" +
			"--topology (`nvidia-smi topo -m` text) or, without it, from NVML when the NVIDIA driver is\n" +
			"present (--gpu-source). On a machine without GPUs it shows CPUs and NUMA nodes only.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case source != "auto" && source != "file" && source != "nvml" && source != "none":
				return fmt.Errorf("--gpu-source %q: want auto, file, nvml or none", source)
			case source == "file" && topoFile == "":
				return errors.New("--gpu-source file needs --topology")
			case source == "nvml" && topoFile != "":
				return errors.New("--gpu-source nvml reads the live node: drop --topology")
			}
			cfg := plugin.DefaultConfig()
			abs, err := filepath.Abs(sysfs)
			if err != nil {
				return fmt.Errorf("--sysfs %s: %w", sysfs, err)
			}
			cfg.SysfsRoot, cfg.TopologyFile, cfg.GPUSource = abs, topoFile, source
			if topoFile != "" && source == "auto" {
				cfg.GPUSource = "file"
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			// check what the flags name first, so that an error names the flag, not the NRI
			// plugin's configuration key
			if _, err := node.ReadSysfs(abs); err != nil {
				return fmt.Errorf("--sysfs: %w", err)
			}
			if topoFile != "" {
				if _, err := readTopology(topoFile); err != nil {
					return err
				}
			}
			n, _, err := plugin.LoadNode(cfg)
			if err != nil {
				return fmt.Errorf("--gpu-source %s: %w", cfg.GPUSource, err)
			}
			m := plan.Describe(n)
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), m)
			}
			m.WriteText(cmd.OutOrStdout())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&topoFile, "topology", "", "file with the output of `nvidia-smi topo -m` (default: NVML when present)")
	f.StringVar(&sysfs, "sysfs", node.DefaultSysfsRoot, "sysfs root")
	f.StringVar(&source, "gpu-source", "auto", "GPUs from: auto, file, nvml, none")
	output = addFormat(f, formatText, formatJSON)
	return cmd
}
