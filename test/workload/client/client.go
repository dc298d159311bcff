// Package client is the Go client that end-to-end tests use to talk to the test inference
// workload (package server, run as cmd/infer): stream a session's tokens, resume a stream that
// broke because its container was checkpointed and restored elsewhere, and read the workload's
// stats.
//
// Every call takes a Target, whose DialContext is injectable so that tests can reach a server
// inside another network namespace. Connections are never reused between calls, so a call after
// a migration never meets a stale pooled connection.
//
// What belongs here: HTTP client code for the workload's endpoints. What does not: the server,
// the model, or anything that drives containerd or CRIU.
package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/berth-dev/berth/test/workload/server"
)

// DefaultIdleTimeout is how long Stream waits for the next line (or the response headers) when
// Request.IdleTimeout is 0: 15 s.
const DefaultIdleTimeout = 15 * time.Second

// NoDelay, as Request.Delay, asks the server to stream without pacing (delay=0).
const NoDelay time.Duration = -1

var (
	// ErrIdle is wrapped by Stream's error when no line arrived within the idle timeout, as
	// happens to a connection whose server vanished without a reset. It is retryable.
	ErrIdle = errors.New("stream idle")
	// ErrProtocol is wrapped by Stream's error when the server sent something that is not the
	// expected next line. It is not retryable.
	ErrProtocol = errors.New("workload protocol error")
	// ErrInvalidRequest is wrapped by Stream's error for a Request it refuses to send (From < 0
	// or N < From). It is not retryable.
	ErrInvalidRequest = errors.New("invalid request")
)

// StatusError is the error for a response with a status other than 200 OK.
type StatusError struct {
	// Code is the HTTP status code.
	Code int
	// Body is the start of the response body (at most 1 KiB), trimmed.
	Body string
}

// Error returns the status code and body.
func (e *StatusError) Error() string { return fmt.Sprintf("status %d: %s", e.Code, e.Body) }

