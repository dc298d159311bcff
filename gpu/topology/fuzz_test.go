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
// testdata/ and the real fixtures in testdata/topologies (a seed that cannot be read fails).
func FuzzParse(f *testing.F) {
	for _, pattern := range []string{"testdata/*.tsv", filepath.Join(fixturesDir, "*")} {
		paths, err := filepath.Glob(pattern)
		if err != nil || len(paths) == 0 {
			f.Fatalf("no seeds match %s: %v", pattern, err)
		}
		for _, p := range paths {
			b, err := os.ReadFile(p)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
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
