package model

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
)

func newModel(t *testing.T, cfg Config) *Model {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v): %v", cfg, err)
	}
	return m
}

func TestConfigNormalize(t *testing.T) {
	tests := []struct {
		name    string
		in      Config
		want    Config
		wantErr bool
	}{
		{"zero takes defaults", Config{}, Config{WeightsMiB: DefaultWeightsMiB, VocabSize: DefaultVocabSize}, false},
		{"explicit kept", Config{WeightsMiB: 8, Seed: 7, VocabSize: 50}, Config{WeightsMiB: 8, Seed: 7, VocabSize: 50}, false},
		{"negative weights", Config{WeightsMiB: -1}, Config{}, true},
		{"too many weights", Config{WeightsMiB: MaxWeightsMiB + 1}, Config{}, true},
		{"vocab of one", Config{VocabSize: 1}, Config{}, true},
		{"vocab too large", Config{VocabSize: MaxVocabSize + 1}, Config{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.in.Normalize()
			if (err != nil) != tt.wantErr {
				t.Fatalf("Normalize() error = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil && got != tt.want {
				t.Errorf("Normalize() = %+v, want %+v", got, tt.want)
			}
		})
	}
	if _, err := New(Config{WeightsMiB: -1}); err == nil {
		t.Errorf("New with invalid config: want error")
	}
}

func TestWeightsChecksum(t *testing.T) {
	base := newModel(t, Config{WeightsMiB: 8, Seed: 1})
	tests := []struct {
		name     string
		cfg      Config
		wantSame bool
	}{
		{"same seed", Config{WeightsMiB: 8, Seed: 1}, true},
		{"same seed other vocab", Config{WeightsMiB: 8, Seed: 1, VocabSize: 77}, true},
		{"other seed", Config{WeightsMiB: 8, Seed: 2}, false},
		{"seed zero", Config{WeightsMiB: 8, Seed: 0}, false},
		{"other size", Config{WeightsMiB: 9, Seed: 1}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newModel(t, tt.cfg)
			pure, err := WeightsChecksum(tt.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if m.Checksum() != pure || m.RecomputeChecksum() != pure {
				t.Fatalf("checksums disagree: load %x recompute %x pure %x", m.Checksum(), m.RecomputeChecksum(), pure)
			}
			if same := pure == base.Checksum(); same != tt.wantSame {
				t.Errorf("checksum %s vs base %s: same = %v, want %v",
					FormatChecksum(pure), FormatChecksum(base.Checksum()), same, tt.wantSame)
			}
		})
	}
}

func TestWeightsResidentAndChecked(t *testing.T) {
	m := newModel(t, Config{WeightsMiB: 8, Seed: 3})
	for i, w := range m.weights {
		if w != weight(3, i) {
			t.Fatalf("weight %d = %x, want %x", i, w, weight(3, i))
		}
	}
	// Corrupting any one word of weight memory changes the recomputed checksum.
	for _, i := range []int{0, 1, len(m.weights) / 2, len(m.weights) - 1} {
		m.weights[i] ^= 1 << 17
		if m.RecomputeChecksum() == m.Checksum() {
			t.Errorf("flipping weight word %d left the checksum unchanged", i)
		}
		m.weights[i] ^= 1 << 17
	}
	if m.RecomputeChecksum() != m.Checksum() {
		t.Errorf("checksum not restored after undoing flips")
	}
}

func TestSessionMatchesReference(t *testing.T) {
	cfg := Config{WeightsMiB: 8, Seed: 42, VocabSize: 300}
	m := newModel(t, cfg)
	tests := []struct {
		prompt string
		n      int
	}{
		{"", 20},
		{"hello", 50},
		{"The quick brown fox jumps over the lazy dog.", 200},
		{"ünïcödé prompt", 10},
		{"x", 0},
	}
	for _, tt := range tests {
		t.Run(tt.prompt, func(t *testing.T) {
			want, err := Reference(cfg, tt.prompt, tt.n)
			if err != nil {
				t.Fatal(err)
			}
			if got := m.Reference(tt.prompt, tt.n); !slices.Equal(got, want) {
				t.Fatalf("Model.Reference differs from Reference")
			}
			s := m.NewSession(tt.prompt)
			if s.Len() != 1+len(tt.prompt) {
				t.Errorf("after prefill Len() = %d, want %d", s.Len(), 1+len(tt.prompt))
			}
			for i := range tt.n {
				if got := s.Next(); got != want[i] {
					t.Fatalf("token %d = %v, want %v", i, got, want[i])
				}
			}
			if s.Len() != 1+len(tt.prompt)+tt.n || s.Generated() != tt.n {
				t.Errorf("Len() = %d, Generated() = %d after %d tokens", s.Len(), s.Generated(), tt.n)
			}
			if s.KVBytes() != s.Len()*KVEntryBytes {
				t.Errorf("KVBytes() = %d, want %d", s.KVBytes(), s.Len()*KVEntryBytes)
			}
		})
	}
}

func TestStreamsVary(t *testing.T) {
	cfg := Config{WeightsMiB: 8, Seed: 5}
	m := newModel(t, cfg)
	a := m.Reference("prompt a", 100)
	b := m.Reference("prompt b", 100)
	if slices.Equal(a, b) {
		t.Errorf("different prompts gave the same stream")
	}
	other := newModel(t, Config{WeightsMiB: 8, Seed: 6}).Reference("prompt a", 100)
	if slices.Equal(a, other) {
		t.Errorf("different seeds gave the same stream")
	}
	distinct := map[Token]bool{}
	for _, tok := range a {
		distinct[tok] = true
	}
	if len(distinct) < 50 {
		t.Errorf("only %d distinct tokens in 100: stream is degenerate", len(distinct))
	}
}

func TestCorruptedKVChangesLaterTokens(t *testing.T) {
	const prompt = "corrupt me, please"
	const before, after = 30, 30
	m := newModel(t, Config{WeightsMiB: 8, Seed: 9})
	want := m.Reference(prompt, before+after)
	tests := []struct {
		name string
		pos  func(s *Session) int // KV entry to corrupt
		word int
		bit  uint
	}{
		{"BOS entry", func(*Session) int { return 0 }, 0, 0},
		{"first prompt byte", func(*Session) int { return 1 }, 63, 63},
		{"last prompt byte", func(*Session) int { return len(prompt) }, 17, 5},
		{"first decoded", func(*Session) int { return len(prompt) + 1 }, 31, 40},
		{"latest decoded", func(s *Session) int { return s.Len() - 1 }, 8, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := m.NewSession(prompt)
			for i := range before {
				if got := s.Next(); got != want[i] {
					t.Fatalf("token %d = %v, want %v before corruption", i, got, want[i])
				}
			}
			s.entry(tt.pos(s))[tt.word] ^= 1 << tt.bit
			got := make([]Token, after)
			for i := range got {
				got[i] = s.Next()
			}
			diff := 0
			for i := range got {
				if got[i] != want[before+i] {
					diff++
				}
			}
			if diff < after/2 {
				t.Errorf("corrupting one bit changed only %d of the next %d tokens", diff, after)
			}
		})
	}
	t.Run("lost entry", func(t *testing.T) {
		s := m.NewSession(prompt)
		for range before {
			s.Next()
		}
		var flat []kvEntry
		for i := range s.Len() {
			if i != 5 {
				flat = append(flat, *s.entry(i))
			}
		}
		s.chunks, s.n = [][]kvEntry{slices.Grow(flat, 8)}, len(flat)
		if got := s.Next(); got == want[before] && s.Next() == want[before+1] && s.Next() == want[before+2] {
			t.Errorf("dropping a KV entry did not change the output")
		}
	})
}

