package commands

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/term"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
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

// tlsFlags are the mutual-TLS flags of the commands that move checkpoints between nodes: this
// node's identity in the cluster's transfer PKI (transfer.TLSFiles), and for a sender the name
// the receiver's certificate must carry.
type tlsFlags struct {
	files      transfer.TLSFiles
	serverName string
}

// The environment variables the TLS flags default to, so that a node agent's container
// (contrib/kubernetes/berth-agent-daemonset.yaml) configures them once for every command run in
// it.
const (
	EnvTLSCA         = "BERTH_TLS_CA"
	EnvTLSCert       = "BERTH_TLS_CERT"
	EnvTLSKey        = "BERTH_TLS_KEY"
	EnvTLSServerName = "BERTH_TLS_SERVER_NAME"
)

func addTLSFlags(fs *pflag.FlagSet) *tlsFlags {
	t := &tlsFlags{}
	fs.StringVar(&t.files.CA, "tls-ca", os.Getenv(EnvTLSCA), "the cluster CA's certificate (PEM; cert-manager's ca.crt): the only issuer a peer's certificate may have ($"+EnvTLSCA+")")
	fs.StringVar(&t.files.Cert, "tls-cert", os.Getenv(EnvTLSCert), "this node's certificate (PEM; tls.crt), for both ends of a transfer ($"+EnvTLSCert+")")
	fs.StringVar(&t.files.Key, "tls-key", os.Getenv(EnvTLSKey), "the private key of --tls-cert (PEM; tls.key) ($"+EnvTLSKey+")")
	return t
}

// addServerName registers --tls-server-name (a sender's).
func (t *tlsFlags) addServerName(fs *pflag.FlagSet) {
	fs.StringVar(&t.serverName, "tls-server-name", os.Getenv(EnvTLSServerName), "the name the receiver's certificate must carry (default: the host of HOST:PORT) ($"+EnvTLSServerName+")")
}

// server returns the receiving side's TLS configuration, nil when no TLS flag is given.
func (t *tlsFlags) server() (*tls.Config, error) {
	if !t.files.Enabled() {
		return nil, nil
	}
	return transfer.ServerTLS(t.files)
}

// client returns the sending side's TLS configuration, nil when no TLS flag is given.
func (t *tlsFlags) client() (*tls.Config, error) {
	if !t.files.Enabled() {
		return nil, nil
	}
	return transfer.ClientTLS(t.files, t.serverName)
}

// dialReceiver connects to the receiver at addr, over TLS when the flags configure it, and
// waits for its greeting (transfer.Dial: plain TCP only to loopback).
func dialReceiver(ctx context.Context, addr string, t *tlsFlags) (net.Conn, error) {
	cfg, err := t.client()
	if err != nil {
		return nil, err
	}
	conn, err := transfer.Dial(ctx, addr, cfg)
	if err != nil {
		return nil, err
	}
	return conn, nil
}

// remotePreflight asks the receiver at addr (dialed like the transfer, with t's TLS) to check
// need against its node (move.RemotePreflight) for the checkpoint name, and returns its refusals.
func remotePreflight(ctx context.Context, addr string, t *tlsFlags, name string, need move.Need) ([]move.Refusal, error) {
	conn, err := dialReceiver(ctx, addr, t)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return move.RemotePreflight(ctx, conn, name, need)
}

