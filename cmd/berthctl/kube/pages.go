package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/streaming/pkg/httpstream"
)

// Move modes (Options.Mode).
const (
	// ModeCopy: the memory pages go from CRIU on the source node straight to the destination's
	// agent while the kubelet checkpoints (PageStreams); the kubelet's archive holds the rest.
	ModeCopy = "copy"
	// ModeStored: the kubelet's archive holds everything, pages included, and is sent whole.
	ModeStored = "stored"
)

// PageStreams is what a Transfer that can carry copy-mode page streams also has (Agents).
type PageStreams interface {
	// ArmPages arms a page stream for the checkpoint call of the container with containerd id
	// container on node src whose timeout is timeout seconds
	// (checkpoint.PageStreamRequest.CheckpointTimeout: the kubelet API's ?timeout=), toward
	// dst's receiver under the checkpoint name name, and returns once it is armed (the kubelet
	// may be asked from then on).
	ArmPages(ctx context.Context, src, dst, container, name string, timeout int64) (PageStream, error)
}

// PageStream is an armed page stream.
type PageStream interface {
	// Wait returns the bytes forwarded once the stream ended (the checkpoint's dump sent every
	// page, the destination's page server exited), or why it failed.
	Wait(ctx context.Context) (int64, error)
	// Disarm removes the request unless a checkpoint took it, and reports whether it did
	// (true: no checkpoint took it, and the armed command ends; Wait then returns its error).
	// The caller disarms as soon as its checkpoint call returned. Errors: the disarm command's.
	Disarm(ctx context.Context) (bool, error)
	// Close disarms it (a failed move: nothing is armed after, the destination drops what it
	// got); after Wait it does nothing.
	Close()
}

// armTimeout bounds the wait for the source agent to arm a stream; armExpiry is how long a
// stream stays armed on the node without a checkpoint (the agent's --expire): move calls the
// kubelet as soon as it is armed, and the shim takes the request as the checkpoint begins
// (seconds: containerd pauses the task first); move disarms it as soon as the kubelet answered,
// so the expiry matters only for a move that died in between.
const (
	armTimeout = 30 * time.Second
	armExpiry  = 30 * time.Second
)

// agentStream is a `berthctl send-pages` running in the source node's agent.
type agentStream struct {
	// disarm runs `send-pages --disarm` for the container in the same agent and returns its
	// output
	disarm func(ctx context.Context) ([]byte, error)
	cancel context.CancelFunc
	out    *armedWriter
	done   chan struct{}
	err    error
	once   sync.Once
}

// ArmPages runs `berthctl send-pages` in src's agent (pods/exec, kept open)
// toward dst's agent's receiver, and returns once it printed "armed" (SendPagesArmed). Errors:
// no agent (ErrNoAgent), the command's failure before it armed (its standard error), no word
// within armTimeout.
func (a *Agents) ArmPages(ctx context.Context, src, dst, container, name string, timeout int64) (PageStream, error) {
	from, err := a.pod(ctx, src)
	if err != nil {
		return nil, err
	}
	to, err := a.pod(ctx, dst)
	if err != nil {
		return nil, err
	}
	addr, err := agentAddress(to, a.Container)
	if err != nil {
		return nil, err
	}
	// the timeout goes on standard input: on the command line, /proc would show it to every
	// local user of the node and every hostPID pod
	argv := []string{agentBerthctl, "send-pages", "--container", container, "--name", name,
		"--expire", armExpiry.String(), addr}
	req := a.Client.CoreV1().RESTClient().Post().Resource("pods").Namespace(from.Namespace).Name(from.Name).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: a.Container, Command: argv, Stdin: true, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	ws, err := remotecommand.NewWebSocketExecutor(a.Config, "GET", req.URL().String())
	if err != nil {
		return nil, err
	}
	spdy, err := remotecommand.NewSPDYExecutor(a.Config, "POST", req.URL())
	if err != nil {
		return nil, err
	}
	ex, err := remotecommand.NewFallbackExecutor(ws, spdy, func(err error) bool {
		return httpstream.IsUpgradeFailure(err) || httpstream.IsHTTPSProxyError(err)
	})
	if err != nil {
		return nil, err
	}
	// the stream outlives the call: it ends with Close or the command's end, not with ctx
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &agentStream{cancel: cancel, out: &armedWriter{armed: make(chan struct{})}, done: make(chan struct{})}
	s.disarm = func(ctx context.Context) ([]byte, error) {
		return a.exec(ctx, from, agentBerthctl, "send-pages", "--disarm", "--container", container, "--name", name)
	}
	var stderr bytes.Buffer
	go func() {
		defer close(s.done)
		err := ex.StreamWithContext(sctx, remotecommand.StreamOptions{Stdin: strings.NewReader(strconv.FormatInt(timeout, 10) + "\n"), Stdout: s.out, Stderr: &stderr})
		if err != nil {
			msg := strings.TrimSpace(stderr.String())
			if len(msg) > 2000 {
				msg = "..." + msg[len(msg)-2000:]
			}
			s.err = fmt.Errorf("send-pages in berth agent %s/%s on %s: %w: %s", from.Namespace, from.Name, src, err, msg)
		}
	}()
	t := time.NewTimer(armTimeout)
	defer t.Stop()
	select {
	case <-s.out.armed:
		return s, nil
	case <-s.done:
		s.Close()
		if s.err == nil {
			s.err = fmt.Errorf("send-pages in berth agent %s/%s on %s ended before it armed: %.200q", from.Namespace, from.Name, src, s.out.rest())
		}
		return nil, s.err
	case <-t.C:
		s.Close()
		return nil, fmt.Errorf("send-pages in berth agent %s/%s on %s: not armed within %v", from.Namespace, from.Name, src, armTimeout)
	case <-ctx.Done():
		s.Close()
		return nil, ctx.Err()
	}
}

