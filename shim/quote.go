package shim

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/registry/regdef"
)

// Bounds on what the shim quotes back.
const (
	// maxQuoted is the most of a value from a spec or a checkpoint (an annotation, a reference, an
	// entry name) an error quotes, in bytes.
	maxQuoted = 256
	// maxReference is the longest berth.dev/restore-from value the shim reads, in bytes.
	maxReference = 4096
	// maxMessage is the longest error message the task API returns, in bytes.
	maxMessage = 8192
)

// userinfo matches the credentials of a URL-like reference ("scheme://user:password@"),
// compiled by the first call: every container's shim would otherwise hold it.
var userinfo = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s"']*@`) })

// redact returns s with the credentials of every URL-like reference in it replaced by
// "<redacted>".
func redact(s string) string { return userinfo().ReplaceAllString(s, "${1}<redacted>@") }

// cut returns s whole when it is at most n bytes, else its first n bytes (whole runes) and how
// long it was.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "...(" + strconv.Itoa(len(s)) + " bytes)"
}

// quote is a value from a pod spec or a checkpoint as messages show it: credentials redacted,
// cut to maxQuoted bytes, Go-quoted.
func quote(v string) string { return strconv.Quote(cut(redact(v), maxQuoted)) }

// cleanMessage is an error message as the task API returns it (and containerd logs it):
// credentials redacted, cut to maxMessage bytes.
func cleanMessage(msg string) string { return cut(redact(msg), maxMessage) }

// checkReference refuses, before it is parsed or named anywhere, a berth.dev/restore-from value
// longer than maxReference or a registry reference that carries credentials (they belong in
// the Docker config registry_config names; a reference travels through pod specs and logs).
func checkReference(ref string) error {
	if len(ref) > maxReference {
		return fmt.Errorf("annotation %s=%s: %d bytes, more than %d: %w",
			oci.AnnotationRestoreFrom, quote(ref), len(ref), maxReference, ErrBadReference)
	}
	if rest, ok := strings.CutPrefix(ref, regdef.RestoreFromScheme); ok {
		if host, _, _ := strings.Cut(rest, "/"); strings.Contains(host, "@") {
			return fmt.Errorf("annotation %s=%s: the registry reference carries credentials; put them in the Docker config.json that registry_config names, never in a reference: %w",
				oci.AnnotationRestoreFrom, quote(ref), ErrBadReference)
		}
	}
	return nil
}