func TestSessionsIndependent(t *testing.T) {
	m := newModel(t, Config{WeightsMiB: 8, Seed: 11})
	prompts := []string{"alpha", "beta", "alpha", ""}
	const n = 100
	want := make([][]Token, len(prompts))
	for i, p := range prompts {
		want[i] = m.Reference(p, n)
	}
	sessions := make([]*Session, len(prompts))
	for i, p := range prompts {
		sessions[i] = m.NewSession(p)
	}
	got := make([][]Token, len(prompts))
	var wg sync.WaitGroup
	for i, s := range sessions {
		wg.Go(func() {
			for range n {
				got[i] = append(got[i], s.Next())
			}
		})
	}
	wg.Wait()
	for i := range prompts {
		if !slices.Equal(got[i], want[i]) {
			t.Errorf("session %d (%q) differs from its reference when run concurrently", i, prompts[i])
		}
	}
	st := m.Stats()
	wantStats := Stats{
		Prefills:      int64(len(prompts)),
		PrefillTokens: int64(len(prompts) + len("alpha") + len("beta") + len("alpha")),
		Decoded:       int64(len(prompts) * n),
		Sessions:      int64(len(prompts)),
	}
	wantStats.KVBytes = (wantStats.PrefillTokens + wantStats.Decoded) * KVEntryBytes
	if st != wantStats {
		t.Errorf("Stats() = %+v, want %+v (Reference must not count)", st, wantStats)
	}
}

