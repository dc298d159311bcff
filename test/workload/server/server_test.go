package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/workload/model"
	"github.com/berth-dev/berth/test/workload/server"
)

var testModel = model.Config{WeightsMiB: 8, Seed: 21, VocabSize: 500}

func newServer(t *testing.T, cfg server.Config) (*httptest.Server, *model.Model) {
	t.Helper()
	m, err := model.New(testModel)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(server.New(m, cfg))
	t.Cleanup(ts.Close)
	return ts, m
}

func generateURL(base, session, prompt string, n, from int, extra ...string) string {
	q := url.Values{"session": {session}, "prompt": {prompt}, "n": {strconv.Itoa(n)}, "from": {strconv.Itoa(from)}}
	for i := 0; i+1 < len(extra); i += 2 {
		q.Set(extra[i], extra[i+1])
	}
	return base + "/generate?" + q.Encode()
}

// stream GETs u and returns the lines' words, checking that indices run from `from` upward.
// It stops after limit lines (if limit > 0) by canceling the request.
func stream(t *testing.T, u string, from, limit int) []string {
	t.Helper()
	words, err := streamE(u, from, limit)
	if err != nil {
		t.Fatal(err)
	}
	return words
}

// streamE is stream for goroutines other than the test's: it returns errors.
func streamE(u string, from, limit int) ([]string, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return nil, fmt.Errorf("GET %s: %s: %s", u, resp.Status, b)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/x-ndjson" {
		return nil, fmt.Errorf("GET %s: Content-Type = %q", u, ct)
	}
	var words []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var l server.Line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return words, fmt.Errorf("line %q: %w", sc.Text(), err)
		}
		if l.I != from+len(words) {
			return words, fmt.Errorf("line %q: want index %d", sc.Text(), from+len(words))
		}
		words = append(words, l.Tok)
		if limit > 0 && len(words) == limit {
			return words, nil
		}
	}
	if err := sc.Err(); err != nil {
		return words, fmt.Errorf("read stream: %w", err)
	}
	return words, nil
}

func getJSON[T any](t *testing.T, u string) T {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v T
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %s: %s", u, resp.Status, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	return v
}

func TestGenerateMatchesReference(t *testing.T) {
	ts, m := newServer(t, server.Config{})
	tests := []struct {
		name, prompt string
		n            int
		delay        string
	}{
		{"empty prompt", "", 30, ""},
		{"short", "hi", 100, ""},
		{"paced", "pace me", 10, "2"},
		{"unicode and query chars", "a&b=c ü/?#", 64, ""},
		{"zero tokens", "nothing", 0, ""},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := model.Words(m.Reference(tt.prompt, tt.n))
			var extra []string
			if tt.delay != "" {
				extra = []string{"delay", tt.delay}
			}
			start := time.Now()
			got := stream(t, generateURL(ts.URL, fmt.Sprint("s", i), tt.prompt, tt.n, 0, extra...), 0, 0)
			if !slices.Equal(got, want) {
				t.Fatalf("server stream differs from reference:\n got %v\nwant %v", got, want)
			}
			if tt.delay == "2" && time.Since(start) < time.Duration(tt.n-1)*2*time.Millisecond {
				t.Errorf("paced stream took %v, want >= %v", time.Since(start), time.Duration(tt.n-1)*2*time.Millisecond)
			}
		})
	}
	// The full stream of a session agrees with a pure Reference on a separately loaded model.
	pure, err := model.Reference(testModel, "hi", 100)
	if err != nil {
		t.Fatal(err)
	}
	if got := stream(t, generateURL(ts.URL, "s1", "hi", 100, 0), 0, 0); !slices.Equal(got, model.Words(pure)) {
		t.Errorf("replayed stream differs from model.Reference")
	}
}