// Send is `berthctl send`.
func Send() *cobra.Command {
	var (
		name   string
		tf     *tlsFlags
		output *format
	)
	cmd := &cobra.Command{
		Use:   "send [--name NAME] [--tls-ca CA --tls-cert CERT --tls-key KEY] [--tls-server-name NAME] [-o text|json] DIR|FILE.tar HOST:PORT",
		Short: "Send a checkpoint directory, or a kubelet checkpoint archive, to a 'berthctl receive'",
		Long: `send streams the checkpoint directory DIR (berth.json, berth.sig and every file) to the
'berthctl receive' at HOST:PORT, which verifies the digests and the signature before it keeps it.
A FILE.tar is a CRI checkpoint archive (the kubelet checkpoint API's, crictl checkpoint --export's)
of the berth runtime: it is sent as it is, and the receiver keeps it as a directory of the same
layout once the CRIU images match the shim's checkpoint/berth.json and its berth.sig is trusted
(name it in berth.dev/restore-from). --name defaults to the file's name without .tar.
To any address but loopback it goes over mutual TLS only: --tls-ca, --tls-cert and --tls-key name
this node's certificate in the cluster's transfer PKI (cert-manager's ca.crt, tls.crt, tls.key).
A receiver with all its slots in use answers busy: nothing is sent; try again later.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir, addr := args[0], args[1]
			fi, err := os.Stat(dir)
			if err != nil {
				return err
			}
			if name == "" {
				name = strings.TrimSuffix(filepath.Base(filepath.Clean(dir)), ".tar")
			}
			start := time.Now()
			conn, err := dialReceiver(cmd.Context(), addr, tf)
			if err != nil {
				return err
			}
			defer conn.Close()
			n, err := sendOn(cmd.Context(), cmd.ErrOrStderr(), conn, dir, name, fi.Mode().IsRegular())
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
	tf = addTLSFlags(cmd.Flags())
	tf.addServerName(cmd.Flags())
	output = addFormat(cmd.Flags(), formatText, formatJSON)
	return cmd
}

// sendOn streams a checkpoint directory, or with criArchive the CRI checkpoint archive at dir,
// over conn (greeted: transfer.Dial), showing progress (bytes sent) on progress when it is a
// terminal (a bar redrawn with carriage returns only clutters a log or a pipe).
func sendOn(ctx context.Context, progress io.Writer, conn net.Conn, dir, name string, criArchive bool) (int64, error) {
	if f, ok := progress.(*os.File); !ok || !term.IsTerminal(int(f.Fd())) {
		progress = nil
	}
	var bar *progressbar.ProgressBar
	send := transfer.Send
	if criArchive {
		send = transfer.SendCRIArchive
	}
	res, err := send(ctx, conn, dir, name, func(sent, total int64) {
		if progress == nil {
			return
		}
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
	// TLS reports whether the receiver requires mutual TLS (listening).
	TLS  bool   `json:"tls,omitempty"`
	Path string `json:"path,omitempty"`
	// Error says why a checkpoint was rejected.
	Error string `json:"error,omitempty"`
	// Answer is the answer to a preflight query (move.PreflightAnswer).
	Answer json.RawMessage `json:"answer,omitempty"`
}

// Receive is `berthctl receive`, keeping what the trust policy of g's --config admits.
func Receive(g *Globals) *cobra.Command {
	var (
		listen, root    string
		allowed         []string
		transferTimeout time.Duration
		noSync          bool
		tf              *tlsFlags
		trust           *trustFlags
		output          *format
		nf              nodeFlags
	)
	cmd := &cobra.Command{
		Use:   "receive [--root DIR] [--listen ADDR] [--tls-ca CA --tls-cert CERT --tls-key KEY [--allowed-peer NAME]...] [--gpu cuda|fake] [-o text|json]",
		Short: "Receive checkpoints into a checkpoint root; only verified, trusted checkpoints are kept, nothing is restored",
		Long: `receive listens for 'berthctl send' and 'berthctl migrate --receiver' and writes each checkpoint into
--root (default: checkpoint_root of --config) once every file's digest matches its berth.json and
its berth.sig is the signature of a key the node trusts (trusted_keys of --config, --trusted-key);
anything else is refused before it is renamed into place, and nothing of it is
left. It restores nothing, and it signs nothing: it never reads signing_key of --config (list
this node's own public key in trusted_keys for it to take this node's checkpoints), so the node's
private key need not be where it runs.
Off loopback it listens only with mutual TLS (--tls-ca, --tls-cert, --tls-key); without TLS, on
loopback, it accepts only connections from root's sockets. With TLS senders must
present a certificate of the same CA, and with --allowed-peer one that names an allowed peer (a
DNS, IP or URI subject alternative name, or the common name). A peer that does not finish its TLS
handshake within 3 s loses its place; one address holds at most 8 places at once (64 in all); a whole transfer is bounded by --transfer-timeout; a
checkpoint that does not fit the free space (with 1 GiB to spare) is refused before it is written;
a sender beyond 4 at once is answered busy.
It also answers 'berthctl migrate --receiver' before the source is paused: the checks that need
this node (every bind source, free memory, PIDs in a shared host PID namespace, free disk under
--root, the fingerprint when the query carries one and, with --gpu, device memory free on GPUs of
the container's models), each refusal naming the field, its value here and what is needed.
It reports on stderr where it listens and each checkpoint received or rejected; -o json reports
the same on stdout, one JSON object a line ({"event": "listening"|"received"|"rejected"|"preflight", ...}).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if root, err = g.checkpointRoot(cmd.Flags(), root); err != nil {
				return err
			}
			policy, err := trust.policy(g)
			if err != nil {
				return err
			}
			cfg, err := tf.server()
			if err != nil {
				return err
			}
			if len(allowed) > 0 && cfg == nil {
				return fmt.Errorf("--allowed-peer names certificates: it needs %s", transfer.TLSFlags)
			}
			if transferTimeout < 0 {
				return fmt.Errorf("--transfer-timeout %s: must not be negative", transferTimeout)
			}
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
			verify := func(ctx context.Context, dir string) error {
				_, err := verifyCheckpoint(ctx, policy, dir, &lockedWriter{mu: &mu, w: cmd.ErrOrStderr()})
				return err
			}
			n, err := nf.open()
			if err != nil {
				return err
			}
			here := move.Destination{Local: true, Root: root,
				Fingerprint: func(ctx context.Context) (fingerprint.Fingerprint, error) { return n.fingerprint(ctx) }}
			if n.gpu != nil {
				here.GPUs = n.gpu.Inventory()
			}
			rcv := &transfer.Receiver{Root: root, Verify: verify, AllowedPeers: allowed, TransferTimeout: transferTimeout, NoSync: noSync,
				VerifySignature: func(ctx context.Context, dir string) error { _, err := policy.VerifyAnyNamespace(ctx, dir); return err },
				LazyGuard:       lazyGuardArgv(),
				Preflight: func(ctx context.Context, q json.RawMessage) (json.RawMessage, error) {
					a, err := move.AnswerPreflight(ctx, here, q)
					if err == nil {
						report(receiveEvent{Event: "preflight", Answer: a}, "answered a preflight query: %s\n", a)
					}
					return a, err
				},
				OnDone: func(remote net.Addr, path string, err error) {
					if err == nil && path == "" { // a preflight query (reported above) or a page stream
						return
					}
					if err != nil {
						report(receiveEvent{Event: "rejected", From: remote.String(), Error: err.Error()}, "rejected a checkpoint from %s: %v\n", remote, err)
						return
					}
					report(receiveEvent{Event: "received", From: remote.String(), Path: path}, "received %s from %s\n", path, remote)
				}}
			// listen first: a second receiver on a port in use must not touch the first one's staging
			ln, err := transfer.Listen(listen, cfg)
			if err != nil {
				return fmt.Errorf("--listen %s: %w", listen, err)
			}
			go func() { <-cmd.Context().Done(); ln.Close() }()
			// a receiver killed mid-transfer leaves its staging directory: remove it at start
			if err := rcv.CleanStaging(); err != nil {
				ln.Close()
				return fmt.Errorf("--root %s: clean staging directories: %w", root, err)
			}
			mode := "plain TCP, loopback only"
			if cfg != nil {
				mode = "mutual TLS"
			}
			report(receiveEvent{Event: "listening", Address: ln.Addr().String(), Root: root, TLS: cfg != nil},
				"receiving checkpoints on %s (%s) into %s\n", ln.Addr(), mode, root)
			if _, err := rcv.PageServer(); err != nil { // stored checkpoints still arrive
				fmt.Fprintf(cmd.ErrOrStderr(), "berthctl receive: copy-mode and lazy page streams will fail: %v\n", err)
			}
			if err := rcv.Serve(cmd.Context(), ln); err != nil && cmd.Context().Err() == nil {
				return err
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:7650", "address to listen on (anything but loopback needs --tls-ca, --tls-cert and --tls-key)")
	f.StringVar(&root, "root", "", "checkpoint root to write into (default: checkpoint_root of --config, else "+checkpoint.DefaultRoot+")")
	f.StringArrayVar(&allowed, "allowed-peer", nil, "accept only senders whose certificate names this (SAN or CN; repeatable; default: any the CA issued)")
	f.DurationVar(&transferTimeout, "transfer-timeout", 0, "bound on one whole transfer, handshake to verdict (0: 30m)")
	f.BoolVar(&noSync, "no-sync", false, "do not fsync received checkpoints: for checkpoints restored at once (the agents of kubectl berth move); after a crash one may be torn, and its restore then reads and refuses it (a verification stamp does not outlive a reboot)")
	tf = addTLSFlags(f)
	trust = addTrustFlags(f, false, true)
	trust.verifyOnly = true // receive verifies, never signs: it does not read signing_key
	nf.add(f)
	output = addFormat(f, formatText, formatJSON)
	return cmd
}

// lockedWriter serializes writes to w with the mutex the command's other output holds.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