func TestWords(t *testing.T) {
	seen := map[string]Token{}
	for tok := range Token(MaxVocabSize) {
		w := tok.Word()
		if prev, ok := seen[w]; ok {
			t.Fatalf("tokens %d and %d share word %q", prev, tok, w)
		}
		seen[w] = tok
		back, err := ParseWord(w)
		if err != nil || back != tok {
			t.Fatalf("ParseWord(%q) = %d, %v; want %d", w, back, err, tok)
		}
	}
	for _, bad := range []string{"", "ba", "bab", "xaxa", "babab", "bababa", "BABA"} {
		if _, err := ParseWord(bad); err == nil {
			t.Errorf("ParseWord(%q): want error", bad)
		}
	}
	if got := Words([]Token{0, 1, 70}); !slices.Equal(got, []string{"baba", "babe", "beba"}) {
		t.Errorf("Words = %v", got)
	}
}

func BenchmarkNext(b *testing.B) {
	m, err := New(Config{WeightsMiB: 64, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	s := m.NewSession("benchmark prompt")
	for b.Loop() {
		if s.Len() > 1000 {
			s = m.NewSession("benchmark prompt")
		}
		s.Next()
	}
}

func BenchmarkNew256MiB(b *testing.B) {
	for b.Loop() {
		if _, err := New(Config{}); err != nil {
			b.Fatal(err)
		}
	}
}

// countingDevice is a Device in process memory that counts its calls and can refuse work.
type countingDevice struct {
	mu           sync.Mutex
	mallocs, dos int
	bytes        int
	fail         error
}

func (d *countingDevice) Malloc(n int) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mallocs++
	d.bytes += n
	return make([]byte, n), nil
}

func (d *countingDevice) Do(f func()) error {
	d.mu.Lock()
	d.dos++
	err := d.fail
	d.mu.Unlock()
	if err != nil {
		return err
	}
	f()
	return nil
}

func TestDeviceSameTokens(t *testing.T) {
	cfg := Config{WeightsMiB: 8, Seed: 3, VocabSize: 300}
	host := newModel(t, cfg)
	for _, prompt := range []string{"", "a prompt", strings.Repeat("long ", 100)} {
		dev := &countingDevice{}
		m, err := NewOn(cfg, dev)
		if err != nil {
			t.Fatal(err)
		}
		if !m.OnDevice() || host.OnDevice() {
			t.Fatalf("OnDevice: %v on device, %v on host", m.OnDevice(), host.OnDevice())
		}
		if m.Checksum() != host.Checksum() || m.RecomputeChecksum() != host.Checksum() {
			t.Fatalf("checksums differ")
		}
		const n = 1200 // crosses several KV chunks
		s, err := m.StartSession(prompt)
		if err != nil {
			t.Fatal(err)
		}
		want := host.Reference(prompt, n)
		for i := range n {
			tok, err := s.Step()
			if err != nil {
				t.Fatal(err)
			}
			if tok != want[i] {
				t.Fatalf("prompt %q: token %d = %v on device, %v on host", prompt, i, tok, want[i])
			}
		}
		kv := (1 + len(prompt) + n) * KVEntryBytes
		if dev.bytes < cfg.WeightsMiB<<20+kv || dev.mallocs < 3 || dev.dos < n {
			t.Errorf("device saw %d mallocs of %d bytes and %d Do calls; want weights + %d KV bytes in chunks, %d Do", dev.mallocs, dev.bytes, dev.dos, kv, n)
		}
		// A lost device fails the step and leaves the session as it was.
		dev.fail = errors.New("device lost")
		if _, err := s.Step(); err == nil {
			t.Fatalf("Step on a lost device: no error")
		}
		if _, err := m.StartSession("x"); err == nil {
			t.Fatalf("StartSession on a lost device: no error")
		}
		if _, err := m.VerifyChecksum(); err == nil {
			t.Fatalf("VerifyChecksum on a lost device: no error")
		}
		dev.fail = nil
		if tok, err := s.Step(); err != nil || tok != host.Reference(prompt, n+1)[n] {
			t.Fatalf("Step after the device came back = %v, %v", tok, err)
		}
	}
}
