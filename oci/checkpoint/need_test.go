package checkpoint

import "testing"

func TestMemoryBytes(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    *Manifest
		want int64
	}{
		{"nil", nil, 0},
		{"stats", &Manifest{CRIU: CRIUStats{PagesWritten: 10}}, 10 * PageSize},
		{"files", &Manifest{Files: []File{{Path: "checkpoint/pages-1.img", Size: 8192}, {Path: "checkpoint/pages-2.img", Size: 100}, {Path: "checkpoint/core-1.img", Size: 1 << 20}}}, 8292},
		{"larger of both", &Manifest{CRIU: CRIUStats{PagesWritten: 1}, Files: []File{{Path: "pages-1.img", Size: 3 * PageSize}}}, 3 * PageSize},
	} {
		if got := tc.m.MemoryBytes(); got != tc.want {
			t.Errorf("%s: MemoryBytes() = %d, want %d", tc.name, got, tc.want)
		}
	}
}