func TestResumeReplaysWithoutRecompute(t *testing.T) {
	const prompt, n = "resume this stream", 60
	tests := []struct {
		name      string
		generated int // tokens generated before the resume
		from, to  int // the resumed request
	}{
		{"replay all", n, 0, n},
		{"replay tail", n, 25, n},
		{"replay middle", n, 10, 20},
		{"replay nothing", n, n, n},
		{"replay then generate", 30, 20, n},
		{"generate gap", 10, 40, n},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts, m := newServer(t, server.Config{})
			want := model.Words(m.Reference(prompt, n))
			if got := stream(t, generateURL(ts.URL, "a", prompt, tt.generated, 0), 0, 0); !slices.Equal(got, want[:tt.generated]) {
				t.Fatalf("first stream differs from reference")
			}
			before := m.Stats()
			// A fresh connection; the prompt may be repeated or omitted.
			for _, p := range []string{prompt, ""} {
				got := stream(t, generateURL(ts.URL, "a", p, tt.to, tt.from), tt.from, 0)
				if !slices.Equal(got, want[tt.from:tt.to]) {
					t.Fatalf("resumed stream (prompt %q) from %d differs:\n got %v\nwant %v", p, tt.from, got, want[tt.from:tt.to])
				}
			}
			after := m.Stats()
			if after.Prefills != before.Prefills || after.PrefillTokens != before.PrefillTokens {
				t.Errorf("resume prefilled again: before %+v after %+v", before, after)
			}
			if wantDecoded := int64(max(tt.generated, tt.to)); after.Decoded != wantDecoded {
				t.Errorf("decoded = %d, want %d (each token generated once)", after.Decoded, wantDecoded)
			}
			info := getJSON[server.SessionInfo](t, ts.URL+"/session?session=a")
			wantKV := 1 + len(prompt) + max(tt.generated, tt.to)
			if info.Generated != max(tt.generated, tt.to) || info.KVEntries != wantKV || info.KVBytes != wantKV*model.KVEntryBytes || info.Prompt != prompt {
				t.Errorf("session info = %+v, want %d generated, %d KV entries", info, max(tt.generated, tt.to), wantKV)
			}
		})
	}
}

func TestDisconnectKeepsHistory(t *testing.T) {
	const prompt, n = "going away", 40
	ts, m := newServer(t, server.Config{Delay: 5 * time.Millisecond})
	want := model.Words(m.Reference(prompt, n))
	got := stream(t, generateURL(ts.URL, "d", prompt, 100000, 0), 0, 5)
	if !slices.Equal(got, want[:5]) {
		t.Fatalf("first tokens differ: %v vs %v", got, want[:5])
	}
	// The handler notices the disconnect and stops generating.
	var generated int
	deadline := time.Now().Add(5 * time.Second)
	for {
		generated = getJSON[server.SessionInfo](t, ts.URL+"/session?session=d").Generated
		time.Sleep(30 * time.Millisecond)
		if getJSON[server.SessionInfo](t, ts.URL+"/session?session=d").Generated == generated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("generation did not stop after the client went away")
		}
	}
	if generated < 5 || generated > 20 {
		t.Errorf("generated %d tokens for a client that read 5", generated)
	}
	rest := stream(t, generateURL(ts.URL, "d", prompt, n, 5, "delay", "0"), 5, 0)
	if !slices.Equal(rest, want[5:]) {
		t.Fatalf("resumed tokens differ")
	}
	st := m.Stats()
	if st.Prefills != 1 || st.Decoded != int64(max(n, generated)) {
		t.Errorf("stats = %+v, want 1 prefill and %d decoded", st, max(n, generated))
	}
}

