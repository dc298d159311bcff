package commands

import (
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

func TestRegistryFlagsCredentials(t *testing.T) {
	for _, tc := range []struct {
		name           string
		flags          []string
		stdin          string
		wantErr        bool
		user, password string
	}{
		{name: "anonymous", flags: []string{"--plain-http"}},
		{name: "password from stdin", flags: []string{"-u", "berth", "--password-stdin"}, stdin: "s3cret\n", user: "berth", password: "s3cret"},
		{name: "password keeps inner spaces", flags: []string{"--username=berth", "--password-stdin"}, stdin: " a b \r\n", user: "berth", password: " a b "},
		{name: "username without password-stdin", flags: []string{"-u", "berth"}, wantErr: true},
		{name: "password-stdin without username", flags: []string{"--password-stdin"}, stdin: "x", wantErr: true},
		{name: "empty password", flags: []string{"-u", "berth", "--password-stdin"}, stdin: "\n", wantErr: true},
		{name: "no password flag exists", flags: []string{"-u", "berth", "--password", "x"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// the flags as push and pull see them
			for _, mk := range []func(*Globals) *cobra.Command{CheckpointPush, CheckpointPull} {
				if err := mk(&Globals{}).ParseFlags(tc.flags); err != nil && !tc.wantErr {
					t.Fatal(err)
				}
			}
			var rf registryFlags
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			rf.add(fs)
			if err := fs.Parse(tc.flags); err != nil {
				if tc.wantErr {
					return
				}
				t.Fatal(err)
			}
			opts, err := rf.options(strings.NewReader(tc.stdin))
			if (err != nil) != tc.wantErr {
				t.Fatalf("options: %v, want error %v", err, tc.wantErr)
			}
			if err == nil && (opts.Username != tc.user || opts.Password != tc.password) {
				t.Fatalf("credentials %q/%q, want %q/%q", opts.Username, opts.Password, tc.user, tc.password)
			}
		})
	}
}
