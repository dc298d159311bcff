//go:build !cgo

package nvml

import "fmt"

// Open needs cgo (go-nvml); this build has none, so it returns an error wrapping ErrNotLoaded
// (hence gpu.ErrUnsupported). Build with CGO_ENABLED=1 to read a live node.
func Open(opts ...Option) (*Inventory, error) {
	return nil, fmt.Errorf("read GPUs through NVML: this binary was built without cgo (rebuild with CGO_ENABLED=1): %w", ErrNotLoaded)
}
