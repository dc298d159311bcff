package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/transfer"
)

func init() {
	subcommands = append(subcommands, migrateCmd, receiveCmd, sendCmd, restoreCmd)
}

func migrateCmd() *cobra.Command {
	var (
		from, to, ns, receiver, toRoot, targetID, workDir, name, logPath string
		leaveRunning, keep                                               bool
	)
	cmd := &cobra.Command{
		Use:   "migrate --from SOCKET --to SOCKET [--namespace NS] CONTAINER",
		Short: "Move a running container to another containerd node: checkpoint, send, verify, restore, stop the source",
		Long: `migrate checkpoints CONTAINER on the source containerd (paused while it is dumped and moved),
sends the checkpoint over a socket to a receiver that verifies it into the destination's checkpoint
root, restores it there with the berth runtime, and only then stops the source (--leave-running
keeps it). Without --receiver, a receiver is started in this process on 127.0.0.1, writing into
--to-root (the destination shim's checkpoint_root). With --receiver HOST:PORT, a 'berthctl receive'
already running on the destination host is used: the same path across a network.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) (retErr error) {
			ctx := cmd.Context()
			id := args[0]
			defer func() {
				if retErr != nil && !strings.HasPrefix(retErr.Error(), "migrate ") {
					retErr = fmt.Errorf("migrate %s: %w", id, retErr)
				}
			}()
			if from == "" || to == "" {
				return fmt.Errorf("--from and --to are required (containerd socket paths)")
			}
			src, err := connect(ctx, "source", from)
			if err != nil {
				return err
			}
			defer src.Close()
			dst, err := connect(ctx, "destination", to)
			if err != nil {
				return err
			}
			defer dst.Close()
			if err := targetFree(ctx, dst, ns, orDefault(targetID, id)); err != nil {
				return err
			}
			if name == "" {
				name = fmt.Sprintf("%s-%s", id, time.Now().UTC().Format("20060102T150405Z"))
			}
			if workDir == "" {
				workDir = filepath.Join(os.TempDir(), "berth-migrate")
			}
			if err := os.MkdirAll(workDir, 0o700); err != nil {
				return err
			}
			addr := receiver
			if addr == "" {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					return err
				}
				defer ln.Close()
				// The in-process receiver does not fsync: a migration restores the checkpoint at
				// once, and if anything fails the source is resumed, so the copy never has to
				// outlive a crash. A standalone `berthctl receive` keeps checkpoints durably.
				rcv := &transfer.Receiver{Root: toRoot, NoSync: true}
				go rcv.Serve(ctx, ln) //nolint:errcheck // ends with ln.Close
				addr = ln.Addr().String()
			}
			// dial the receiver before the source is paused: an unreachable destination costs nothing
			raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return fmt.Errorf("dial receiver %s: %w", addr, err)
			}
			defer raw.Close()
			conn, err := transfer.Handshake(raw) // a wrong or stalled peer is found before the pause
			if err != nil {
				return fmt.Errorf("receiver %s: %w", addr, err)
			}
			send := func(ctx context.Context, dir, name string) (int64, error) { return sendOn(ctx, conn, dir, name) }
			res, err := move.Migrate(ctx, move.MigrateOptions{
				Src: src, Dst: dst, Namespace: ns, ID: id, TargetID: targetID,
				WorkDir: filepath.Join(workDir, name), KeepLocal: keep, Name: name,
				Send:         send,
				LeaveRunning: leaveRunning, LogPath: logPath,
			})
			if err != nil {
				return err
			}
			var total float64
			fmt.Printf("migrated %s -> %s as %s (%s sent, checkpoint %s)\n", id, to, orDefault(targetID, id), humanBytes(res.Bytes), name)
			for _, p := range res.Manifest.Phases {
				fmt.Printf("  %-32s %9.1f ms\n", "checkpoint/"+p.Name, p.Ms)
			}
			for _, p := range res.Phases {
				fmt.Printf("  %-32s %9.1f ms\n", p.Name, p.Ms)
				total += p.Ms
			}
			fmt.Printf("  %-32s %9.1f ms\n", "total", total)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "source containerd socket")
	f.StringVar(&to, "to", "", "destination containerd socket")
	f.StringVarP(&ns, "namespace", "n", "default", "containerd namespace")
	f.StringVar(&receiver, "receiver", "", "HOST:PORT of a 'berthctl receive' on the destination (default: one in this process)")
	f.StringVar(&toRoot, "to-root", "/var/lib/berth/checkpoints", "destination checkpoint root (the shim's checkpoint_root), for the in-process receiver")
	f.StringVar(&targetID, "target-id", "", "container id on the destination (default: the same id)")
	f.StringVar(&workDir, "work-dir", "", "where the source checkpoint is written (default $TMPDIR/berth-migrate)")
	f.StringVar(&name, "name", "", "checkpoint name in the destination root (default ID-TIMESTAMP)")
	f.StringVar(&logPath, "log", "", "file for the restored task's stdout/stderr on the destination")
	f.BoolVar(&leaveRunning, "leave-running", false, "keep the source container running after the move")
	f.BoolVar(&keep, "keep-local", false, "keep the source-side checkpoint directory after the move")
	return cmd
}

// sender returns a function that dials addr and streams a checkpoint directory with a progress bar.
func sender(addr string) func(ctx context.Context, dir, name string) (int64, error) {
	return func(ctx context.Context, dir, name string) (int64, error) {
		conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err != nil {
			return 0, fmt.Errorf("dial receiver %s: %w", addr, err)
		}
		defer conn.Close()
		return sendOn(ctx, conn, dir, name)
	}
}

// sendOn streams a checkpoint directory over conn, showing progress (bytes sent) on stderr.
func sendOn(ctx context.Context, conn net.Conn, dir, name string) (int64, error) {
	{
		var bar *progressbar.ProgressBar
		res, err := transfer.Send(ctx, conn, dir, name, func(sent, total int64) {
			if bar == nil {
				bar = progressbar.NewOptions64(total, progressbar.OptionSetDescription("sending "+name),
					progressbar.OptionShowBytes(true), progressbar.OptionSetWriter(os.Stderr),
					progressbar.OptionThrottle(200*time.Millisecond), progressbar.OptionShowCount(),
					progressbar.OptionOnCompletion(func() { fmt.Fprintln(os.Stderr) }))
			}
			_ = bar.Set64(sent)
		})
		if bar != nil {
			_ = bar.Finish()
		}
		if err != nil {
			return 0, err
		}
		return res.Bytes, nil
	}
}

func receiveCmd() *cobra.Command {
	var listen, root string
	cmd := &cobra.Command{
		Use:   "receive --root DIR [--listen ADDR]",
		Short: "Receive checkpoints into a checkpoint root; only verified checkpoints are kept, nothing is restored",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen %s: %w", listen, err)
			}
			go func() { <-cmd.Context().Done(); ln.Close() }()
			rcv := &transfer.Receiver{Root: root, OnDone: func(remote net.Addr, path string, err error) {
				if err != nil {
					fmt.Fprintf(os.Stderr, "rejected a checkpoint from %s: %v\n", remote, err)
					return
				}
				fmt.Fprintf(os.Stderr, "received %s from %s\n", path, remote)
			}}
			// a receiver killed mid-transfer leaves its staging directory: remove it at start
			if err := rcv.CleanStaging(); err != nil {
				return fmt.Errorf("clean staging directories in %s: %w", root, err)
			}
			fmt.Fprintf(os.Stderr, "receiving checkpoints on %s into %s\n", ln.Addr(), root)
			if err := rcv.Serve(cmd.Context(), ln); err != nil && cmd.Context().Err() == nil {
				return err
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:7650", "address to listen on (loopback unless told otherwise)")
	cmd.Flags().StringVar(&root, "root", "/var/lib/berth/checkpoints", "checkpoint root to write into")
	return cmd
}

func sendCmd() *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "send DIR HOST:PORT",
		Short: "Send a checkpoint directory to a 'berthctl receive'",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if name == "" {
				name = filepath.Base(filepath.Clean(args[0]))
			}
			n, err := sender(args[1])(cmd.Context(), args[0], name)
			if err != nil {
				return err
			}
			fmt.Printf("sent %s as %s (%s)\n", args[0], name, humanBytes(n))
			return nil
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "name in the receiver's root (default: the directory's name)")
	return cmd
}

func restoreCmd() *cobra.Command {
	var address, ns, id, logPath, root string
	cmd := &cobra.Command{
		Use:   "restore --address SOCKET --id ID CHECKPOINT",
		Short: "Restore a received checkpoint (a name in the checkpoint root) as a new container with the berth runtime",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := connect(cmd.Context(), "destination", address)
			if err != nil {
				return err
			}
			defer c.Close()
			if id != "" {
				if err := targetFree(cmd.Context(), c, ns, id); err != nil {
					return err
				}
			}
			dir := args[0]
			if !filepath.IsAbs(dir) {
				dir = filepath.Join(root, dir)
			}
			if id == "" {
				return fmt.Errorf("--id is required")
			}
			start := time.Now()
			if _, err := move.Restore(cmd.Context(), c, move.RestoreOptions{
				Namespace: ns, ID: id, Ref: args[0], Dir: dir, LogPath: logPath,
			}); err != nil {
				return err
			}
			fmt.Printf("restored %s from %s in %.1f ms\n", id, args[0], float64(time.Since(start).Microseconds())/1000)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&address, "address", "a", "/run/containerd/containerd.sock", "containerd socket")
	f.StringVarP(&ns, "namespace", "n", "default", "containerd namespace")
	f.StringVar(&id, "id", "", "id of the container to create")
	f.StringVar(&root, "root", "/var/lib/berth/checkpoints", "checkpoint root (the shim's checkpoint_root)")
	f.StringVar(&logPath, "log", "", "file for the restored task's stdout/stderr")
	return cmd
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// targetFree returns an error when container id already exists in namespace ns of c: a move or
// restore under that id would fail only after the checkpoint was taken and sent.
func targetFree(ctx context.Context, c *containerd.Client, ns, id string) error {
	if _, err := c.LoadContainer(namespaces.WithNamespace(ctx, ns), id); err == nil {
		return fmt.Errorf("container %s already exists on the destination (namespace %s): remove it or choose another id (--target-id / --id)", id, ns)
	}
	return nil
}
