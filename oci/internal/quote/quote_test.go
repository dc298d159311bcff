package quote

import (
	"strings"
	"testing"
)

func TestStripCredentials(t *testing.T) {
	const d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, tc := range []struct{ in, want string }{
		{"127.0.0.1:5000/ckpt/infer:1", "127.0.0.1:5000/ckpt/infer:1"},
		{"127.0.0.1:5000/ckpt/infer@" + d, "127.0.0.1:5000/ckpt/infer@" + d},
		{"oci://reg.example/ckpt:1", "oci://reg.example/ckpt:1"},
		{"berth:s3cret@reg.example/ckpt:1", "<redacted>@reg.example/ckpt:1"},
		{"oci://berth:s3cret@reg.example/ckpt:1", "oci://<redacted>@reg.example/ckpt:1"},
		{"oci://berth:s3/cr@t@reg.example/ckpt@" + d, "oci://<redacted>@reg.example/ckpt@" + d},
		{"berth:s3cret@reg.example", "<redacted>@reg.example"},
		{"berth:s3cret@127.0.0.1:5000", "<redacted>@127.0.0.1:5000"},
		{"reg.example/repo@notadigest", "<redacted>@notadigest"},
		{"https://berth:p%40ss@reg.example:5000/a/b:c", "https://<redacted>@reg.example:5000/a/b:c"},
		{"no-at-all", "no-at-all"},
	} {
		got := StripCredentials(tc.in)
		if got != tc.want {
			t.Errorf("StripCredentials(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if strings.Contains(got, "s3") {
			t.Errorf("StripCredentials(%q) = %q keeps the password", tc.in, got)
		}
	}
}

func TestValueCut(t *testing.T) {
	long := strings.Repeat("a", 1<<20)
	got := Value(long)
	if len(got) > MaxBytes+40 || !strings.HasSuffix(got, "... (1048576 bytes)") {
		t.Errorf("Value of 1 MiB: %d bytes, ends %q", len(got), got[len(got)-30:])
	}
	if Value("x") != `"x"` {
		t.Errorf("Value(x) = %s", Value("x"))
	}
	if r := Ref("u:pw@" + long); strings.Contains(r, "pw") || len(r) > MaxBytes+40 {
		t.Errorf("Ref: %d bytes", len(r))
	}
}
