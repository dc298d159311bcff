package shim

import (
	"errors"
	"testing"

	"github.com/containerd/errdefs"
)

func TestPageServerAddr(t *testing.T) {
	for _, tc := range []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"127.0.0.1:4000", "127.0.0.1", 4000, true},
		{"[::1]:4000", "::1", 4000, true},
		{"10.0.0.5:4000", "", 0, false}, // the page client speaks in the clear: loopback only
		{"localhost:4000", "", 0, false},
		{"127.0.0.1:0", "", 0, false},
		{"127.0.0.1", "", 0, false},
	} {
		h, p, err := pageServerAddr(tc.in)
		if tc.ok != (err == nil) || h != tc.host || p != tc.port {
			t.Errorf("pageServerAddr(%q) = %q, %d, %v", tc.in, h, p, err)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("pageServerAddr(%q): %v is not InvalidArgument", tc.in, err)
		}
	}
}
