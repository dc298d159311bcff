// Package e2e holds berth's end-to-end tests and benchmarks on the real stack: two local
// containerd v2.4 nodes with runc, CRIU and berth's shim, images built locally; and, for the
// Kube* tests, a two-node Kubernetes cluster built from Go modules (node.StartKube: etcd,
// kube-apiserver, controller-manager, scheduler, kubelets, NFD) over such nodes.
//
// They need root and the stack (`make deps`). Without them they skip, except under CI=true,
// where a missing prerequisite fails the run: CI must run every tier this machine can run.
package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"testing"

	"github.com/berth-dev/berth/test/node"
)

var cluster *node.Cluster

// exiting is held by whoever tears the run down: the signal handler, or TestMain after the tests.
// The other then waits (the handler exits the process), so the two never clean up at once.
var exiting sync.Mutex

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if err := node.Require(); err != nil {
		if os.Getenv("CI") != "" {
			fmt.Fprintln(os.Stderr, "e2e: CI=true but", err)
			return 1
		}
		fmt.Fprintln(os.Stderr, "e2e: skipping:", err)
		return m.Run() // every test skips through needCluster
	}
	dir, err := os.MkdirTemp("/var/tmp", "berth-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if os.Getenv("BERTH_E2E_KEEP") == "" {
		defer os.RemoveAll(dir)
	} else {
		fmt.Fprintln(os.Stderr, "e2e: keeping", dir)
	}
	ctx := context.Background()
	cluster, err = node.StartClusterWith(ctx, dir, 2, node.Options{FakeGPUs: 2})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: start cluster:", err)
		return 1
	}
	// every berthctl the tests run signs and verifies with the cluster's operator configuration
	os.Setenv(node.EnvShimConfig, cluster.BerthctlConfig)
	// an interrupted run (Ctrl-C, a CI timeout) must not leave two containerd nodes behind
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-sigs
		exiting.Lock()
		fmt.Fprintf(os.Stderr, "e2e: %v: stopping the nodes\n", s)
		stopKube(false)
		cluster.Stop(context.Background())
		os.RemoveAll(dir)
		os.Exit(2)
	}()
	code := m.Run()
	exiting.Lock()
	stopKube(code != 0)
	if os.Getenv("BERTH_E2E_KEEP") == "" || code == 0 {
		cluster.Stop(ctx)
	}
	return code
}

func needCluster(t testing.TB) *node.Cluster {
	t.Helper()
	if cluster == nil {
		err := node.Require()
		if err == nil {
			err = errors.New("cluster did not start")
		}
		t.Skip(err)
	}
	return cluster
}