// Target says where a workload server is and how to reach it.
type Target struct {
	// BaseURL is the server's base URL, e.g. "http://10.88.0.5:8080"; "host:port" alone means
	// http://host:port.
	BaseURL string
	// DialContext opens connections to the server (network "tcp", addr "host:port" of BaseURL);
	// nil means a plain net.Dialer. A test that reaches a server through a network namespace
	// dials inside it here, and may ignore addr.
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (t Target) url(path string, q url.Values) (string, error) {
	base := t.BaseURL
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	u, err := url.Parse(base)
	if err != nil {
		return "", fmt.Errorf("target %q: %w", t.BaseURL, err)
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + path
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// get issues GET path?q on a fresh connection. The caller closes the body and calls done.
func (t Target) get(ctx context.Context, path string, q url.Values) (*http.Response, func(), error) {
	u, err := t.url(path, q)
	if err != nil {
		return nil, nil, err
	}
	dial := t.DialContext
	if dial == nil {
		dial = (&net.Dialer{Timeout: 10 * time.Second}).DialContext
	}
	tr := &http.Transport{DialContext: dial, DisableKeepAlives: true} // Proxy nil: never a proxy
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("request %s: %w", path, err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		tr.CloseIdleConnections()
		return nil, nil, fmt.Errorf("get %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		tr.CloseIdleConnections()
		return nil, nil, fmt.Errorf("get %s: %w", path, &StatusError{Code: resp.StatusCode, Body: strings.TrimSpace(string(b))})
	}
	return resp, tr.CloseIdleConnections, nil
}

// getJSON decodes the JSON body of GET path?q into v.
func (t Target) getJSON(ctx context.Context, path string, q url.Values, v any) error {
	resp, done, err := t.get(ctx, path, q)
	if err != nil {
		return err
	}
	defer done()
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("decode %s: %w", path, err)
	}
	return nil
}

// Request is one /generate request.
type Request struct {
	// Session is the session ID.
	Session string
	// Prompt is the session's prompt; it prefills the session if the server does not have it.
	Prompt string
	// N is the length of the whole stream: tokens with indices From..N-1 are requested.
	N int
	// From is the index of the first requested token.
	From int
	// Delay overrides the server's pacing between lines (sent in whole ms); 0 keeps the
	// server's, NoDelay asks for none.
	Delay time.Duration
	// IdleTimeout is the longest wait for response headers or for the next line before the
	// stream counts as broken (ErrIdle); 0 means DefaultIdleTimeout, negative means none.
	IdleTimeout time.Duration
	// OnToken, if set, is called with each token's index and word as it arrives, before the
	// next line is read; a test can checkpoint the server from it to migrate mid-stream.
	OnToken func(i int, tok string)
}

func (r Request) query() url.Values {
	q := url.Values{}
	q.Set("session", r.Session)
	if r.Prompt != "" {
		q.Set("prompt", r.Prompt)
	}
	q.Set("n", strconv.Itoa(r.N))
	q.Set("from", strconv.Itoa(r.From))
	switch {
	case r.Delay < 0:
		q.Set("delay", "0")
	case r.Delay > 0:
		q.Set("delay", strconv.FormatInt(int64(r.Delay/time.Millisecond), 10))
	}
	return q
}

// Stream requests tokens From..N-1 of a session from t and returns their words in order. On
// error it returns the words received before it together with the error; Retryable says whether
// resuming can help.
func Stream(ctx context.Context, t Target, r Request) ([]string, error) {
	if r.N < r.From || r.From < 0 {
		return nil, fmt.Errorf("stream %q: from %d, n %d: %w", r.Session, r.From, r.N, ErrInvalidRequest)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := r.IdleTimeout
	if idle == 0 {
		idle = DefaultIdleTimeout
	}
	var timer *time.Timer
	if idle > 0 {
		timer = time.AfterFunc(idle, func() { cancel(ErrIdle) })
		defer timer.Stop()
	}
	wrap := func(got []string, err error) ([]string, error) {
		if errors.Is(context.Cause(ctx), ErrIdle) {
			err = fmt.Errorf("%w for %v: %w", ErrIdle, idle, err)
		}
		return got, fmt.Errorf("stream %q after %d of tokens %d..%d: %w", r.Session, len(got), r.From, r.N, err)
	}

	resp, done, err := t.get(ctx, "/generate", r.query())
	if err != nil {
		return wrap(nil, err)
	}
	defer done()
	defer resp.Body.Close()
	got := make([]string, 0, r.N-r.From)
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if timer != nil {
			timer.Reset(idle)
		}
		var l server.Line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return wrap(got, fmt.Errorf("%w: line %q: %w", ErrProtocol, sc.Text(), err))
		}
		if want := r.From + len(got); l.I != want || l.Tok == "" || want >= r.N {
			return wrap(got, fmt.Errorf("%w: got line %q, want index %d below %d", ErrProtocol, sc.Text(), want, r.N))
		}
		got = append(got, l.Tok)
		if r.OnToken != nil {
			r.OnToken(l.I, l.Tok)
		}
	}
	if err := sc.Err(); err != nil {
		return wrap(got, err)
	}
	if len(got) < r.N-r.From {
		return wrap(got, fmt.Errorf("stream ended early: %w", io.ErrUnexpectedEOF))
	}
	return got, nil
}

// Retryable reports whether err, from Stream, may go away by resuming the stream, possibly at
// another address: true for broken or idle connections and 5xx responses, false for 4xx
// responses, ErrProtocol, ErrInvalidRequest and a canceled or expired ctx.
func Retryable(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || errors.Is(err, ErrProtocol) || errors.Is(err, ErrInvalidRequest) {
		return false
	}
	if se := (*StatusError)(nil); errors.As(err, &se) {
		return se.Code >= 500
	}
	return true
}

// Reconnect is called by Resume after the stream broke for the attempt-th time (from 1) with the
// error that broke it; it returns the target to resume at (the container's new address, or the
// same target to retry), or an error to give up. It may wait, e.g. for the restore to finish.
type Reconnect func(ctx context.Context, attempt int, err error) (Target, error)

// Resume streams tokens r.From..r.N-1 like Stream and, whenever the stream breaks with a
// Retryable error, asks reconnect for a target and continues there with From set to the next
// missing index, so the server replays or generates exactly the missing tokens. It returns all
// words received, in order, and the error that ended it, if any (a non-retryable error or
// reconnect's).
func Resume(ctx context.Context, t Target, r Request, reconnect Reconnect) ([]string, error) {
	var all []string
	for attempt := 1; ; attempt++ {
		rr := r
		rr.From = r.From + len(all)
		got, err := Stream(ctx, t, rr)
		all = append(all, got...)
		if err == nil {
			return all, nil
		}
		if !Retryable(ctx, err) {
			return all, err
		}
		next, rerr := reconnect(ctx, attempt, err)
		if rerr != nil {
			return all, fmt.Errorf("reconnect %d after %w: %w", attempt, err, rerr)
		}
		t = next
	}
}

// Stats returns the server's GET /stats.
func Stats(ctx context.Context, t Target) (server.Stats, error) {
	var s server.Stats
	if err := t.getJSON(ctx, "/stats", nil, &s); err != nil {
		return server.Stats{}, fmt.Errorf("stats: %w", err)
	}
	return s, nil
}

// Session returns the server's GET /session for session id; a missing session is a
// *StatusError with Code 404.
func Session(ctx context.Context, t Target, id string) (server.SessionInfo, error) {
	var s server.SessionInfo
	if err := t.getJSON(ctx, "/session", url.Values{"session": {id}}, &s); err != nil {
		return server.SessionInfo{}, fmt.Errorf("session %q: %w", id, err)
	}
	return s, nil
}

// Healthz returns nil if the server answers GET /healthz with 200, else the error.
func Healthz(ctx context.Context, t Target) error {
	resp, done, err := t.get(ctx, "/healthz", nil)
	if err != nil {
		return fmt.Errorf("healthz: %w", err)
	}
	defer done()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1024))
	resp.Body.Close()
	return nil
}

// WaitReady polls Healthz every interval (100 ms if 0) until it succeeds, returning nil, or until
// ctx ends, returning ctx's error joined with the last Healthz error.
func WaitReady(ctx context.Context, t Target, interval time.Duration) error {
	if interval <= 0 {
		interval = 100 * time.Millisecond
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		err := Healthz(ctx, t)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait ready: %w", errors.Join(ctx.Err(), err))
		case <-tick.C:
		}
	}
}
