// Command berth-shim-helper does, for containerd-shim-berth-v2, the work whose code the shim does
// not keep loaded in every container's shim process: resolving a tag and pulling a checkpoint
// from a registry for a berth.dev/restore-from=oci://... restore (package oci/registry), and
// reading the credentials of a checkpoint's processes from its CRIU images at restore (package
// criu/images). The shim runs it once per request, as `berth-shim-helper serve`, with the
// request as JSON on standard input and the answer as JSON on standard output (package
// shim/helper). On a CUDA node the shim also runs one `berth-shim-helper gpu-inventory` from its
// first GPU checkpoint or restore on, until the shim has been idle for a minute: it reads the
// GPU inventory through NVML (package gpu/nvml) and answers one JSON request per line. Install it
// beside containerd-shim-berth-v2 (or anywhere in containerd's PATH); it is not meant to be run
// by hand.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/berth-dev/berth/oci/privilege/seccompload"
	"github.com/berth-dev/berth/shim/helper"
	"github.com/berth-dev/berth/shim/helper/serve"
)

func main() {
	switch {
	case len(os.Args) == 2 && os.Args[1] == helper.Command:
		os.Exit(run())
	case len(os.Args) == 2 && os.Args[1] == seccompload.ChildCommand:
		// the child of a seccomp check: loads the profile on standard input as runc does
		os.Exit(seccompload.Child(os.Stdin, os.Stdout))
	case len(os.Args) == 2 && os.Args[1] == helper.InventoryCommand:
		// until standard input ends (the shim closed it or exited) or the shim is idle
		os.Exit(helper.ServeInventory(os.Stdin, os.Stdout, serve.OpenInventory, helper.InventoryIdle))
	}
	fmt.Fprintf(os.Stderr, "usage: %s %s < request.json, or %s %s < requests (run by containerd-shim-berth-v2, not by hand)\n",
		helper.Name, helper.Command, helper.Name, helper.InventoryCommand)
	os.Exit(2)
}

// run answers the one request on standard input. The shim stops a canceled request with
// SIGTERM: the context ends and a pull removes what it staged.
func run() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	return helper.Serve(ctx, os.Stdin, os.Stdout, serve.Handlers())
}
