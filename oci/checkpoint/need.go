package checkpoint

import (
	"path"
	"strings"
)

// PageSize is the size of the memory pages CRIU counts in CRIUStats, in bytes (4 KiB on every
// architecture berth runs on).
const PageSize = 4096

// MemoryBytes is the memory the checkpoint's processes hold once restored, in bytes: the memory
// pages CRIU wrote (CRIU.PagesWritten), or, when the manifest records no statistics, the size of
// its pages-*.img files. A restore needs at least this much under the container's memory limit
// and free on the node; 0 when the manifest says neither.
func (m *Manifest) MemoryBytes() int64 {
	if m == nil {
		return 0
	}
	stats := int64(m.CRIU.PagesWritten) * PageSize
	var files int64
	for _, f := range m.Files {
		if b := path.Base(f.Path); strings.HasPrefix(b, "pages-") && strings.HasSuffix(b, ".img") {
			files += f.Size
		}
	}
	return max(stats, files)
}
