package registry

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// The layout needs no registry: these run everywhere.

func TestArtifactManifestLayout(t *testing.T) {
	dir := makeCheckpoint(t)
	config, err := os.ReadFile(filepath.Join(dir, checkpoint.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	m, err := checkpoint.ParseManifest(config)
	if err != nil {
		t.Fatal(err)
	}
	man := artifactManifest(m, config, nil)
	again, _ := json.Marshal(artifactManifest(m, config, nil))
	if first, _ := json.Marshal(man); string(first) != string(again) {
		t.Fatal("the same checkpoint gives two different OCI manifests")
	}
	if man.SchemaVersion != 2 || man.MediaType != ocispec.MediaTypeImageManifest || man.ArtifactType != ArtifactType {
		t.Fatalf("manifest header %+v", man)
	}
	if err := checkLayers(man.Layers, archive.Limits{}.WithDefaults()); err != nil {
		t.Fatal(err)
	}
	if err := matchLayers(man.Layers, m); err != nil {
		t.Fatal(err)
	}
	// Any difference from berth.json is a mismatch.
	for i, mutate := range []func(l *ocispec.Descriptor){
		func(l *ocispec.Descriptor) { l.Size++ },
		func(l *ocispec.Descriptor) { l.Digest = man.Config.Digest },
		func(l *ocispec.Descriptor) {
			l.Annotations = map[string]string{ocispec.AnnotationTitle: "spec.dump.other"}
		},
	} {
		layers := append([]ocispec.Descriptor(nil), man.Layers...)
		mutate(&layers[len(layers)-1])
		if err := matchLayers(layers, m); !errors.Is(err, ErrLayerMismatch) {
			t.Errorf("mutation %d: %v, want ErrLayerMismatch", i, err)
		}
	}
	if err := matchLayers(man.Layers[1:], m); !errors.Is(err, ErrLayerMismatch) {
		t.Errorf("a missing layer: %v, want ErrLayerMismatch", err)
	}
}

func TestCheckLayers(t *testing.T) {
	file := func(title string, size int64) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: FileMediaType, Size: size,
			Annotations: map[string]string{ocispec.AnnotationTitle: title}}
	}
	lim := archive.Limits{MaxEntries: 3, MaxFileBytes: 10, MaxTotalBytes: 15}
	for _, tc := range []struct {
		name   string
		layers []ocispec.Descriptor
		want   error
	}{
		{"ok", []ocispec.Descriptor{file("a", 10), file("b/c", 5)}, nil},
		{"dotdot", []ocispec.Descriptor{file("../a", 1)}, archive.ErrUnsafePath},
		{"inner dotdot", []ocispec.Descriptor{file("b/../../a", 1)}, archive.ErrUnsafePath},
		{"absolute", []ocispec.Descriptor{file("/etc/shadow", 1)}, archive.ErrUnsafePath},
		{"trailing slash", []ocispec.Descriptor{file("a/", 1)}, archive.ErrUnsafePath},
		{"dot", []ocispec.Descriptor{file(".", 1)}, archive.ErrUnsafePath},
		{"berth.json", []ocispec.Descriptor{file("berth.json", 1)}, archive.ErrUnsafePath},
		{"empty title", []ocispec.Descriptor{file("", 1)}, archive.ErrUnsafePath},
		{"no title", []ocispec.Descriptor{{MediaType: FileMediaType}}, ErrNotCheckpoint},
		{"foreign layer", []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageLayerGzip,
			Annotations: map[string]string{ocispec.AnnotationTitle: "a"}}}, ErrNotCheckpoint},
		{"duplicate", []ocispec.Descriptor{file("a", 1), file("a", 1)}, archive.ErrDuplicateEntry},
		{"too many", []ocispec.Descriptor{file("a", 1), file("b", 1), file("c", 1), file("d", 1)}, archive.ErrTooManyEntries},
		{"file too large", []ocispec.Descriptor{file("a", 11)}, archive.ErrFileTooLarge},
		{"negative size", []ocispec.Descriptor{file("a", -1)}, archive.ErrFileTooLarge},
		{"total too large", []ocispec.Descriptor{file("a", 10), file("b", 6)}, archive.ErrTotalTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkLayers(tc.layers, lim)
			if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("checkLayers: %v, want %v", err, tc.want)
			}
		})
	}
}
