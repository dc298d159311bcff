// Package quote renders values that berth did not choose (read from a peer, a registry, an
// annotation or a command line) for error messages and logs: cut to a sane length, and registry
// references stripped of the credentials a user may have written into them.
//
// What belongs here: those two rules. What does not: parsing references (oci/registry).
package quote

import (
	"fmt"
	"strings"
)

// MaxBytes is how much of a value an error quotes, in bytes.
const MaxBytes = 200

// Value returns s quoted as %q does, cut to MaxBytes bytes first: a longer value ends in
// "..." followed by its full length ("\"aaaa\"... (1048576 bytes)").
func Value(s string) string {
	if len(s) <= MaxBytes {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q... (%d bytes)", s[:MaxBytes], len(s))
}

// Redacted replaces the credentials of a reference in Ref.
const Redacted = "<redacted>"

// Ref returns the registry reference ref ("[scheme://][user[:password]@]host[:port]/repo[:tag]
// [@digest]") without its user information, quoted and cut as Value does: a password written
// into a reference never reaches an error or a log. The user information is everything up to
// the last "@" that does not start a digest (an "@" after a "/" followed by "algorithm:hex");
// it is replaced by Redacted.
func Ref(ref string) string { return Value(StripCredentials(ref)) }

// StripCredentials is Ref without the quoting and cutting.
func StripCredentials(ref string) string {
	scheme, rest, ok := strings.Cut(ref, "://")
	if !ok || strings.Contains(scheme, "/") {
		scheme, rest = "", ref
	} else {
		scheme += "://"
	}
	for i := len(rest) - 1; i >= 0; i-- {
		if rest[i] != '@' {
			continue
		}
		if strings.Contains(rest[:i], "/") && isDigest(rest[i+1:]) {
			continue // a digest's "@"
		}
		return scheme + Redacted + rest[i:]
	}
	return ref
}

// isDigest reports whether s looks like "algorithm:encoded" (OCI image-spec's grammar, the
// algorithm starting with a letter).
func isDigest(s string) bool {
	algo, enc, ok := strings.Cut(s, ":")
	if !ok || algo == "" || enc == "" || !('a' <= algo[0] && algo[0] <= 'z') {
		return false
	}
	for _, c := range algo {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '+' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	for _, c := range enc {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '=' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
