package transfer

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/transfer/frame"
)

// BenchmarkPageRelay streams BERTH_BENCH_RELAY_MIB (default 256) MiB through a PageRelay to a
// Receiver whose page server is a stand-in that discards the stream (`cat`), over plain
// loopback TCP and over mutual TLS: the Go part of a copy-mode page stream, without CRIU.
// Metrics: MB/s of the stream, cpu-s/GiB (this process's CPU time, the relay's and the
// receiver's, per GiB streamed), and relay/raw, the stream's time against one plain loopback TCP
// copy of the same bytes to a `cat` of the same kind, measured in the same run.
func BenchmarkPageRelay(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("the relay accepts only root's CRIU")
	}
	mib, data, sink := benchStreamSetup(b)
	raw := rawLoopback(b, data, mib)
	ca := newTestCA(b, "bench-ca")
	srv, cli := ca.node(b, "receiver"), ca.node(b, "sender")
	for _, tc := range []struct {
		name     string
		srv, cli *tls.Config
	}{{"plain", nil, nil}, {"tls", serverTLS(b, srv), clientTLS(b, cli)}} {
		b.Run(tc.name, func(b *testing.B) {
			addr, _ := serve(b, &Receiver{Root: b.TempDir(), NoSync: true, CRIU: sink}, tc.srv)
			var total time.Duration
			cpu0 := cpuTime(b)
			for range b.N {
				conn, err := Dial(context.Background(), addr, tc.cli)
				if err != nil {
					b.Fatal(err)
				}
				relay, err := StartPageRelay(context.Background(), conn, fmt.Sprintf("bench-%d", time.Now().UnixNano()))
				if err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				c, err := net.Dial("tcp", relay.Addr())
				if err != nil {
					b.Fatal(err)
				}
				for range mib / 4 {
					if _, err := c.Write(data); err != nil {
						b.Fatal(err)
					}
				}
				_ = c.(*net.TCPConn).CloseWrite()
				_, _ = io.Copy(io.Discard, c)
				c.Close()
				if _, err := relay.Wait(context.Background()); err != nil {
					b.Fatal(err)
				}
				total += time.Since(start)
			}
			per := total / time.Duration(b.N)
			b.ReportMetric((cpuTime(b)-cpu0).Seconds()/float64(b.N)/(float64(mib)/1024), "cpu-s/GiB")
			b.ReportMetric(float64(mib<<20)/per.Seconds()/1e6, "MB/s")
			b.ReportMetric(per.Seconds()/raw.Seconds(), "relay/raw")
		})
	}
}

// cpuTime is this process's CPU time so far, user and system: the relay's and the receiver's
// (the page server stand-in, a child, not included).
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rawLoopback returns the time one plain loopback TCP stream of mib MiB from data takes into a
// reader that discards it.
func rawLoopback(b *testing.B, data []byte, mib int) time.Duration {
	ours, theirs, err := loopbackPair()
	if err != nil {
		b.Fatal(err)
	}
	defer ours.Close()
	done := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, theirs); theirs.Close(); close(done) }()
	start := time.Now()
	for range mib / 4 {
		if _, err := ours.Write(data); err != nil {
			b.Fatal(err)
		}
	}
	_ = ours.(*net.TCPConn).CloseWrite()
	<-done
	return time.Since(start)
}

// BenchmarkPageBridge streams BERTH_BENCH_RELAY_MIB (default 256) MiB of frames, as the shim's
// armed relay writes them, through an agent's BridgePages from a unix socket to a Receiver over
// mutual TLS whose page server is a stand-in that discards the stream (`cat`): the agent's and the
// receiver's part of a `kubectl berth move` page stream, without CRIU and the shim's digest.
// Metrics: MB/s and cpu-s/GiB (this process's CPU time: the test's framing writer, the bridge and
// the receiver).
func BenchmarkPageBridge(b *testing.B) {
	mib, data, sink := benchStreamSetup(b)
	ca := newTestCA(b, "bench-ca")
	addr, _ := serve(b, &Receiver{Root: b.TempDir(), NoSync: true, CRIU: sink}, serverTLS(b, ca.node(b, "receiver")))
	cli := clientTLS(b, ca.node(b, "sender"))
	var total time.Duration
	cpu0 := cpuTime(b)
	for range b.N {
		conn, err := Dial(context.Background(), addr, cli)
		if err != nil {
			b.Fatal(err)
		}
		if err := AnnouncePages(conn, fmt.Sprintf("bench-%d", time.Now().UnixNano()), "blake3", ""); err != nil {
			b.Fatal(err)
		}
		shim, agent := unixPair(b)
		start := time.Now()
		go func() {
			src := io.MultiReader(func() []io.Reader {
				rs := make([]io.Reader, mib/4)
				for i := range rs {
					rs[i] = bytes.NewReader(data)
				}
				return rs
			}()...)
			_, _ = frame.Write(shim, src, nopHash{})
			_ = shim.(*net.UnixConn).CloseWrite()
		}()
		done := make(chan struct{})
		go func() { _, _ = io.Copy(io.Discard, shim); close(done) }()
		if _, err := BridgePages(context.Background(), conn, agent); err != nil {
			b.Fatal(err)
		}
		<-done
		shim.Close()
		total += time.Since(start)
	}
	per := total / time.Duration(b.N)
	b.ReportMetric((cpuTime(b)-cpu0).Seconds()/float64(b.N)/(float64(mib)/1024), "cpu-s/GiB")
	b.ReportMetric(float64(mib<<20)/per.Seconds()/1e6, "MB/s")
}

// unixPair returns both ends of a connected unix socket, as the shim's relay and an agent hold.
func unixPair(b *testing.B) (net.Conn, net.Conn) {
	ln, err := net.Listen("unix", filepath.Join(b.TempDir(), "s"))
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		b.Fatal(err)
	}
	return c, s
}

// benchStreamSetup returns what the page-stream benchmarks share: the stream's size in MiB
// (BERTH_BENCH_RELAY_MIB, default 256), 4 MiB of patterned bytes to send repeatedly, and the path
// of a stand-in for criu whose page server reads the stream from fd 3, discards it and answers ok.
func benchStreamSetup(b *testing.B) (mib int, data []byte, sink string) {
	b.Helper()
	mib = 256
	if s := os.Getenv("BERTH_BENCH_RELAY_MIB"); s != "" {
		if _, err := fmt.Sscan(s, &mib); err != nil {
			b.Fatalf("BERTH_BENCH_RELAY_MIB=%q: %v", s, err)
		}
	}
	data = make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	sink = filepath.Join(b.TempDir(), "criu")
	if err := os.WriteFile(sink, []byte("#!/bin/sh\ncat <&3 >/dev/null && printf ok >&3\n"), 0o700); err != nil {
		b.Fatal(err)
	}
	return mib, data, sink
}