func TestSessionsIndependent(t *testing.T) {
	ts, m := newServer(t, server.Config{Delay: time.Millisecond})
	prompts := map[string]string{"one": "same prompt", "two": "same prompt", "three": "other prompt", "four": ""}
	const n = 50
	var wg sync.WaitGroup
	got := map[string][]string{}
	var mu sync.Mutex
	for id, p := range prompts {
		wg.Go(func() {
			// Two halves over two connections, interleaved with the other sessions.
			a, err := streamE(generateURL(ts.URL, id, p, n/2, 0), 0, 0)
			if err != nil {
				t.Error(err)
			}
			b, err := streamE(generateURL(ts.URL, id, p, n, n/2), n/2, 0)
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			got[id] = append(a, b...)
			mu.Unlock()
		})
	}
	wg.Wait()
	for id, p := range prompts {
		if want := model.Words(m.Reference(p, n)); !slices.Equal(got[id], want) {
			t.Errorf("session %s differs from its reference", id)
		}
	}
	if !slices.Equal(got["one"], got["two"]) || slices.Equal(got["one"], got["three"]) {
		t.Errorf("streams should depend on the prompt only")
	}
	st := getJSON[server.Stats](t, ts.URL+"/stats")
	if st.Sessions != 4 || st.Prefills != 4 || st.Decoded != 4*n {
		t.Errorf("stats = %+v, want 4 sessions, 4 prefills, %d decoded", st, 4*n)
	}
}

func TestStats(t *testing.T) {
	ts, _ := newServer(t, server.Config{})
	wantSum, err := model.WeightsChecksum(testModel)
	if err != nil {
		t.Fatal(err)
	}
	zero := getJSON[server.Stats](t, ts.URL+"/stats")
	want := server.Stats{WeightsChecksum: model.FormatChecksum(wantSum), WeightsMiB: 8, Seed: 21, VocabSize: 500}
	if zero != want {
		t.Errorf("fresh stats = %+v, want %+v", zero, want)
	}
	stream(t, generateURL(ts.URL, "x", "abc", 10, 0), 0, 0)
	st := getJSON[server.Stats](t, ts.URL+"/stats")
	want.Prefills, want.PrefillTokens, want.Decoded, want.Sessions = 1, 4, 10, 1
	want.KVBytes = 14 * model.KVEntryBytes
	if st != want {
		t.Errorf("stats = %+v, want %+v", st, want)
	}
	resp, err := http.Get(ts.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != "ok\n" {
		t.Errorf("healthz = %s %q", resp.Status, b)
	}
}

func TestBadRequests(t *testing.T) {
	ts, m := newServer(t, server.Config{MaxTokens: 100})
	stream(t, generateURL(ts.URL, "taken", "first prompt", 1, 0), 0, 0)
	long := make([]byte, server.MaxPromptBytes+1)
	for i := range long {
		long[i] = 'a'
	}
	tests := []struct {
		name   string
		method string
		path   string
		want   int
	}{
		{"no session", "GET", "/generate?n=5", 400},
		{"no n", "GET", "/generate?session=a", 400},
		{"negative n", "GET", "/generate?session=a&n=-1", 400},
		{"n over max", "GET", "/generate?session=a&n=101", 400},
		{"n not a number", "GET", "/generate?session=a&n=five", 400},
		{"from past n", "GET", "/generate?session=a&n=5&from=6", 400},
		{"negative from", "GET", "/generate?session=a&n=5&from=-1", 400},
		{"bad delay", "GET", "/generate?session=a&n=5&delay=-3", 400},
		{"prompt too long", "GET", "/generate?session=a&n=5&prompt=" + string(long), 400},
		{"other prompt", "GET", "/generate?session=taken&n=5&prompt=second", 409},
		{"unknown session info", "GET", "/session?session=nope", 404},
		{"session info without id", "GET", "/session", 400},
		{"post", "POST", "/generate?session=a&n=5", 405},
		{"unknown path", "GET", "/nope", 404},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(tt.method, ts.URL+tt.path, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tt.want {
				t.Errorf("%s %s = %d, want %d", tt.method, tt.path, resp.StatusCode, tt.want)
			}
		})
	}
	if st := m.Stats(); st.Prefills != 1 || st.Decoded != 1 {
		t.Errorf("bad requests changed the model: %+v", st)
	}
}
