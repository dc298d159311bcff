package commands

import (
	"strings"
	"testing"
)

// TestParseMounts: --mount takes ctr's syntax; a bind mount gets rbind unless it names bind.
func TestParseMounts(t *testing.T) {
	tests := []struct {
		flag, want, err string
	}{
		{flag: "type=bind,src=/srv/data,dst=/data", want: "bind /srv/data /data rbind"},
		{flag: "src=/a,dst=/b,options=bind:ro", want: "bind /a /b bind ro"},
		{flag: "type=tmpfs,source=tmpfs,destination=/scratch,options=size=64m", want: "tmpfs tmpfs /scratch size=64m"},
		{flag: "src=/a,dst=relative", err: "absolute dst"},
		{flag: "src=/a,dst=/b,uid=0", err: `unknown key "uid"`},
		{flag: "src=/a,dst", err: "is not key=value"},
	}
	for _, tc := range tests {
		t.Run(tc.flag, func(t *testing.T) {
			ms, err := parseMounts([]string{tc.flag})
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("parseMounts: %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil || len(ms) != 1 {
				t.Fatalf("parseMounts: %v %v", ms, err)
			}
			m := ms[0]
			if got := strings.Join(append([]string{m.Type, m.Source, m.Destination}, m.Options...), " "); got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
