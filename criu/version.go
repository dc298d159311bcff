package criu

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Sentinel errors of this package; match them with errors.Is.
var (
	// ErrNotFound: the criu binary does not exist or is not executable at the path looked up.
	ErrNotFound = errors.New("criu binary not found")
	// ErrTooOld: the criu binary is older than MinVersion.
	ErrTooOld = errors.New("criu version too old for berth")
	// ErrFeatureMissing: CRIU reports a required feature unavailable on this CRIU/kernel.
	ErrFeatureMissing = errors.New("criu feature missing")
	// ErrBadStats: a CRIU statistics file exists but is not a valid stats image.
	ErrBadStats = errors.New("malformed criu statistics file")
)

// MinVersion is the oldest CRIU berth works with (4.2.0).
var MinVersion = Version{Major: 4, Minor: 2, Sub: 0}

// Version is a CRIU version, major.minor.sublevel.
type Version struct {
	Major, Minor, Sub int
}

// VersionFromInt converts go-criu's integer form (Major*10000 + Minor*100 + Sub, as
// GetCriuVersion returns it; 40201 is 4.2.1) to a Version. go-criu reports a CRIU built from
// git (its version RPC carries a git id) as the next minor with sublevel 0.
func VersionFromInt(n int) Version {
	return Version{Major: n / 10000, Minor: n / 100 % 100, Sub: n % 100}
}

// ParseVersion parses "4.2", "4.2.1" or "v4.2.1" (as `criu --version` and
// fingerprint.Fingerprint.CRIU write it); a missing sublevel is 0. It returns an error naming s
// when s is not one to three dot-separated non-negative integers.
func ParseVersion(s string) (Version, error) {
	parts := strings.Split(strings.TrimPrefix(strings.TrimSpace(s), "v"), ".")
	if len(parts) < 1 || len(parts) > 3 {
		return Version{}, fmt.Errorf("criu: parse version %q: want major.minor[.sublevel]", s)
	}
	var n [3]int
	for i, p := range parts {
		x, err := strconv.Atoi(p)
		if err != nil || x < 0 {
			return Version{}, fmt.Errorf("criu: parse version %q: want major.minor[.sublevel]", s)
		}
		n[i] = x
	}
	return Version{Major: n[0], Minor: n[1], Sub: n[2]}, nil
}

// Int is go-criu's integer form of v (Major*10000 + Minor*100 + Sub).
func (v Version) Int() int { return v.Major*10000 + v.Minor*100 + v.Sub }

// String is "major.minor.sublevel", e.g. "4.2.1" (the form fingerprint.Fingerprint.CRIU uses).
func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Sub) }

// short is "major.minor" when the sublevel is 0, else String.
func (v Version) short() string {
	if v.Sub == 0 {
		return fmt.Sprintf("%d.%d", v.Major, v.Minor)
	}
	return v.String()
}

// Less reports whether v is older than o.
func (v Version) Less(o Version) bool {
	if v.Major != o.Major {
		return v.Major < o.Major
	}
	if v.Minor != o.Minor {
		return v.Minor < o.Minor
	}
	return v.Sub < o.Sub
}

// checkVersion returns nil when v >= MinVersion, otherwise an error wrapping ErrTooOld that
// names the version found, the binary's path and the minimum, e.g.
// "criu 3.17.1 at /usr/sbin/criu is older than 4.2: criu version too old for berth".
func checkVersion(v Version, path string) error {
	if v.Less(MinVersion) {
		return fmt.Errorf("criu %s at %s is older than %s: %w", v, path, MinVersion.short(), ErrTooOld)
	}
	return nil
}
