package commands

import (
	"context"
	"fmt"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/gpu"
)

// CheckpointNeed is `berthctl checkpoint need --container ID [--host-root DIR]`: what a running
// container will need of a destination that only its own node can tell, read before anything
// is paused: its processes' host PIDs (found by the container's cgroup in DIR/proc,
// move.ContainerPIDs) and, with --gpu ($BERTH_GPU), the device memory they hold on each of this
// node's GPUs (move.GPUNeedOfSource). 'kubectl berth move' runs it in the source node's
// berth-probe pod and sends the answer to the destination's probe ('checkpoint check
// --host-root --need').
func CheckpointNeed() *cobra.Command {
	var (
		id, hostRoot string
		anchor       move.Anchor
		nf           nodeFlags
		output       *format
	)
	cmd := &cobra.Command{
		Use:   "need --container ID [--pod-uid UID | --containerd-namespace NS] [--host-root DIR] [--gpu none|cuda|fake] [-o json]",
		Short: "Print what a running container holds on this node (host PIDs, GPU device memory) as a preflight's need",
		Long: `need finds the processes of the container ID (a CRI or containerd container ID: the cgroup path of
its processes names it) in the /proc of the host mounted at --host-root (default /), and prints,
counting only a cgroup anchored where the container's is: below the pod --pod-uid's cgroup under
kubepods (a CRI container), or /NS/ID at the cgroup root (a containerd container of namespace
--containerd-namespace); with neither, any pod's or namespace's (move.ContainerPIDs),
as the JSON of a move.Need (what 'checkpoint check --need' takes), their host PIDs and, with
--gpu, the device memory they hold on each GPU of this node (model and bytes, as a checkpoint
would record them). PIDs must be host PIDs for the GPU backend: run it in the host's PID
namespace (the berth-probe DaemonSet has hostPID).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if id == "" {
				return fmt.Errorf("--container is required")
			}
			n, err := nf.open()
			if err != nil {
				return err
			}
			var inv gpu.Inventory
			if n.gpu != nil {
				inv = n.gpu.Inventory()
			}
			need, err := move.HeldOnHost(hostRoot, id, anchor, inv)
			if err != nil {
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), need)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pids %v\n", need.PIDs)
			if need.GPU != nil {
				for _, d := range need.GPU.Devices {
					fmt.Fprintf(cmd.OutOrStdout(), "gpu %s %s: %d bytes\n", d.UUID, d.Name, d.MemoryUsed)
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&id, "container", "", "the container's ID (required)")
	f.StringVar(&anchor.PodUID, "pod-uid", "", "the UID of the CRI container's pod: only a cgroup below that pod's counts")
	f.StringVar(&anchor.Namespace, "containerd-namespace", "", "the containerd namespace of a non-CRI container: only /NS/ID counts")
	f.StringVar(&hostRoot, "host-root", "", "where the host's / is mounted (default: this process's /)")
	nf.add(f)
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// Probe is `berthctl probe` (hidden): the main process of the berth-probe DaemonSet's container,
// which does nothing but wait for SIGTERM or SIGINT, so that 'kubectl berth move' has a
// container to exec 'checkpoint need' and 'checkpoint check --host-root' in. It opens nothing
// and listens on nothing.
func Probe() *cobra.Command {
	return &cobra.Command{
		Use:    "probe",
		Short:  "Wait until terminated: the berth-probe DaemonSet's container, exec'd into by kubectl berth move",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			<-ctx.Done()
			return nil
		},
	}
}
