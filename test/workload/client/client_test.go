package client_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
	"github.com/berth-dev/berth/test/workload/server"
)

var testModel = model.Config{WeightsMiB: 8, Seed: 77}

func newHandler(t *testing.T, cfg server.Config) (*server.Server, *model.Model) {
	t.Helper()
	m, err := model.New(testModel)
	if err != nil {
		t.Fatal(err)
	}
	return server.New(m, cfg), m
}

func serve(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	return ts
}

// dialTo returns a DialContext that ignores its address and dials addr, as a test reaching a
// server inside a network namespace does.
func dialTo(addr string) func(ctx context.Context, network, _ string) (net.Conn, error) {
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
}

func TestStream(t *testing.T) {
	h, m := newHandler(t, server.Config{Delay: time.Second})
	ts := serve(t, h)
	want := model.Words(m.Reference("stream me", 40))
	tests := []struct {
		name   string
		target client.Target
		from   int
	}{
		{"base URL", client.Target{BaseURL: ts.URL}, 0},
		{"host:port only", client.Target{BaseURL: ts.Listener.Addr().String()}, 10},
		{"injected dialer", client.Target{BaseURL: "http://infer.invalid:8080", DialContext: dialTo(ts.Listener.Addr().String())}, 39},
		{"nothing left", client.Target{BaseURL: ts.URL}, 40},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var seen []int
			got, err := client.Stream(context.Background(), tt.target, client.Request{
				Session: "s", Prompt: "stream me", N: 40, From: tt.from, Delay: client.NoDelay,
				OnToken: func(i int, _ string) { seen = append(seen, i) },
			})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, want[tt.from:]) {
				t.Fatalf("got %v, want %v", got, want[tt.from:])
			}
			if len(seen) != 40-tt.from || (len(seen) > 0 && seen[0] != tt.from) {
				t.Errorf("OnToken saw indices %v", seen)
			}
		})
	}
	st, err := client.Stats(context.Background(), client.Target{BaseURL: ts.URL})
	if err != nil {
		t.Fatal(err)
	}
	sum, _ := model.WeightsChecksum(testModel)
	if st.Prefills != 1 || st.Decoded != 40 || st.Sessions != 1 || st.WeightsChecksum != model.FormatChecksum(sum) {
		t.Errorf("stats = %+v", st)
	}
	info, err := client.Session(context.Background(), client.Target{BaseURL: ts.URL}, "s")
	if err != nil || info.Generated != 40 || info.KVEntries != 1+len("stream me")+40 {
		t.Errorf("session = %+v, %v", info, err)
	}
}

// blackhole wraps a connection that, after passing `after` bytes to the reader, delivers nothing
// more until closed: a peer that vanished without a reset.
type blackhole struct {
	net.Conn
	after  int
	closed chan struct{}
	once   sync.Once
}

func (b *blackhole) Read(p []byte) (int, error) {
	if b.after <= 0 {
		<-b.closed
		return 0, net.ErrClosed
	}
	n, err := b.Conn.Read(p[:min(len(p), b.after)])
	b.after -= n
	return n, err
}

func (b *blackhole) Close() error {
	b.once.Do(func() { close(b.closed) })
	return b.Conn.Close()
}

