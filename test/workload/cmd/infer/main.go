// Command infer is the test inference workload that berth's end-to-end tests checkpoint on one
// node and restore on another: it loads a model (package model) and serves it over HTTP
// (package server) until SIGINT or SIGTERM.
//
// Usage:
//
//	infer [-listen :8080] [-weights-mib 256] [-seed 1] [-vocab 1024] [-delay-ms 20] [-gpu]
//
// Once the weights are loaded and the port is bound it prints one line to stdout:
//
//	infer ready listen=ADDR weights_mib=N seed=S vocab=V checksum=HEX [gpus=UUID,...]
//
// With -gpu the weights and KV caches live in the device memory of berth's fake GPU (package
// gpu/fake/fakecuda: the GPUs mounted at /dev/berth-gpu/<i>, GPU 0 used) and token generation
// runs as GPU work, which a checkpoint must lock, checkpoint and restore; the tokens are the
// same as without it.
//
// It builds with CGO_ENABLED=0 into a static binary for a minimal (busybox) image.
//
// What belongs here: flags and wiring only; behaviour lives in the model and server packages.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/berth-dev/berth/gpu/fake/fakecuda"
	"github.com/berth-dev/berth/test/workload/model"
	"github.com/berth-dev/berth/test/workload/server"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "infer:", err)
		stop()
		os.Exit(1)
	}
}

// run parses args, loads the model, serves until ctx ends and returns nil after a clean shutdown,
// or the first error. The ready line goes to stdout, flag usage to stderr.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("infer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", ":8080", "TCP address to serve HTTP on")
	weightsMiB := fs.Int("weights-mib", model.DefaultWeightsMiB, "size of the model weights in MiB")
	seed := fs.Uint64("seed", 1, "seed of the pseudo-random weights")
	vocab := fs.Int("vocab", model.DefaultVocabSize, "vocabulary size in tokens")
	delayMs := fs.Int("delay-ms", int(server.DefaultDelay/time.Millisecond), "pause between streamed tokens in ms (0: none)")
	useGPU := fs.Bool("gpu", false, "keep weights and KV caches in fake GPU device memory")
	gpuDevRoot := fs.String("gpu-dev-root", fakecuda.DefaultDevRoot, "directory of the fake GPUs (with -gpu)")
	gpuSocketDir := fs.String("gpu-socket-dir", fakecuda.DefaultSocketDir, "directory of the fake CUDA control socket (with -gpu)")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("flags: %w", err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("flags: unexpected arguments %q", fs.Args())
	}
	if *delayMs < 0 {
		return fmt.Errorf("flags: -delay-ms %d: want >= 0", *delayMs)
	}

	cfg := server.DefaultConfig()
	var dev model.Device
	if *useGPU {
		gctx, err := fakecuda.InitWith(fakecuda.Options{DevRoot: *gpuDevRoot, SocketDir: *gpuSocketDir})
		if err != nil {
			return fmt.Errorf("gpu: %w", err)
		}
		defer gctx.Close()
		dev = gpuDevice{gctx}
		cfg.GPUs = gctx.UUIDs
	}
	m, err := model.NewOn(model.Config{WeightsMiB: *weightsMiB, Seed: *seed, VocabSize: *vocab}, dev)
	if err != nil {
		return fmt.Errorf("load model: %w", err)
	}
	cfg.Delay = time.Duration(*delayMs) * time.Millisecond
	// Plain TCP, not MPTCP (Go's default for listeners since 1.24): CRIU cannot dump MPTCP sockets.
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(ctx, "tcp", *listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	srv := &http.Server{Handler: server.New(m, cfg), ReadHeaderTimeout: 10 * time.Second}
	mc := m.Config()
	gpus := ""
	if cfg.GPUs != nil {
		gpus = " gpus=" + strings.Join(cfg.GPUs(), ",")
	}
	fmt.Fprintf(stdout, "infer ready listen=%s weights_mib=%d seed=%d vocab=%d checksum=%s%s\n",
		ln.Addr(), mc.WeightsMiB, mc.Seed, mc.VocabSize, model.FormatChecksum(m.Checksum()), gpus)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	// Streams can last long: give them 2 s, then cut them.
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

// gpuDevice is the model's Device on GPU 0 of a fake CUDA context.
type gpuDevice struct{ c *fakecuda.Context }

func (d gpuDevice) Malloc(bytes int) ([]byte, error) { return d.c.Malloc(0, bytes) }
func (d gpuDevice) Do(f func()) error                { return d.c.Do(f) }
