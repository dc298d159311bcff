package plugin

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/alloc"
)

// DefaultConfigPath is where berth-nri reads its configuration unless told otherwise.
const DefaultConfigPath = "/etc/berth/nri.toml"

// Config is berth-nri's configuration (TOML; contrib/nri/berth-nri.toml documents every key).
type Config struct {
	// Socket is the NRI socket containerd listens on. Default /var/run/nri/nri.sock.
	Socket string `toml:"socket"`
	// PluginName and PluginIndex identify the plugin to NRI ("40-berth"); the two-digit index
	// orders it among plugins. Defaults "berth" and "40".
	PluginName  string `toml:"plugin_name"`
	PluginIndex string `toml:"plugin_index"`
	// Policy is the node's NUMA policy: none, best-effort (default), restricted or
	// single-numa-node; a pod overrides it with the annotation berth.dev/numa-policy.
	Policy string `toml:"policy"`
	// ReservedCPUs are CPU ids never given exclusively (Linux list, "0,112"). Default "".
	ReservedCPUs string `toml:"reserved_cpus"`
	// SysfsRoot is where sysfs is mounted (CPUs and NUMA nodes are read below it). Default /sys.
	SysfsRoot string `toml:"sysfs_root"`
	// GPUSource says where the GPUs come from: "file" (TopologyFile, the output of
	// `nvidia-smi topo -m`, with UUIDs from GPUUUIDs/GPUUUIDsFile), "nvml" (the live node through
	// NVML: UUIDs, device nodes, links, NUMA affinity), "none", or "auto" (default): "file" when
	// TopologyFile is set, else NVML when it loads, else none.
	GPUSource string `toml:"gpu_source"`
	// TopologyFile holds the output of `nvidia-smi topo -m` for this node: the GPUs, their links
	// and their CPU/NUMA affinity. Default "".
	TopologyFile string `toml:"topology_file"`
	// GPUUUIDs are the GPUs' UUIDs in index order ("GPU-..."); GPUUUIDsFile is a file with one
	// UUID per line (`nvidia-smi --query-gpu=uuid --format=csv,noheader`). At most one of the two;
	// without either, GPUs are named by index.
	GPUUUIDs     []string `toml:"gpu_uuids"`
	GPUUUIDsFile string   `toml:"gpu_uuids_file"`
	// CDI gives chosen GPUs as CDI devices ("<cdi_kind>=<uuid or index>"; the runtime must have
	// CDI enabled and a spec for them); false (default) gives device nodes (/dev/nvidiaN,
	// /dev/nvidiactl and the UVM nodes present on the host) and NVIDIA_VISIBLE_DEVICES.
	CDI     bool   `toml:"cdi"`
	CDIKind string `toml:"cdi_kind"`
	// DevRoot is where host device nodes are looked up for their major/minor numbers. Default /dev.
	DevRoot string `toml:"dev_root"`
	// RefreshSeconds is how often the node's inputs (sysfs online CPUs and nodes, the topology
	// and UUID files) are checked for changes, which rebuild the model outside any request.
	// 0 disables. Default 30.
	RefreshSeconds int `toml:"refresh_seconds"`
	// MetricsAddress is the TCP address ("host:port") where berth-nri serves Prometheus metrics
	// at /metrics; "" disables the listener. An empty host listens on every address of the
	// network namespace (a pod's IP in a DaemonSet). Default "127.0.0.1:9464".
	MetricsAddress string `toml:"metrics_address"`
	// GPUAnnotationNamespaces are the Kubernetes namespaces (a pod's sandbox namespace, as CRI
	// reports it) whose containers may ask berth-nri for GPUs with berth.dev/gpus; "*" is every
	// namespace. Default none: under a kubelet GPUs are the device plugin's or a DRA driver's to
	// give, and berth-nri only aligns CPUs and memory to the GPUs a container got; a request for
	// GPUs the container was not given is refused. List "*" on nodes where nothing else
	// allocates GPUs (containerd driven by crictl or another CRI client without a kubelet).
	GPUAnnotationNamespaces []string `toml:"gpu_annotation_namespaces"`
	// TrustVisibleDevicesEnv books the GPUs a container's NVIDIA_VISIBLE_DEVICES names in every
	// namespace, as the NVIDIA container toolkit's accept-nvidia-visible-devices-envvar-when-
	// unprivileged does: for a device plugin with DEVICE_LIST_STRATEGY=envvar, whose containers
	// get no device nodes until the toolkit's runtime adds them. Default false: any pod can set
	// the variable, so outside gpu_annotation_namespaces only device nodes and CDI devices book
	// GPUs (the GPU Operator's default, CDI, gives them).
	TrustVisibleDevicesEnv bool `toml:"trust_visible_devices_env"`
	// RecordKeyFile holds the key (32 random bytes, created mode 0600 with its directory 0700
	// when missing) berth-nri authenticates its berth.dev/placement records with, so that after
	// a restart it believes only records it wrote: a pod can carry an annotation of that name
	// too. Default /var/lib/berth/nri/record.key; "" keeps a key in memory only (records of an
	// earlier run are then re-booked from what the containers hold, as shared).
	RecordKeyFile string `toml:"record_key_file"`
	// MaxAnnotationBytes bounds the value of a berth annotation berth-nri reads; a longer one is
	// refused, quoted only in part. Default 4096.
	MaxAnnotationBytes int `toml:"max_annotation_bytes"`
}

