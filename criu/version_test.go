package criu

import (
	"errors"
	"strings"
	"testing"
)

func TestVersionFromInt(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want Version
		str  string
	}{
		{40201, Version{4, 2, 1}, "4.2.1"},
		{40200, Version{4, 2, 0}, "4.2.0"},
		{31701, Version{3, 17, 1}, "3.17.1"},
		{40300, Version{4, 3, 0}, "4.3.0"},
		{50000, Version{5, 0, 0}, "5.0.0"},
		{0, Version{}, "0.0.0"},
	} {
		got := VersionFromInt(tc.n)
		if got != tc.want || got.String() != tc.str || got.Int() != tc.n {
			t.Errorf("VersionFromInt(%d) = %+v %q (Int %d), want %+v %q", tc.n, got, got, got.Int(), tc.want, tc.str)
		}
	}
}

func TestParseVersion(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Version
		ok   bool
	}{
		{"4.2.1", Version{4, 2, 1}, true},
		{"4.2", Version{4, 2, 0}, true},
		{"v4.2.1", Version{4, 2, 1}, true},
		{" 3.17.1\n", Version{3, 17, 1}, true},
		{"", Version{}, false},
		{"4.2.1.1", Version{}, false},
		{"4.x", Version{}, false},
		{"4.-1", Version{}, false},
	} {
		got, err := ParseVersion(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseVersion(%q) = %+v, %v; want %+v ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), tc.in) {
			t.Errorf("ParseVersion(%q) error %q should quote the input", tc.in, err)
		}
	}
}

func TestVersionLess(t *testing.T) {
	for _, tc := range []struct {
		a, b Version
		less bool
	}{
		{Version{4, 1, 9}, Version{4, 2, 0}, true},
		{Version{3, 99, 99}, Version{4, 0, 0}, true},
		{Version{4, 2, 0}, Version{4, 2, 1}, true},
		{Version{4, 2, 0}, Version{4, 2, 0}, false},
		{Version{5, 0, 0}, Version{4, 9, 9}, false},
	} {
		if got := tc.a.Less(tc.b); got != tc.less {
			t.Errorf("%v.Less(%v) = %v", tc.a, tc.b, got)
		}
	}
}

func TestCheckVersion(t *testing.T) {
	for _, tc := range []struct {
		v    Version
		want string // "" means nil
	}{
		{Version{3, 17, 1}, "criu 3.17.1 at /usr/sbin/criu is older than 4.2: " + ErrTooOld.Error()},
		{Version{4, 1, 99}, "criu 4.1.99 at /usr/sbin/criu is older than 4.2: " + ErrTooOld.Error()},
		{Version{0, 0, 0}, "criu 0.0.0 at /usr/sbin/criu is older than 4.2: " + ErrTooOld.Error()},
		{Version{4, 2, 0}, ""},
		{Version{4, 2, 1}, ""},
		{Version{4, 3, 0}, ""},
		{Version{5, 0, 0}, ""},
	} {
		err := checkVersion(tc.v, "/usr/sbin/criu")
		if tc.want == "" {
			if err != nil {
				t.Errorf("checkVersion(%v) = %v, want nil", tc.v, err)
			}
			continue
		}
		if !errors.Is(err, ErrTooOld) {
			t.Errorf("checkVersion(%v) = %v, want ErrTooOld", tc.v, err)
		}
		if err != nil && err.Error() != tc.want {
			t.Errorf("checkVersion(%v) message\n got %q\nwant %q", tc.v, err, tc.want)
		}
	}
}
