package topology

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// FuzzParse checks that Parse never panics, and that whatever it accepts is a valid Topology
// that String prints back into the same Topology. Seeds: testdata/fuzz/FuzzParse, the files in
// testdata/ and the shared fixtures when present.
func FuzzParse(f *testing.F) {
	for _, pattern := range []string{"testdata/*.tsv", filepath.Join(fixturesDir, "*")} {
		paths, _ := filepath.Glob(pattern)
		for _, p := range paths {
			if b, err := os.ReadFile(p); err == nil {
				f.Add(b)
			}
		}
	}
	f.Add([]byte(good))
	f.Fuzz(func(t *testing.T, in []byte) {
		top, err := Parse(bytes.NewReader(in))
		if err != nil {
			if top != nil {
				t.Fatal("topology returned with an error")
			}
			return
		}
		if err := top.Validate(); err != nil {
			t.Fatalf("Parse accepted an invalid topology: %v", err)
		}
		again, err := Parse(bytes.NewReader([]byte(top.String())))
		if err != nil {
			t.Fatalf("String() does not parse: %v\n%s", err, top)
		}
		if !reflect.DeepEqual(top, again) {
			t.Fatalf("round trip differs:\n%s\n%s", top, again)
		}
	})
}
