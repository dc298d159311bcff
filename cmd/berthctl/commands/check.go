package commands

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// CheckpointCheck is `berthctl checkpoint check`: the destination preflight of a move by hand.
func CheckpointCheck(g *Globals) *cobra.Command {
	var (
		on, root, receiver, needJSON, name, hostRoot string
		nf                                           nodeFlags
		tf                                           *tlsFlags
		output                                       *format
	)
	cmd := &cobra.Command{
		Use:   "check (--on SOCKET [-n NS] [--root DIR] | --receiver HOST:PORT [--tls-ca CA --tls-cert CERT --tls-key KEY] | --host-root DIR) [-o text|json] DIR|ARCHIVE|--need JSON",
		Short: "Check that the node of containerd SOCKET (this host), or of a 'berthctl receive', can restore a checkpoint, before it is moved there",
		Long: `check reads the checkpoint's berth.json and spec.dump (a directory, or a tar archive of one) and
checks the node that containerd --on runs on (this host): the image with the checkpoint's digest
in namespace -n, every bind source of the spec, the memory limit against the checkpoint's memory
pages, free memory, namespaces joined by path, free disk under --root (default checkpoint_root of
--config), the fingerprint (CRIU, kernel, CPU, runc, containerd) and, with --gpu, the device
memory free on this node's GPUs of the checkpoint's models (mapped as the shim will map them:
each checkpointed GPU onto one with at least the memory the container held). Each refusal names the
field, its value there and what the checkpoint needs; the exit status is non-zero when any.

--receiver HOST:PORT asks the node of a 'berthctl receive' instead, over the receive protocol's
preflight query (the TLS flags as 'berthctl send''s): the checks that need that node (bind
sources, free memory, PIDs, free disk under its --root, the fingerprint, with its --gpu the
device memory), each answered by the receiver with the root and GPU backend it will use; the
image is not checked there. --need JSON checks a move.Need (what 'kubectl berth move' asks of the
destination's berth agent before it checkpoints anything) instead of a checkpoint; --name is the
checkpoint name the query names (default: the checkpoint's base name, else "preflight").

--host-root DIR checks the host whose / is mounted at DIR (read-only is enough) from a container
that has no containerd socket: the berth-probe DaemonSet of contrib/kubernetes, where 'kubectl
berth move' runs it with --need. The same checks as --on, less the image and the fingerprint
(which need containerd and CRIU): every bind source (looked up under DIR, symlinks resolved
inside it), PIDs in DIR/proc when the container shares the host's PID namespace, free memory,
free disk under --root when given, and with --gpu ($BERTH_GPU) the device memory free on this
node's GPUs.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if (len(args) == 1) == (needJSON != "") {
				return fmt.Errorf("name a checkpoint DIR|ARCHIVE, or --need JSON (one of them)")
			}
			if n := btoi(on != "") + btoi(receiver != "") + btoi(hostRoot != ""); n != 1 {
				return fmt.Errorf("one of --on (the destination containerd socket, this host), --receiver (a berthctl receive) or --host-root (the host's / as mounted here) is required, not %d", n)
			}
			var need move.Need
			what := "--need"
			if needJSON != "" {
				if err := json.Unmarshal([]byte(needJSON), &need); err != nil {
					return fmt.Errorf("--need: %w", err)
				}
			} else {
				what = args[0]
				var err error
				if need, err = move.NeedOfCheckpoint(args[0]); err != nil {
					return err
				}
			}
			if receiver != "" {
				if name == "" {
					name = "preflight"
					if needJSON == "" {
						name = strings.TrimSuffix(filepath.Base(filepath.Clean(args[0])), ".tar")
					}
				}
				refusals, err := remotePreflight(ctx, receiver, tf, name, need)
				if err != nil {
					return fmt.Errorf("checkpoint check %s on %s: %w", what, receiver, err)
				}
				return reportCheck(cmd, output, checkResult{Checkpoint: what, On: receiver, OK: len(refusals) == 0, Refusals: refusals},
					"bind sources, memory, PIDs, disk, fingerprint, GPU memory as the receiver's node checks them", move.MergeRefusals(refusals, nil))
			}
			if hostRoot != "" {
				return checkHostRoot(cmd, nf, output, hostRoot, root, what, need)
			}
			ns, err := g.namespace()
			if err != nil {
				return err
			}
			if root, err = g.checkpointRoot(cmd.Flags(), root); err != nil {
				return err
			}
			n, err := nf.open()
			if err != nil {
				return err
			}
			c, err := connect(ctx, "--on", "destination", on)
			if err != nil {
				return err
			}
			defer c.Close()
			dst := move.Destination{
				Client: c, Namespace: ns, Local: true, Root: root,
				Fingerprint: func(ctx context.Context) (fingerprint.Fingerprint, error) { return n.fingerprint(ctx) },
			}
			if n.gpu != nil {
				dst.GPUs = n.gpu.Inventory()
			}
			perr := move.Preflight(ctx, dst, need)
			var pe *move.PreflightError
			if perr != nil && !errors.As(perr, &pe) {
				return perr
			}
			res := checkResult{Checkpoint: what, On: on, OK: perr == nil, Refusals: []move.Refusal{}}
			if pe != nil {
				res.Refusals = pe.Refusals
			}
			checked := "image, bind sources, memory, namespaces, disk, fingerprint"
			if dst.GPUs != nil {
				checked += ", GPU memory"
			}
			return reportCheck(cmd, output, res, checked, perr)
		},
	}
	f := cmd.Flags()
	f.StringVar(&on, "on", "", "destination containerd socket (required; its node is this host)")
	f.StringVar(&receiver, "receiver", "", "ask the node of the 'berthctl receive' at HOST:PORT instead of this host")
	f.StringVar(&needJSON, "need", "", "check this move.Need (JSON) instead of a checkpoint")
	f.StringVar(&name, "name", "", "with --receiver: the checkpoint name the query names")
	f.StringVar(&hostRoot, "host-root", "", "check the host whose / is mounted at DIR (a probe container) instead of --on's")
	tf = addTLSFlags(f)
	tf.addServerName(f)
	f.StringVar(&root, "root", "", "destination checkpoint root, for the free disk (default: checkpoint_root of --config, else "+checkpoint.DefaultRoot+")")
	nf.add(f)
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// checkHostRoot is `checkpoint check --host-root DIR`: need checked against the host mounted at
// hostRoot (move.Destination.HostRoot) with nf's GPU backend, free disk under root only when
// given (a path on that host).
func checkHostRoot(cmd *cobra.Command, nf nodeFlags, output *format, hostRoot, root, what string, need move.Need) error {
	n, err := nf.open()
	if err != nil {
		return err
	}
	dst := move.Destination{Local: true, HostRoot: hostRoot, Root: root}
	checked := "bind sources, PIDs, memory, namespaces"
	if root != "" {
		checked += ", disk"
	}
	if n.gpu != nil {
		dst.GPUs = n.gpu.Inventory()
		checked += ", GPU memory"
	}
	perr := move.Preflight(cmd.Context(), dst, need)
	var pe *move.PreflightError
	if perr != nil && !errors.As(perr, &pe) {
		return fmt.Errorf("checkpoint check %s on the host at %s: %w", what, hostRoot, perr)
	}
	res := checkResult{Checkpoint: what, On: "host " + hostRoot, OK: perr == nil, Refusals: []move.Refusal{}}
	if pe != nil {
		res.Refusals = pe.Refusals
	}
	return reportCheck(cmd, output, res, checked, perr)
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// reportCheck prints res (-o json: as JSON; else one line, or the refusals) and returns perr
// (the refusals as an error, nil when none) wrapped with what was checked.
func reportCheck(cmd *cobra.Command, output *format, res checkResult, checked string, perr error) error {
	if res.Refusals == nil {
		res.Refusals = []move.Refusal{}
	}
	if output.json() {
		if err := writeJSON(cmd.OutOrStdout(), res); err != nil {
			return err
		}
	} else if res.OK {
		fmt.Fprintf(cmd.OutOrStdout(), "ok: %s can be restored on %s (%s)\n", res.Checkpoint, res.On, checked)
	} else {
		fmt.Fprintf(cmd.OutOrStdout(), "refused: %s cannot be restored on %s:\n", res.Checkpoint, res.On)
		for _, r := range res.Refusals {
			fmt.Fprintf(cmd.OutOrStdout(), "  %s\n", r)
		}
	}
	if perr != nil {
		return fmt.Errorf("checkpoint check %s: %w", res.Checkpoint, perr)
	}
	return nil
}

// checkResult is what `berthctl checkpoint check` prints with -o json.
type checkResult struct {
	Checkpoint string         `json:"checkpoint"`
	On         string         `json:"on"`
	OK         bool           `json:"ok"`
	Refusals   []move.Refusal `json:"refusals"`
}
