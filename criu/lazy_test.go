package criu

import (
	"errors"
	"io/fs"
	"strings"
	"testing"
)

func TestCheckLazyDump(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cap     bool
		pipeMax string
		readErr error
		want    string // "" for no error
	}{
		{"capability", true, "1048576\n", nil, ""},
		{"capability, unreadable sysctl", true, "", fs.ErrPermission, ""},
		{"4 MiB", false, "4194304\n", nil, ""},
		{"exactly CRIU's pipe", false, "3354624", nil, ""},
		{"1 MiB", false, "1048576\n", nil, "fs.pipe-max-size is 1048576 bytes and CRIU runs without CAP_SYS_RESOURCE"},
		{"fix named", false, "65536", nil, "sysctl -w fs.pipe-max-size=4194304"},
		{"garbage", false, "lots", nil, "pipe-max-size"},
		{"unreadable", false, "", fs.ErrPermission, "permission denied"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkLazyDump(tc.cap, []byte(tc.pipeMax), tc.readErr)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("err = %v, want none", err)
				}
				return
			}
			if !errors.Is(err, ErrLazyUnsupported) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want ErrLazyUnsupported naming %q", err, tc.want)
			}
		})
	}
}
