// Command containerd-shim-berth-v2 is berth's containerd shim (runtime type
// io.containerd.berth.v2): runc's shim with GPU-aware checkpoint and restore. Put it on
// containerd's PATH and name the runtime in containerd's config or in a RuntimeClass.
package main

import (
	"context"

	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/shim"

	"github.com/berth-dev/berth/oci"
	berth "github.com/berth-dev/berth/shim"
)

func main() {
	berth.Register(berth.ConfigPath())
	shim.RunShim(context.Background(), berth.GuardManager(manager.NewShimManager(oci.RuntimeName)))
}