func (s *agentStream) Wait(ctx context.Context) (int64, error) {
	select {
	case <-s.done:
	case <-ctx.Done():
		s.Close()
		return 0, ctx.Err()
	}
	if s.err != nil {
		return 0, s.err
	}
	var res struct {
		Bytes int64 `json:"bytes"`
	}
	if err := json.Unmarshal(s.out.rest(), &res); err != nil {
		return 0, fmt.Errorf("send-pages: %w: %.200q", err, s.out.rest())
	}
	return res.Bytes, nil
}

// disarmWait is how long Disarm waits for the armed command to end by itself first: it ends
// within milliseconds of the checkpoint that took its stream, and the exec is spared.
const disarmWait = time.Second

func (s *agentStream) Disarm(ctx context.Context) (bool, error) {
	t := time.NewTimer(disarmWait)
	defer t.Stop()
	select {
	case <-s.done:
		return false, nil
	case <-t.C:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	out, err := s.disarm(ctx)
	return strings.TrimSpace(string(out)) == "disarmed", err
}

// closeGrace bounds Close: the disarm command, then the armed command's end.
const closeGrace = 10 * time.Second

// Close disarms the stream unless it ended: `send-pages --disarm` in the same agent removes the
// request (unless the shim took it) and ends the armed send-pages, whose exec stream is cut
// after closeGrace at the latest (it then ends by its --expire).
func (s *agentStream) Close() {
	s.once.Do(func() {
		defer s.cancel()
		select {
		case <-s.done:
			return
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), closeGrace)
		defer cancel()
		_, _ = s.disarm(ctx)
		select {
		case <-s.done:
		case <-ctx.Done():
		}
	})
}

// result returns the armed command's outcome if it ended within d: its error, or nil and its
// output; ok false if it still runs.
func (s *agentStream) result(d time.Duration) (out []byte, err error, ok bool) {
	select {
	case <-s.done:
		return s.out.rest(), s.err, true
	case <-time.After(d):
		return nil, nil, false
	}
}

// armedWriter is send-pages' standard output: the first line says it is armed, the rest is its
// result.
type armedWriter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	armed chan struct{}
	seen  bool
}

func (w *armedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if !w.seen {
		if line, rest, ok := bytes.Cut(w.buf.Bytes(), []byte("\n")); ok {
			if string(line) != "armed" {
				return 0, errors.New("send-pages: unexpected first line " + fmt.Sprintf("%.100q", line))
			}
			w.seen = true
			rest = bytes.Clone(rest)
			w.buf.Reset()
			w.buf.Write(rest)
			close(w.armed)
		}
	}
	return len(p), nil
}

func (w *armedWriter) rest() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return bytes.Clone(w.buf.Bytes())
}
