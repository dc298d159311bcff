// Command berth-nri is berth's NRI plugin: it places every CRI container on NUMA-aligned CPUs
// and memory and link-adjacent GPUs (see package nri/plugin). It runs beside containerd, as a
// host service (contrib/systemd/berth-nri.service) or a DaemonSet
// (contrib/kubernetes/berth-nri-daemonset.yaml).
//
// main only wires: flags, the configuration file (contrib/nri/berth-nri.toml documents every
// key), logging and signals; plugin.Run does the work.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/log"

	"github.com/berth-dev/berth/nri/plugin"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "berth-nri:", err)
		os.Exit(1)
	}
}

func run() error {
	configPath := flag.String("config", plugin.DefaultConfigPath, "configuration file (TOML); a missing default file means the defaults")
	socket := flag.String("socket", "", "NRI socket (overrides the file's socket)")
	policy := flag.String("policy", "", "NUMA policy: none, best-effort, restricted or single-numa-node (overrides the file's policy)")
	level := flag.String("log-level", "info", "log level: debug, info, warn, error")
	check := flag.Bool("check", false, "build the node model, print it and exit (validates the configuration)")
	flag.Parse()

	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "config" })
	cfg, err := plugin.LoadConfig(*configPath, explicit)
	if err != nil {
		return err
	}
	if *socket != "" {
		cfg.Socket = *socket
	}
	if *policy != "" {
		cfg.Policy = *policy
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := log.SetLevel(*level); err != nil {
		return fmt.Errorf("-log-level: %w", err)
	}
	if *check {
		n, _, err := plugin.LoadNode(cfg)
		if err != nil {
			return err
		}
		fmt.Printf("%d CPUs, NUMA nodes %v, %d GPUs (%s); policy %s\n", len(n.CPUs), n.NUMAIDs(), n.NumGPUs(), n.Source, cfg.Policy)
		return nil
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return plugin.Run(ctx, cfg)
}
