package serve_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"testing"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/registry/reference"
	"github.com/berth-dev/berth/oci/registry/regdef"
	"github.com/berth-dev/berth/shim/helper"
	"github.com/berth-dev/berth/shim/helper/serve"
)

// client is a helper.Client whose helper is Serve with Handlers in this process: the request
// and the answer cross the boundary as JSON, as they do with berth-shim-helper.
func client(h helper.Handlers) helper.Client {
	return helper.Client{Path: helper.Name, Run: func(cmd *exec.Cmd) ([]byte, error) {
		var out bytes.Buffer
		if rc := helper.Serve(context.Background(), cmd.Stdin, &out, h); rc != 0 {
			return out.Bytes(), fmt.Errorf("exit status %d", rc)
		}
		return out.Bytes(), nil
	}}
}

// TestParseRestoreFrom: a berth.dev/restore-from value parsed by the helper (OpParseRestoreFrom)
// is what reference.ParseRestoreFrom makes in process, and its refusal keeps the message and the
// sentinels the shim classifies.
func TestParseRestoreFrom(t *testing.T) {
	c := client(serve.Handlers())
	tests := []struct {
		v    string
		want regdef.RestoreFrom
		is   []error // nil: parses
	}{
		{v: "oci://127.0.0.1:5000/berth/ck:v1", want: regdef.RestoreFrom{Registry: "127.0.0.1:5000", Repository: "berth/ck", Tag: "v1"}},
		{v: "oci://r.example/a/b@sha256:" + fmt.Sprintf("%064x", 1), want: regdef.RestoreFrom{Registry: "r.example", Repository: "a/b", Digest: "sha256:" + fmt.Sprintf("%064x", 1)}},
		{v: "oci://127.0.0.1:1/berth/ck", is: []error{checkpoint.ErrInvalidRef}},
		{v: "oci://127.0.0.1:1/Berth/ck:v1", is: []error{checkpoint.ErrInvalidRef}},
		{v: "oci://r.example/ck@sha512:" + fmt.Sprintf("%0128x", 1), is: []error{checkpoint.ErrInvalidRef}},
		{v: "oci://r.example/ck:v1 x", is: []error{checkpoint.ErrInvalidRef}},
		{v: "oci://u:p@r.example/ck:v1", is: []error{checkpoint.ErrInvalidRef, regdef.ErrCredentialsInReference}},
		{v: "docker://r.example/ck:v1", is: []error{checkpoint.ErrInvalidRef}},
		{v: "some/dir", want: regdef.RestoreFrom{Path: "some/dir"}},
	}
	for _, tc := range tests {
		got, err := c.ParseRestoreFrom(context.Background(), tc.v)
		local, lerr := reference.ParseRestoreFrom(tc.v)
		if tc.is == nil {
			if err != nil || got != tc.want || got != local {
				t.Errorf("%s: %+v, %v; want %+v (in process: %+v, %v)", tc.v, got, err, tc.want, local, lerr)
			}
			continue
		}
		if err == nil || lerr == nil {
			t.Errorf("%s: parsed: %+v, %v (in process: %+v, %v)", tc.v, got, err, local, lerr)
			continue
		}
		if err.Error() != lerr.Error() {
			t.Errorf("%s: message %q; in process %q", tc.v, err, lerr)
		}
		for _, s := range tc.is {
			if !errors.Is(err, s) {
				t.Errorf("%s: %v does not match %v", tc.v, err, s)
			}
		}
	}
}
