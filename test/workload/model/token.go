package model

import (
	"errors"
	"fmt"
	"strings"
)

// errNotWord is wrapped by ParseWord's errors.
var errNotWord = errors.New("not a vocabulary word")

// Token is an output token: an integer in [0, VocabSize).
type Token uint32

// syllables are the digits of a word: consonant-vowel pairs, 14*5 = 70 of them.
var syllables = func() []string {
	var out []string
	for _, c := range "bdfgklmnprstvz" {
		for _, v := range "aeiou" {
			out = append(out, string(c)+string(v))
		}
	}
	return out
}()

// Word returns the token as a short lower-case word of at least two syllables ("baba" for 0).
// Distinct tokens have distinct words; ParseWord inverts it.
func (t Token) Word() string {
	n := uint64(t)
	base := uint64(len(syllables))
	var digits []string
	for n > 0 || len(digits) < 2 {
		digits = append(digits, syllables[n%base])
		n /= base
	}
	var b strings.Builder
	for i := len(digits) - 1; i >= 0; i-- {
		b.WriteString(digits[i])
	}
	return b.String()
}

// String returns t.Word().
func (t Token) String() string { return t.Word() }

// Words returns the words of tokens, in order.
func Words(tokens []Token) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = t.Word()
	}
	return out
}

// ParseWord returns the token whose Word is w, or an error if w is not such a word.
func ParseWord(w string) (Token, error) {
	if len(w) < 4 || len(w)%2 != 0 {
		return 0, fmt.Errorf("parse %q: %w", w, errNotWord)
	}
	var n uint64
	for i := 0; i < len(w); i += 2 {
		d := -1
		for j, s := range syllables {
			if s == w[i:i+2] {
				d = j
				break
			}
		}
		if d < 0 {
			return 0, fmt.Errorf("parse %q: %w", w, errNotWord)
		}
		n = n*uint64(len(syllables)) + uint64(d)
		if n > 1<<32-1 {
			return 0, fmt.Errorf("parse %q: %w", w, errNotWord)
		}
	}
	t := Token(n)
	if t.Word() != w { // e.g. a leading zero syllable on a word of three or more
		return 0, fmt.Errorf("parse %q: %w", w, errNotWord)
	}
	return t, nil
}
