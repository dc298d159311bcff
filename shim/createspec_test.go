package shim

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
)

// TestPrepareCreateFresh: for a task created fresh, Create writes the bundle's CRIU configuration
// and points org.criu.config at it, changing nothing else of config.json (fields the
// runtime-spec module does not know included); a spec that names its own CRIU configuration is
// left as it is; annotations that are not strings fail with ErrInvalidSpec.
func TestPrepareCreateFresh(t *testing.T) {
	for _, tc := range []struct {
		fixture  string
		wantConf bool // org.criu.config names the bundle's berth-criu.conf afterwards
		wantErr  error
	}{
		{"fresh.json", true, nil},
		{"no-annotations.json", true, nil},
		{"own-criu-config.json", false, nil},
		{"bad-annotations.json", false, ErrInvalidSpec},
	} {
		t.Run(tc.fixture, func(t *testing.T) {
			in, err := os.ReadFile(filepath.Join("testdata", "spec", tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			bundle := t.TempDir()
			if err := os.WriteFile(filepath.Join(bundle, "config.json"), in, 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := DefaultConfig()
			cfg.CRIUOptions = []string{"tcp-close", "ext-unix-sk"}
			s := NewService(nil, cfg, Deps{})
			rec, err := s.prepareCreate(context.Background(), &taskAPI.CreateTaskRequest{ID: "c", Bundle: bundle})
			if !errors.Is(err, tc.wantErr) || rec != nil {
				t.Fatalf("prepareCreate = %+v, %v; want no record, error %v", rec, err, tc.wantErr)
			}
			if tc.wantErr != nil {
				return
			}
			out, err := os.ReadFile(filepath.Join(bundle, "config.json"))
			if err != nil {
				t.Fatal(err)
			}
			conf := filepath.Join(bundle, criuConfigName)
			if !tc.wantConf {
				if string(out) != string(in) {
					t.Errorf("config.json changed:\n%s", out)
				}
				if _, err := os.Stat(conf); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s written for a spec with its own CRIU configuration: %v", criuConfigName, err)
				}
				return
			}
			// issue 21: CRIU's plugin directory is an empty one of the bundle, so CRIU's own CUDA
			// plugin never restores a GPU process without berth's device map
			libdir := filepath.Join(bundle, criuLibdirName)
			if b, err := os.ReadFile(conf); err != nil || string(b) != "tcp-close\next-unix-sk\nlibdir "+libdir+"\n" {
				t.Errorf("%s = %q, %v", criuConfigName, b, err)
			}
			if ents, err := os.ReadDir(libdir); err != nil || len(ents) != 0 {
				t.Errorf("CRIU's plugin directory %s: %v %v, want it empty", libdir, ents, err)
			}
			// the same spec as before, plus the annotation
			var before, after specs.Spec
			if err := json.Unmarshal(in, &before); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(out, &after); err != nil {
				t.Fatal(err)
			}
			if after.Annotations[oci.AnnotationCRIUConfig] != conf {
				t.Errorf("org.criu.config = %q, want %q", after.Annotations[oci.AnnotationCRIUConfig], conf)
			}
			delete(after.Annotations, oci.AnnotationCRIUConfig)
			if len(after.Annotations) == 0 && before.Annotations == nil {
				after.Annotations = nil
			}
			if !reflect.DeepEqual(before, after) {
				t.Errorf("spec changed beyond the annotation:\nbefore %+v\nafter  %+v", before, after)
			}
			// members the runtime-spec module does not know are written back as they were
			var rawBefore, rawAfter map[string]json.RawMessage
			if err := json.Unmarshal(in, &rawBefore); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(out, &rawAfter); err != nil {
				t.Fatal(err)
			}
			for k := range rawBefore {
				if _, ok := rawAfter[k]; !ok {
					t.Errorf("member %q dropped from config.json", k)
				}
			}
			// a second Create on the same bundle (the annotation already set) leaves it alone
			if _, err := s.prepareCreate(context.Background(), &taskAPI.CreateTaskRequest{ID: "c", Bundle: bundle}); err != nil {
				t.Fatal(err)
			}
			if again, _ := os.ReadFile(filepath.Join(bundle, "config.json")); string(again) != string(out) {
				t.Errorf("config.json rewritten although the annotation was set")
			}
		})
	}
}
