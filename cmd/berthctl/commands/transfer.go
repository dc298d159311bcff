package commands

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/transfer"
)

// sendResult is what `berthctl send -o json` prints.
type sendResult struct {
	// Dir is the checkpoint directory sent, Address the receiver, Name the checkpoint's name in
	// the receiver's root.
	Dir     string `json:"dir"`
	Address string `json:"address"`
	Name    string `json:"name"`
	// Bytes is what was sent, in bytes; Ms the wall time in milliseconds.
	Bytes int64   `json:"bytes"`
	Ms    float64 `json:"ms"`
}

// Send is `berthctl send`.
func Send() *cobra.Command {
	var (
		name   string
		output *format
	)
	cmd := &cobra.Command{
		Use:   "send [--name NAME] [-o text|json] DIR HOST:PORT",
		Short: "Send a checkpoint directory to a 'berthctl receive'",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir, addr := args[0], args[1]
			if name == "" {
				name = filepath.Base(filepath.Clean(dir))
			}
			start := time.Now()
			conn, err := (&net.Dialer{}).DialContext(cmd.Context(), "tcp", addr)
			if err != nil {
				return fmt.Errorf("dial receiver %s: %w", addr, err)
			}
			defer conn.Close()
			n, err := sendOn(cmd.Context(), cmd.ErrOrStderr(), conn, dir, name)
			if err != nil {
				return err
			}
			if output.json() {
				return writeJSON(cmd.OutOrStdout(), sendResult{Dir: dir, Address: addr, Name: name, Bytes: n, Ms: millis(time.Since(start))})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "sent %s as %s (%s)\n", dir, name, humanBytes(n))
			return nil
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "name in the receiver's root (default: the directory's name)")
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	return cmd
}

// sendOn streams a checkpoint directory over conn, showing progress (bytes sent) on progress.
func sendOn(ctx context.Context, progress io.Writer, conn net.Conn, dir, name string) (int64, error) {
	var bar *progressbar.ProgressBar
	res, err := transfer.Send(ctx, conn, dir, name, func(sent, total int64) {
		if bar == nil {
			bar = progressbar.NewOptions64(total, progressbar.OptionSetDescription("sending "+name),
				progressbar.OptionShowBytes(true), progressbar.OptionSetWriter(progress),
				progressbar.OptionThrottle(200*time.Millisecond), progressbar.OptionShowCount(),
				progressbar.OptionOnCompletion(func() { fmt.Fprintln(progress) }))
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

// receiveEvent is one line of `berthctl receive -o json`: the receiver listening, a checkpoint
// received (verified and kept) or rejected.
type receiveEvent struct {
	// Event is "listening", "received" or "rejected".
	Event string `json:"event"`
	// Address is where the receiver listens (listening); From the sender (received, rejected).
	Address string `json:"address,omitempty"`
	From    string `json:"from,omitempty"`
	// Root is the checkpoint root (listening); Path the received checkpoint (received).
	Root string `json:"root,omitempty"`
	Path string `json:"path,omitempty"`
	// Error says why a checkpoint was rejected.
	Error string `json:"error,omitempty"`
}

// Receive is `berthctl receive`.
func Receive() *cobra.Command {
	var (
		listen, root string
		output       *format
	)
	cmd := &cobra.Command{
		Use:   "receive [--root DIR] [--listen ADDR] [-o text|json]",
		Short: "Receive checkpoints into a checkpoint root; only verified checkpoints are kept, nothing is restored",
		Long: `receive listens for 'berthctl send' and 'berthctl migrate --receiver' and writes each checkpoint into
--root once every file's digest matches; it restores nothing. It reports on stderr where it
listens and each checkpoint received or rejected; -o json reports the same on stdout, one JSON
object a line ({"event": "listening"|"received"|"rejected", ...}).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var mu sync.Mutex
			report := func(e receiveEvent, text string, args ...any) {
				mu.Lock()
				defer mu.Unlock()
				if output.json() {
					b, _ := json.Marshal(e)
					fmt.Fprintf(cmd.OutOrStdout(), "%s\n", b)
					return
				}
				fmt.Fprintf(cmd.ErrOrStderr(), text, args...)
			}
			rcv := &transfer.Receiver{Root: root, OnDone: func(remote net.Addr, path string, err error) {
				if err != nil {
					report(receiveEvent{Event: "rejected", From: remote.String(), Error: err.Error()}, "rejected a checkpoint from %s: %v\n", remote, err)
					return
				}
				report(receiveEvent{Event: "received", From: remote.String(), Path: path}, "received %s from %s\n", path, remote)
			}}
			// listen first: a second receiver on a port in use must not touch the first one's staging
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("--listen %s: %w", listen, err)
			}
			go func() { <-cmd.Context().Done(); ln.Close() }()
			// a receiver killed mid-transfer leaves its staging directory: remove it at start
			if err := rcv.CleanStaging(); err != nil {
				ln.Close()
				return fmt.Errorf("--root %s: clean staging directories: %w", root, err)
			}
			report(receiveEvent{Event: "listening", Address: ln.Addr().String(), Root: root},
				"receiving checkpoints on %s into %s\n", ln.Addr(), root)
			if err := rcv.Serve(cmd.Context(), ln); err != nil && cmd.Context().Err() == nil {
				return err
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:7650", "address to listen on (loopback unless told otherwise)")
	cmd.Flags().StringVar(&root, "root", checkpoint.DefaultRoot, "checkpoint root to write into")
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	return cmd
}
