package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// vmSysfs is a 2-CPU, 1-NUMA-node sysfs tree from a real VM.
const vmSysfs = "../../nri/node/testdata/sysfs/vm-2cpu-1numa"

// writeConfig writes a berth-nri config for the VM fixture, without GPUs, with the extra lines.
func writeConfig(t *testing.T, extra string) string {
	t.Helper()
	sysfs, err := filepath.Abs(vmSysfs)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "nri.toml")
	text := fmt.Sprintf("socket = %q\nsysfs_root = %q\ngpu_source = \"none\"\nrefresh_seconds = 0\n%s", filepath.Join(dir, "absent.sock"), sysfs, extra)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestMetricsListener runs berth-nri's wiring with metrics_address set: /metrics answers with the
// plugin's metrics and the Go runtime's while the plugin waits for the runtime's socket, and the
// listener is closed when run returns.
func TestMetricsListener(t *testing.T) {
	addr := freePort(t)
	cfg := writeConfig(t, fmt.Sprintf("metrics_address = %q\n", addr))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"-config", cfg, "-log-level", "warn"}, io.Discard) }()

	url := "http://" + addr + "/metrics"
	var body string
	deadline := time.Now().Add(10 * time.Second)
	for {
		rsp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(rsp.Body)
			rsp.Body.Close()
			// The listener is up before the plugin has built its node model and registered.
			if rsp.StatusCode == http.StatusOK && strings.Contains(string(b), "berth_nri_") {
				body = string(b)
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: no answer within 10 s (last error %v)", url, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, want := range []string{
		`berth_nri_shared_pool_cpus{numa_node="0"} 2`,
		`berth_nri_cpus_held{numa_node="0"} 0`,
		`berth_nri_placements_total{policy="best-effort",result="placed"} 0`,
		"berth_nri_decision_duration_seconds_count 0",
		"go_goroutines ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after cancel")
	}
	if _, err := http.Get(url); err == nil {
		t.Error("/metrics still answers after run returned")
	}
}

// TestRunRefuses: a metrics address that cannot be bound, or a config error, stops berth-nri
// before it serves anything, naming the key.
func TestRunRefuses(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	tests := []struct {
		name, extra, want string
	}{
		{"address in use", fmt.Sprintf("metrics_address = %q\n", busy.Addr()), "metrics_address"},
		{"not an address", "metrics_address = \"9464\"\n", "metrics_address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := run(context.Background(), []string{"-config", writeConfig(t, tt.extra), "-log-level", "warn"}, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("run = %v, want an error naming %s", err, tt.want)
			}
		})
	}
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-config", writeConfig(t, ""), "-check"}, &out); err != nil || !strings.Contains(out.String(), "2 CPUs, NUMA nodes [0], 0 GPUs") {
		t.Fatalf("-check: %v, printed %q", err, out.String())
	}
}
