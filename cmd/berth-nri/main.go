// Command berth-nri is berth's NRI plugin: it places every CRI container on NUMA-aligned CPUs
// and memory and link-adjacent GPUs (see package nri/plugin). It runs beside containerd, as a
// host service (contrib/systemd/berth-nri.service) or a DaemonSet
// (contrib/kubernetes/berth-nri-daemonset.yaml).
//
// main only wires: flags, the configuration file (contrib/nri/berth-nri.toml documents every
// key), logging, signals, and the Prometheus registry (the plugin's metrics, Go runtime and
// process metrics) served at metrics_address; plugin.Run does the work.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/berth-dev/berth/nri/plugin"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "berth-nri:", err)
		os.Exit(1)
	}
}

// run is berth-nri with command-line arguments args, until ctx is done.
func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("berth-nri", flag.ContinueOnError)
	configPath := fs.String("config", plugin.DefaultConfigPath, "configuration file (TOML); a missing default file means the defaults")
	socket := fs.String("socket", "", "NRI socket (overrides the file's socket)")
	policy := fs.String("policy", "", "NUMA policy: none, best-effort, restricted or single-numa-node (overrides the file's policy)")
	level := fs.String("log-level", "info", "log level: debug, info, warn, error")
	check := fs.Bool("check", false, "build the node model, print it and exit (validates the configuration)")
	if err := fs.Parse(args); err != nil {
		return err
	}

	explicit := false
	fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "config" })
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
		fmt.Fprintf(stdout, "%d CPUs, NUMA nodes %v, %d GPUs (%s); policy %s\n", len(n.CPUs), n.NUMAIDs(), n.NumGPUs(), n.Source, cfg.Policy)
		return nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var served chan struct{}
	if cfg.MetricsAddress != "" {
		l, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics_address: %w", err)
		}
		log.G(ctx).WithField("address", l.Addr().String()).Info("berth-nri: serving metrics at /metrics")
		served = make(chan struct{})
		go func() {
			defer close(served)
			if err := plugin.ServeMetrics(ctx, l, reg); err != nil {
				log.G(ctx).WithError(err).Error("berth-nri: metrics listener stopped")
			}
		}()
	}
	err = plugin.Run(ctx, cfg, plugin.WithRegisterer(reg))
	cancel()
	if served != nil {
		<-served
	}
	return err
}
