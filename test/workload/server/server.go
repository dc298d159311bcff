// Package server is the HTTP face of the test inference workload: it streams a model's tokens per
// session as newline-delimited JSON and keeps every session's KV cache and token history in
// process memory, which is what a CRIU checkpoint of the workload has to carry to another node.
//
// Endpoints:
//
//	GET /generate?session=ID&prompt=TEXT&n=N&from=K[&delay=MS]
//	    Streams tokens with indices K..N-1 of session ID, one JSON Line per line, flushed per line
//	    and paced by the delay. An unknown session is created and prefilled from prompt; a known
//	    one must be asked with its own prompt or none (409 otherwise). Tokens already generated
//	    are replayed from the session's history; the rest are generated, each index at most once
//	    per session, and stay in the history if the client goes away.
//	GET /session?session=ID  SessionInfo of one session (404 if unknown).
//	GET /stats               Stats of the whole process.
//	GET /healthz             "ok".
//
// What belongs here: the HTTP handler, its wire types and the per-session history. What does
// not: the model (package model), the Go client (package client) or flags (cmd/infer).
package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/berth-dev/berth/test/workload/model"
)

const (
	// DefaultDelay is the pacing between streamed tokens that DefaultConfig sets (20 ms), slow
	// enough that a test can checkpoint a container mid-stream.
	DefaultDelay = 20 * time.Millisecond
	// DefaultMaxTokens is the largest n a request may ask for when Config.MaxTokens is 0.
	DefaultMaxTokens = 1 << 20
	// MaxPromptBytes is the longest accepted prompt, in bytes (16 KiB).
	MaxPromptBytes = 16 << 10
	// MaxSessionIDBytes is the longest accepted session ID, in bytes.
	MaxSessionIDBytes = 256
	// MaxDelay is the largest accepted per-request delay (60 s).
	MaxDelay = time.Minute
)

// Config configures a Server.
type Config struct {
	// Delay is the pause between two streamed lines (ms resolution is enough); 0 streams as fast
	// as the model generates. A request's delay parameter (ms) overrides it.
	Delay time.Duration
	// MaxTokens is the largest n a /generate request may ask for; 0 means DefaultMaxTokens.
	MaxTokens int
	// GPUs, when set, returns the UUIDs of the (fake) GPUs the model runs on, for /stats.
	GPUs func() []string
}

// DefaultConfig returns the configuration cmd/infer starts with: Delay = DefaultDelay.
func DefaultConfig() Config { return Config{Delay: DefaultDelay} }

// Line is one line of a /generate stream.
type Line struct {
	// I is the token's index in its session's stream, from 0.
	I int `json:"i"`
	// Tok is the token's word (model.Token.Word).
	Tok string `json:"tok"`
}

// Stats is the body of GET /stats.
type Stats struct {
	// Prefills is the number of sessions prefilled (model.Stats.Prefills).
	Prefills int64 `json:"prefills"`
	// PrefillTokens is the number of KV entries written by prefill.
	PrefillTokens int64 `json:"prefillTokens"`
	// Decoded is the number of tokens generated, over all sessions.
	Decoded int64 `json:"decoded"`
	// Sessions is the number of sessions held.
	Sessions int64 `json:"sessions"`
	// KVBytes is the size of all KV caches, in bytes.
	KVBytes int64 `json:"kvBytes"`
	// WeightsChecksum is the checksum of weight memory read at the time of the request, as
	// model.FormatChecksum renders it.
	WeightsChecksum string `json:"weightsChecksum"`
	// WeightsMiB is the size of the weights, in MiB.
	WeightsMiB int `json:"weightsMiB"`
	// Seed is the weights' seed.
	Seed uint64 `json:"seed"`
	// VocabSize is the model's vocabulary size, in tokens.
	VocabSize int `json:"vocabSize"`
	// GPU reports that the model's weights and KV caches live in (fake) device memory.
	GPU bool `json:"gpu"`
	// GPUs are the UUIDs of the GPUs the model runs on, in device order, comma-separated (GPU
	// mode only; a string so that Stats stays comparable).
	GPUs string `json:"gpus,omitempty"`
}

// SessionInfo is the body of GET /session.
type SessionInfo struct {
	// Session is the session's ID.
	Session string `json:"session"`
	// Prompt is the prompt the session was prefilled with.
	Prompt string `json:"prompt"`
	// Generated is the number of tokens in the session's history.
	Generated int `json:"generated"`
	// KVEntries is the number of entries in the session's KV cache.
	KVEntries int `json:"kvEntries"`
	// KVBytes is the size of the session's KV cache, in bytes.
	KVBytes int `json:"kvBytes"`
}

// Server is an http.Handler serving one model. It is safe for concurrent use.
type Server struct {
	m   *model.Model
	cfg Config
	mux *http.ServeMux

	mu       sync.Mutex
	sessions map[string]*session
}

type session struct {
	prompt string
	dec    *model.Session

	mu      sync.Mutex
	history []model.Token
}

// token returns token i of the session, generating every missing token up to i first. It fails
// only when the model's device does.
func (s *session) token(i int) (model.Token, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.history) <= i {
		tok, err := s.dec.Step()
		if err != nil {
			return 0, err
		}
		s.history = append(s.history, tok)
	}
	return s.history[i], nil
}

// info returns the session's SessionInfo, history and KV cache read at one instant.
func (s *session) info(id string) SessionInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	kv := s.dec.Len()
	return SessionInfo{
		Session:   id,
		Prompt:    s.prompt,
		Generated: len(s.history),
		KVEntries: kv,
		KVBytes:   kv * model.KVEntryBytes,
	}
}