// DefaultConfig returns the configuration used for keys a file does not set.
func DefaultConfig() Config {
	return Config{
		Socket:         "/var/run/nri/nri.sock",
		PluginName:     "berth",
		PluginIndex:    "40",
		Policy:         string(alloc.PolicyBestEffort),
		GPUSource:      "auto",
		SysfsRoot:      "/sys",
		CDIKind:        "nvidia.com/gpu",
		DevRoot:        "/dev",
		RefreshSeconds: 30,
		MetricsAddress: "127.0.0.1:9464",
		RecordKeyFile:  "/var/lib/berth/nri/record.key",

		MaxAnnotationBytes: 4096,
	}
}

// LoadConfig reads the TOML file at path over DefaultConfig and validates it. A missing file is
// an error only when mustExist is set (an explicitly named file). Errors name the file and key.
func LoadConfig(path string, mustExist bool) (Config, error) {
	cfg := DefaultConfig()
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) && !mustExist {
		return cfg, cfg.Validate()
	}
	if err != nil {
		return cfg, fmt.Errorf("read berth-nri config: %w", err)
	}
	dec := toml.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		var strict *toml.StrictMissingError
		if errors.As(err, &strict) {
			return cfg, fmt.Errorf("parse berth-nri config %s: unknown keys:\n%s: %w", path, strict.String(), err)
		}
		return cfg, fmt.Errorf("parse berth-nri config %s: %w", path, err)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, fmt.Errorf("berth-nri config %s: %w", path, err)
	}
	return cfg, nil
}

var pluginIndex = regexp.MustCompile(`^[0-9]{2}$`)

// Validate checks every value and returns an error naming the key and value.
func (c Config) Validate() error {
	if c.Socket == "" {
		return errors.New("socket: must not be empty")
	}
	if c.PluginName == "" {
		return errors.New("plugin_name: must not be empty")
	}
	if !pluginIndex.MatchString(c.PluginIndex) {
		return fmt.Errorf("plugin_index %q: want two digits", c.PluginIndex)
	}
	if _, err := alloc.ParsePolicy(c.Policy); err != nil {
		return fmt.Errorf("policy: %w", err)
	}
	if _, err := topology.ParseIDList(c.ReservedCPUs); err != nil {
		return fmt.Errorf("reserved_cpus: %w", err)
	}
	if !filepath.IsAbs(c.SysfsRoot) {
		return fmt.Errorf("sysfs_root %q: must be an absolute path", c.SysfsRoot)
	}
	if !filepath.IsAbs(c.DevRoot) {
		return fmt.Errorf("dev_root %q: must be an absolute path", c.DevRoot)
	}
	switch c.GPUSource {
	case "auto", "none":
	case "file":
		if c.TopologyFile == "" {
			return errors.New(`gpu_source = "file" needs topology_file`)
		}
	case "nvml":
		if c.TopologyFile != "" {
			return errors.New(`gpu_source = "nvml" reads the live node: unset topology_file`)
		}
	default:
		return fmt.Errorf("gpu_source %q: want auto, file, nvml or none", c.GPUSource)
	}
	if len(c.GPUUUIDs) > 0 && c.GPUUUIDsFile != "" {
		return errors.New("gpu_uuids and gpu_uuids_file: set at most one")
	}
	if (len(c.GPUUUIDs) > 0 || c.GPUUUIDsFile != "") && c.TopologyFile == "" {
		return errors.New("gpu_uuids: set topology_file too (the UUIDs name its GPUs)")
	}
	if c.CDI && c.CDIKind == "" {
		return errors.New("cdi_kind: must not be empty when cdi = true")
	}
	for _, ns := range c.GPUAnnotationNamespaces {
		if ns == "" {
			return errors.New(`gpu_annotation_namespaces: an empty name (use "*" for every namespace)`)
		}
	}
	if c.RecordKeyFile != "" && !filepath.IsAbs(c.RecordKeyFile) {
		return fmt.Errorf("record_key_file %q: must be an absolute path", c.RecordKeyFile)
	}
	if c.MaxAnnotationBytes < 64 {
		return fmt.Errorf("max_annotation_bytes %d: must be at least 64", c.MaxAnnotationBytes)
	}
	if c.RefreshSeconds < 0 {
		return fmt.Errorf("refresh_seconds %d: must be >= 0", c.RefreshSeconds)
	}
	if c.MetricsAddress != "" {
		_, port, err := net.SplitHostPort(c.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics_address %q: want host:port, or \"\" to disable: %w", c.MetricsAddress, err)
		}
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
			return fmt.Errorf("metrics_address %q: port %q is not a number from 0 to 65535", c.MetricsAddress, port)
		}
	}
	return nil
}

// Refresh returns RefreshSeconds as a duration (0: never).
func (c Config) Refresh() time.Duration { return time.Duration(c.RefreshSeconds) * time.Second }

// Reserved returns ReservedCPUs as CPU ids (Validate has checked it parses).
func (c Config) Reserved() []int {
	ids, _ := topology.ParseIDList(c.ReservedCPUs)
	return ids
}

// envGPUsTrusted reports whether NVIDIA_VISIBLE_DEVICES books GPUs for containers of Kubernetes
// namespace ns (TrustVisibleDevicesEnv, or ns may name GPUs by annotation).
func (c Config) envGPUsTrusted(ns string) bool {
	return c.TrustVisibleDevicesEnv || c.gpuAnnotationAllowed(ns)
}

// gpuAnnotationAllowed reports whether containers of Kubernetes namespace ns may ask berth-nri
// for GPUs (GPUAnnotationNamespaces).
func (c Config) gpuAnnotationAllowed(ns string) bool {
	return slices.Contains(c.GPUAnnotationNamespaces, "*") || slices.Contains(c.GPUAnnotationNamespaces, ns)
}