func TestResumeAcrossMigration(t *testing.T) {
	const prompt, n = "migrate me mid-stream", 60
	tests := []struct {
		name string
		// setup returns the first target and the reconnect function; breakAt is called from
		// OnToken with each index.
		setup        func(t *testing.T, h http.Handler) (first client.Target, breakAt func(i int), reconnect client.Reconnect)
		wantAttempts int
	}{
		{
			name: "server connection cut, resumed at a new address",
			setup: func(t *testing.T, h http.Handler) (client.Target, func(int), client.Reconnect) {
				a, b := serve(t, h), serve(t, h) // same process state: b plays the restored container
				return client.Target{BaseURL: a.URL}, func(i int) {
						if i == 20 {
							a.Listener.Close()
							a.CloseClientConnections()
						}
					}, func(ctx context.Context, attempt int, err error) (client.Target, error) {
						if err := client.WaitReady(ctx, client.Target{BaseURL: b.URL}, 10*time.Millisecond); err != nil {
							return client.Target{}, err
						}
						return client.Target{BaseURL: "http://moved.invalid", DialContext: dialTo(b.Listener.Addr().String())}, nil
					}
			},
			wantAttempts: 1,
		},
		{
			name: "connection blackholed, idle timeout",
			setup: func(t *testing.T, h http.Handler) (client.Target, func(int), client.Reconnect) {
				ts := serve(t, h)
				var dials atomic.Int32
				dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
					c, err := dialTo(ts.Listener.Addr().String())(ctx, network, addr)
					if err != nil || dials.Add(1) > 1 {
						return c, err
					}
					return &blackhole{Conn: c, after: 600, closed: make(chan struct{})}, nil
				}
				target := client.Target{BaseURL: "http://infer:8080", DialContext: dial}
				return target, func(int) {}, func(context.Context, int, error) (client.Target, error) { return target, nil }
			},
			wantAttempts: 1,
		},
		{
			name: "cut three times",
			setup: func(t *testing.T, h http.Handler) (client.Target, func(int), client.Reconnect) {
				servers := []*httptest.Server{serve(t, h), serve(t, h), serve(t, h), serve(t, h)}
				cur := 0
				return client.Target{BaseURL: servers[0].URL}, func(i int) {
						if i == 5 || i == 20 || i == 40 {
							servers[cur].CloseClientConnections()
						}
					}, func(ctx context.Context, attempt int, err error) (client.Target, error) {
						cur = attempt
						return client.Target{BaseURL: servers[cur].URL}, nil
					}
			},
			wantAttempts: 3,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, m := newHandler(t, server.Config{Delay: 2 * time.Millisecond})
			want := model.Words(m.Reference(prompt, n))
			first, breakAt, reconnect := tt.setup(t, h)
			var attempts []error
			got, err := client.Resume(context.Background(), first, client.Request{
				Session: "m", Prompt: prompt, N: n, IdleTimeout: 300 * time.Millisecond, OnToken: func(i int, _ string) { breakAt(i) },
			}, func(ctx context.Context, attempt int, err error) (client.Target, error) {
				attempts = append(attempts, err)
				return reconnect(ctx, attempt, err)
			})
			if err != nil {
				t.Fatalf("Resume: %v (after %d tokens)", err, len(got))
			}
			if !slices.Equal(got, want) {
				t.Fatalf("resumed stream differs from an uninterrupted one:\n got %v\nwant %v", got, want)
			}
			if len(attempts) != tt.wantAttempts {
				t.Errorf("reconnected %d times (%v), want %d", len(attempts), attempts, tt.wantAttempts)
			}
			if tt.name == "connection blackholed, idle timeout" && (len(attempts) == 0 || !errors.Is(attempts[0], client.ErrIdle)) {
				t.Errorf("break error = %v, want ErrIdle", attempts)
			}
			st := m.Stats()
			if st.Prefills != 1 || st.Decoded != n {
				t.Errorf("stats = %+v, want 1 prefill and %d decoded (nothing recomputed)", st, n)
			}
		})
	}
}

func TestResumeGivesUp(t *testing.T) {
	h, _ := newHandler(t, server.Config{})
	ts := serve(t, h)
	target := client.Target{BaseURL: ts.URL}
	if _, err := client.Stream(context.Background(), target, client.Request{Session: "x", Prompt: "one", N: 3}); err != nil {
		t.Fatal(err)
	}
	giveUp := errors.New("no new node")
	tests := []struct {
		name      string
		target    client.Target
		req       client.Request
		reconnect client.Reconnect
		wantCalls int
		check     func(error) bool
	}{
		{
			name:      "conflicting prompt is not retried",
			target:    target,
			req:       client.Request{Session: "x", Prompt: "two", N: 3},
			wantCalls: 0,
			check: func(err error) bool {
				var se *client.StatusError
				return errors.As(err, &se) && se.Code == http.StatusConflict
			},
		},
		{
			name:      "bad range is not retried",
			target:    target,
			req:       client.Request{Session: "x", N: 3, From: 4},
			wantCalls: 0,
			check:     func(err error) bool { return errors.Is(err, client.ErrInvalidRequest) },
		},
		{
			name:   "reconnect error ends it",
			target: client.Target{BaseURL: "http://gone.invalid", DialContext: func(context.Context, string, string) (net.Conn, error) { return nil, errors.New("refused") }},
			req:    client.Request{Session: "y", N: 3},
			reconnect: func(context.Context, int, error) (client.Target, error) {
				return client.Target{}, giveUp
			},
			wantCalls: 1,
			check:     func(err error) bool { return errors.Is(err, giveUp) },
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			calls := 0
			_, err := client.Resume(context.Background(), tt.target, tt.req, func(ctx context.Context, attempt int, err error) (client.Target, error) {
				calls++
				if tt.reconnect == nil {
					return tt.target, nil
				}
				return tt.reconnect(ctx, attempt, err)
			})
			if !tt.check(err) {
				t.Errorf("unexpected error %v", err)
			}
			if calls != tt.wantCalls {
				t.Errorf("reconnect called %d times, want %d", calls, tt.wantCalls)
			}
		})
	}
}

func TestWaitReady(t *testing.T) {
	h, _ := newHandler(t, server.Config{})
	ts := serve(t, h)
	if err := client.WaitReady(context.Background(), client.Target{BaseURL: ts.URL}, 0); err != nil {
		t.Errorf("WaitReady on a live server: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := client.WaitReady(ctx, client.Target{BaseURL: addr}, 20*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitReady on a closed port = %v, want deadline exceeded", err)
	}
}