// New returns a Server over m configured by cfg.
func New(m *model.Model, cfg Config) *Server {
	if cfg.MaxTokens <= 0 {
		cfg.MaxTokens = DefaultMaxTokens
	}
	s := &Server{m: m, cfg: cfg, mux: http.NewServeMux(), sessions: map[string]*session{}}
	s.mux.HandleFunc("GET /generate", s.generate)
	s.mux.HandleFunc("GET /session", s.session)
	s.mux.HandleFunc("GET /stats", s.stats)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	return s
}

// ServeHTTP serves the endpoints listed in the package documentation.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// Stats returns what GET /stats serves, reading all weight memory for the checksum. It panics
// if the model's device fails; see StatsErr.
func (s *Server) Stats() Stats {
	st, err := s.StatsErr()
	if err != nil {
		panic(err)
	}
	return st
}

// StatsErr is Stats returning the device's error instead of panicking.
func (s *Server) StatsErr() (Stats, error) {
	sum, err := s.m.VerifyChecksum()
	if err != nil {
		return Stats{}, err
	}
	ms := s.m.Stats()
	cfg := s.m.Config()
	s.mu.Lock()
	n := len(s.sessions)
	s.mu.Unlock()
	st := Stats{
		Prefills:        ms.Prefills,
		PrefillTokens:   ms.PrefillTokens,
		Decoded:         ms.Decoded,
		Sessions:        int64(n),
		KVBytes:         ms.KVBytes,
		WeightsChecksum: model.FormatChecksum(sum),
		WeightsMiB:      cfg.WeightsMiB,
		Seed:            cfg.Seed,
		VocabSize:       cfg.VocabSize,
		GPU:             s.m.OnDevice(),
	}
	if s.cfg.GPUs != nil {
		st.GPUs = strings.Join(s.cfg.GPUs(), ",")
	}
	return st, nil
}

// intParam parses query parameter name as an int in [lo, hi], returning def if it is absent.
func intParam(r *http.Request, name string, def, lo, hi int) (int, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("parameter %s: %w", name, err)
	}
	if n < lo || n > hi {
		return 0, fmt.Errorf("parameter %s = %d: want %d..%d", name, n, lo, hi)
	}
	return n, nil
}

func sessionParam(r *http.Request) (string, error) {
	id := r.URL.Query().Get("session")
	if id == "" || len(id) > MaxSessionIDBytes {
		return "", fmt.Errorf("parameter session: want 1..%d bytes, got %d", MaxSessionIDBytes, len(id))
	}
	return id, nil
}

// getOrCreate returns session id, prefilling it from prompt if it is new; created reports that.
// It fails if the session exists with a different, non-empty prompt.
func (s *Server) getOrCreate(id, prompt string) (sess *session, created bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sess, ok := s.sessions[id]; ok {
		if prompt != "" && prompt != sess.prompt {
			return nil, false, fmt.Errorf("session %q exists with another prompt", id)
		}
		return sess, false, nil
	}
	dec, err := s.m.StartSession(prompt)
	if err != nil {
		return nil, false, errDevice{err}
	}
	sess = &session{prompt: prompt, dec: dec}
	s.sessions[id] = sess
	return sess, true, nil
}

func (s *Server) generate(w http.ResponseWriter, r *http.Request) {
	id, err := sessionParam(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	prompt := r.URL.Query().Get("prompt")
	if len(prompt) > MaxPromptBytes {
		http.Error(w, fmt.Sprintf("parameter prompt: %d bytes, want at most %d", len(prompt), MaxPromptBytes), http.StatusBadRequest)
		return
	}
	n, err := intParam(r, "n", -1, 0, s.cfg.MaxTokens)
	if err == nil && n < 0 {
		err = fmt.Errorf("parameter n is required")
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	from, err := intParam(r, "from", 0, 0, n)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	delayMs, err := intParam(r, "delay", -1, 0, int(MaxDelay/time.Millisecond))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	delay := s.cfg.Delay
	if delayMs >= 0 {
		delay = time.Duration(delayMs) * time.Millisecond
	}
	sess, created, err := s.getOrCreate(id, prompt)
	if err != nil {
		code := http.StatusConflict
		if _, ok := err.(errDevice); ok {
			code = http.StatusServiceUnavailable
		}
		http.Error(w, err.Error(), code)
		return
	}

	h := w.Header()
	h.Set("Content-Type", "application/x-ndjson")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Session-Created", strconv.FormatBool(created))
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return
	}
	ctx := r.Context()
	var timer *time.Timer
	for i := from; i < n; i++ {
		if i > from && delay > 0 {
			if timer == nil {
				timer = time.NewTimer(delay)
				defer timer.Stop()
			} else {
				timer.Reset(delay)
			}
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			return // client gone: generate nothing more for it
		}
		tok, err := sess.token(i)
		if err != nil {
			return // device lost: end the stream early, the client sees it short
		}
		line, err := json.Marshal(Line{I: i, Tok: tok.Word()})
		if err != nil {
			return
		}
		if _, err := w.Write(append(line, '\n')); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
	}
}

func (s *Server) session(w http.ResponseWriter, r *http.Request) {
	id, err := sessionParam(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	sess, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok {
		http.Error(w, fmt.Sprintf("session %q not found", id), http.StatusNotFound)
		return
	}
	writeJSON(w, sess.info(id))
}

func (s *Server) stats(w http.ResponseWriter, _ *http.Request) {
	st, err := s.StatsErr()
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	writeJSON(w, st)
}

// errDevice is a failure of the model's device.
type errDevice struct{ error }

func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, fmt.Sprintf("encode: %v", err), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
}
