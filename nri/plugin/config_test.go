package plugin_test

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/berth-dev/berth/gpu/topology"
	"github.com/berth-dev/berth/nri/node"
	"github.com/berth-dev/berth/nri/plugin"
)

// TestContribConfigIsTheDefault: the documented file states exactly the defaults.
func TestContribConfigIsTheDefault(t *testing.T) {
	got, err := plugin.LoadConfig("../../contrib/nri/berth-nri.toml", true)
	if err != nil {
		t.Fatal(err)
	}
	want := plugin.DefaultConfig()
	got.GPUUUIDs, got.GPUAnnotationNamespaces = nil, nil // [] in the file, nil by default
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("contrib/nri/berth-nri.toml = %+v\ndefaults = %+v", got, want)
	}
}

// TestContribConfigDocumentsEveryKey: every key of Config is set in contrib/nri/berth-nri.toml,
// under a comment that says what it does.
func TestContribConfigDocumentsEveryKey(t *testing.T) {
	const path = "../../contrib/nri/berth-nri.toml"
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	documented := map[string]bool{} // key -> its block of lines (up to a blank one) has a comment
	commented := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "":
			commented = false
		case strings.HasPrefix(line, "#"):
			commented = true
		default:
			if key, _, ok := strings.Cut(line, "="); ok {
				documented[strings.TrimSpace(key)] = commented
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	typ := reflect.TypeFor[plugin.Config]()
	for i := range typ.NumField() {
		key, _, _ := strings.Cut(typ.Field(i).Tag.Get("toml"), ",")
		if key != "" && key != "-" && !documented[key] {
			t.Errorf("%s: key %s (Config.%s) is not set under a comment", path, key, typ.Field(i).Name)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(text string) string {
		p := filepath.Join(dir, "c.toml")
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if c, err := plugin.LoadConfig(filepath.Join(dir, "absent.toml"), false); err != nil || c.Policy != "best-effort" {
		t.Fatalf("absent default file: %+v %v", c, err)
	}
	if _, err := plugin.LoadConfig(filepath.Join(dir, "absent.toml"), true); err == nil {
		t.Fatal("absent explicit file accepted")
	}
	c, err := plugin.LoadConfig(write("policy = \"single-numa-node\"\nreserved_cpus = \"0,112\"\ncdi = true\n"), true)
	if err != nil || c.Policy != "single-numa-node" || !c.CDI || !reflect.DeepEqual(c.Reserved(), []int{0, 112}) || c.Socket != "/var/run/nri/nri.sock" {
		t.Fatalf("LoadConfig = %+v, %v", c, err)
	}
	for _, addr := range []string{"", ":9464", "[::1]:0", "0.0.0.0:65535"} {
		if c, err := plugin.LoadConfig(write("metrics_address = \""+addr+"\"\n"), true); err != nil || c.MetricsAddress != addr {
			t.Errorf("metrics_address %q: %+v, %v", addr, c.MetricsAddress, err)
		}
	}
	bad := []struct{ text, want string }{
		{`policy = "tight"`, `unknown NUMA policy "tight"`},
		{`reserved_cpus = "0-x"`, "reserved_cpus"},
		{`plugin_index = "4"`, "plugin_index"},
		{`sysfs_root = "sys"`, "absolute"},
		{`gpu_source = "magic"`, "gpu_source"},
		{`gpu_source = "file"`, "needs topology_file"},
		{`gpu_uuids = ["GPU-a"]`, "set topology_file too"},
		{"gpu_uuids = [\"GPU-a\"]\ngpu_uuids_file = \"/x\"\ntopology_file = \"/t\"", "at most one"},
		{`refresh_seconds = -1`, "refresh_seconds"},
		{`metrics_address = "9464"`, "want host:port"},
		{`metrics_address = "127.0.0.1:http"`, "not a number"},
		{`metrics_address = "127.0.0.1:65536"`, "not a number"},
		{`metrics_address = ":-1"`, "not a number"},
		{`polcy = "none"`, "unknown keys"},
		{`policy = `, "parse berth-nri config"},
	}
	for _, b := range bad {
		if _, err := plugin.LoadConfig(write(b.text), true); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("%q: %v, want an error containing %q", b.text, err, b.want)
		}
	}
}

const vmSysfs = "../node/testdata/sysfs/vm-2cpu-1numa"

// fakeTopology is two GPUs joined by NVLink, one close to each CPU of the 2-CPU VM fixture.
const fakeTopology = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n" +
	"GPU0\t X \tNV4\t0\t0\n" +
	"GPU1\tNV4\t X \t1\t0\n"

func TestLoadNode(t *testing.T) {
	dir := t.TempDir()
	file := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg := plugin.DefaultConfig()
	cfg.SysfsRoot, _ = filepath.Abs(vmSysfs)
	cfg.GPUSource = "none"
	n, fp, err := plugin.LoadNode(cfg)
	if err != nil || n.NumGPUs() != 0 || len(n.CPUs) != 2 || fp == "" {
		t.Fatalf("CPUs only: %v %q %v", n, fp, err)
	}

	cfg.GPUSource = "file"
	cfg.TopologyFile = file("topo.txt", fakeTopology)
	cfg.GPUUUIDsFile = file("uuids.txt", "GPU-aaaa\n\nGPU-bbbb\n")
	n, fp2, err := plugin.LoadNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n.NumGPUs() != 2 || n.GPUUUID(1) != "GPU-bbbb" || fp2 == fp {
		t.Fatalf("with GPUs: %d GPUs, UUID %q, fingerprint changed %v", n.NumGPUs(), n.GPUUUID(1), fp2 != fp)
	}
	if _, again, _ := plugin.LoadNode(cfg); again != fp2 {
		t.Fatal("fingerprint not stable")
	}

	bad := []struct {
		name, topo, uuids string
		want              error
		text              string
	}{
		{"truncated", "\tGPU0\tGPU1\tCPU Affinity\nGPU0\tX\tNV4\t0\nGPU1\tNV4\n", "", topology.ErrTruncated, "truncated"},
		{"empty", "", "", topology.ErrEmpty, "no topology matrix"},
		{"offline CPU", strings.Replace(fakeTopology, "\t1\t0\n", "\t7\t0\n", 1), "", node.ErrInconsistent, "CPU 7, which is not online"},
		{"NUMA node absent", strings.Replace(fakeTopology, "\t1\t0\n", "\t1\t3\n", 1), "", node.ErrInconsistent, "NUMA node 3"},
		{"UUID count", fakeTopology, "GPU-aaaa\n", node.ErrInconsistent, "2 GPUs but 1 UUIDs"},
		{"duplicate UUID", fakeTopology, "GPU-aaaa\nGPU-aaaa\n", node.ErrInconsistent, "same UUID"},
	}
	for _, b := range bad {
		t.Run(b.name, func(t *testing.T) {
			c := cfg
			c.TopologyFile = file("bad.txt", b.topo)
			c.GPUUUIDsFile = ""
			if b.uuids != "" {
				c.GPUUUIDsFile = file("bad-uuids.txt", b.uuids)
			}
			_, _, err := plugin.LoadNode(c)
			if !errors.Is(err, b.want) || !strings.Contains(err.Error(), b.text) {
				t.Fatalf("LoadNode = %v, want %v containing %q", err, b.want, b.text)
			}
		})
	}
	c := cfg
	c.TopologyFile = filepath.Join(dir, "missing.txt")
	if _, _, err := plugin.LoadNode(c); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing topology file: %v", err)
	}
	// auto without a topology file and without NVML (no driver here): CPUs only, no error.
	c = plugin.DefaultConfig()
	c.SysfsRoot = cfg.SysfsRoot
	if n, _, err := plugin.LoadNode(c); err != nil {
		t.Fatalf("auto: %v", err)
	} else {
		t.Logf("auto on this machine: %d GPUs", n.NumGPUs())
	}
}
