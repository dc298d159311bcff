package plugin

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/gpu/nvml"
	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/node"
)

// maxInputFile bounds the topology and UUID files (bytes).
const maxInputFile = 4 << 20

// LoadNode builds the node model cfg describes: CPUs and NUMA nodes from cfg.SysfsRoot, GPUs
// from cfg.GPUSource (see Config). It also returns a fingerprint of the inputs (the sysfs online
// lists, the files' contents or NVML's answers) that changes when the model must be rebuilt.
// Errors name the file or the source.
func LoadNode(cfg Config) (*node.Node, string, error) {
	h := sha256.New()
	for _, f := range []string{"devices/system/cpu/online", "devices/system/node/online"} {
		b, _ := os.ReadFile(filepath.Join(cfg.SysfsRoot, f))
		h.Write(b)
		h.Write([]byte{0})
	}
	n, err := node.ReadSysfs(cfg.SysfsRoot)
	if err != nil {
		return nil, "", err
	}
	var t *topology.Topology
	var devs []gpu.Device
	switch {
	case cfg.GPUSource == "none":
	case cfg.TopologyFile != "":
		if t, devs, err = gpusFromFile(cfg, h); err != nil {
			return nil, "", err
		}
	case cfg.GPUSource == "nvml" || cfg.GPUSource == "auto":
		t, devs, err = gpusFromNVML(cfg)
		if errors.Is(err, nvml.ErrNotLoaded) && cfg.GPUSource == "auto" {
			t, devs, err = nil, nil, nil // no NVIDIA driver here: a node without GPUs
		}
		if err != nil {
			return nil, "", err
		}
		if t != nil {
			h.Write([]byte(t.String()))
			for _, d := range devs {
				h.Write([]byte(d.UUID + strings.Join(d.DevicePaths, ",") + "\n"))
			}
		}
	}
	if t == nil {
		return n, hex.EncodeToString(h.Sum(nil)), nil
	}
	if n, err = n.WithGPUs(t, devs); err != nil {
		return nil, "", fmt.Errorf("GPUs (%s) on this node: %w", cfg.GPUSource, err)
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}

func gpusFromFile(cfg Config, h hash.Hash) (*topology.Topology, []gpu.Device, error) {
	text, err := readBounded(cfg.TopologyFile)
	if err != nil {
		return nil, nil, fmt.Errorf("read topology_file: %w", err)
	}
	h.Write(text)
	t, err := topology.Parse(bytes.NewReader(text))
	if err != nil {
		return nil, nil, fmt.Errorf("topology_file %s: %w", cfg.TopologyFile, err)
	}
	uuids := cfg.GPUUUIDs
	if cfg.GPUUUIDsFile != "" {
		b, err := readBounded(cfg.GPUUUIDsFile)
		if err != nil {
			return nil, nil, fmt.Errorf("read gpu_uuids_file: %w", err)
		}
		h.Write(b)
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if u := strings.TrimSpace(sc.Text()); u != "" && !strings.HasPrefix(u, "#") {
				uuids = append(uuids, u)
			}
		}
	}
	if len(uuids) == 0 {
		return t, nil, nil
	}
	if len(uuids) != len(t.GPUs) {
		return nil, nil, fmt.Errorf("%w: topology_file %s has %d GPUs but %d UUIDs are configured",
			node.ErrInconsistent, cfg.TopologyFile, len(t.GPUs), len(uuids))
	}
	devs := make([]gpu.Device, len(uuids))
	for i, u := range uuids {
		devs[i] = gpu.Device{Index: i, UUID: u, NUMANode: -1}
	}
	return t, devs, nil
}

// gpusFromNVML reads the live node's GPUs; (nil, nil, nil) when NVML sees none.
func gpusFromNVML(cfg Config) (*topology.Topology, []gpu.Device, error) {
	inv, err := nvml.Open(nvml.WithSysfsRoot(cfg.SysfsRoot))
	if err != nil {
		return nil, nil, err
	}
	defer inv.Close()
	devs, err := inv.Devices()
	if err != nil || len(devs) == 0 {
		return nil, nil, err
	}
	t, err := inv.Topology()
	if err != nil {
		return nil, nil, err
	}
	return t, devs, nil
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxInputFile+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(b) > maxInputFile {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxInputFile)
	}
	return b, nil
}

// Run loads the node model, connects to the NRI socket and serves events until ctx is done. When
// the connection drops (containerd restarted) it reconnects every second; each connection starts
// with Synchronize. Every cfg.Refresh() it re-reads the node's inputs and, if they changed,
// rebuilds the model outside any request. opts configure the plugin (WithRegisterer for its
// metrics). It returns nil when ctx is cancelled, or the first error that cannot be retried (the
// model cannot be built, the plugin cannot be created).
func Run(ctx context.Context, cfg Config, opts ...Option) error {
	n, fp, err := LoadNode(cfg)
	if err != nil {
		return fmt.Errorf("build node model: %w", err)
	}
	var cur atomic.Pointer[stub.Stub]
	p, err := New(cfg, n, append(slices.Clone(opts), WithUpdater(func(ups []*api.ContainerUpdate) {
		st := cur.Load()
		if st == nil {
			return
		}
		if failed, err := (*st).UpdateContainers(ups); err != nil || len(failed) > 0 {
			log.G(ctx).WithError(err).WithField("failed", len(failed)).Warn("berth-nri: unsolicited cpuset update failed")
		}
	}))...)
	if err != nil {
		return err
	}
	log.G(ctx).WithField("cpus", len(n.CPUs)).WithField("numa", n.NUMAIDs()).WithField("gpus", n.NumGPUs()).
		WithField("policy", cfg.Policy).WithField("source", n.Source).Info("berth-nri: node model built")
	if cfg.Refresh() > 0 {
		go p.watch(ctx, cfg, fp)
	}
	for {
		s, err := stub.New(p, stub.WithSocketPath(cfg.Socket), stub.WithPluginName(cfg.PluginName),
			stub.WithPluginIdx(cfg.PluginIndex), stub.WithOnClose(func() {
				log.G(ctx).Warn("berth-nri: connection to the runtime closed")
			}))
		if err != nil {
			return fmt.Errorf("create NRI stub: %w", err)
		}
		cur.Store(&s)
		err = s.Run(ctx)
		if ctx.Err() != nil {
			return nil
		}
		log.G(ctx).WithError(err).WithField("socket", cfg.Socket).Warn("berth-nri: not connected; retrying in 1s")
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
	}
}

// watch rebuilds the node model when its inputs change.
func (p *Plugin) watch(ctx context.Context, cfg Config, fp string) {
	t := time.NewTicker(cfg.Refresh())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, next, err := LoadNode(cfg)
		if err != nil {
			log.G(ctx).WithError(err).Warn("berth-nri: node inputs changed but the model cannot be rebuilt; keeping the old one")
			continue
		}
		if next == fp {
			continue
		}
		if err := p.SetNode(ctx, n); err != nil && !errors.Is(err, context.Canceled) {
			log.G(ctx).WithError(err).Warn("berth-nri: cannot use the new node model; keeping the old one")
			continue
		}
		fp = next
	}
}
