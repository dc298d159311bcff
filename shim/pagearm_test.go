package shim

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/zeebo/blake3"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// now is the clock of the fixtures in testdata/pagearm: valid.json was armed 30 s before it,
// for a checkpoint call with a timeout of a day, and expires a minute after it; expired.json
// at it.
var pageArmNow = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// pageArmCall is the deadline of the checkpoint call valid.json was armed for, made at at.
func pageArmCall(at time.Time) time.Time { return at.Add(24 * time.Hour) }

func TestClaimPageStream(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fixture  string // "" for no armed request
		id       string
		now      time.Time
		deadline time.Time // zero: the request has none (ctr, nerdctl)
		want     bool      // a request comes back
		wantErr  error     // errors.Is
		left     bool      // the armed file is still there afterwards
	}{
		{name: "none", fixture: "", id: "c1", now: pageArmNow},
		{name: "the armed call", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), want: true},
		{name: "the armed call, late", fixture: "valid.json", id: "c1", now: pageArmNow.Add(59 * time.Second), deadline: pageArmCall(pageArmNow.Add(58 * time.Second)), want: true},
		{name: "the armed call, deadline rounded up", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow).Add(time.Second), want: true},
		{name: "the armed call, made at arming", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow.Add(-30 * time.Second)), want: true},
		{name: "expired", fixture: "valid.json", id: "c1", now: pageArmNow.Add(time.Minute), deadline: pageArmCall(pageArmNow.Add(time.Minute))}, // expiry is exclusive
		{name: "expired at arming", fixture: "expired.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow)},
		// another party's checkpoint while it is armed: left for the armed call
		{name: "no deadline (ctr)", fixture: "valid.json", id: "c1", now: pageArmNow, left: true},
		{name: "the kubelet's default timeout", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmNow.Add(2 * time.Minute), left: true},
		{name: "another timeout", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow).Add(time.Hour), left: true},
		{name: "a call made before arming", fixture: "valid.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow.Add(-time.Minute)), left: true},
		{name: "other container", fixture: "other-container.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrBadPageStreamRequest},
		{name: "socket outside", fixture: "socket-outside.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrBadPageStreamRequest},
		{name: "no expiry", fixture: "no-expiry.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrBadPageStreamRequest},
		{name: "no timeout", fixture: "no-timeout.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrBadPageStreamRequest},
		{name: "not JSON", fixture: "not-json.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrBadPageStreamRequest},
		{name: "the armed call, blake3", fixture: "valid-blake3.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), want: true},
		// an algorithm the shim cannot digest with: the receiver would refuse what it signs
		{name: "unknown digest", fixture: "unknown-digest.json", id: "c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), wantErr: checkpoint.ErrPageDigestAlgorithm},
		// an id that no agent could have armed is never looked up
		{name: "bad id", fixture: "valid.json", id: "../c1", now: pageArmNow, deadline: pageArmCall(pageArmNow), left: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			armed := filepath.Join(dir, "c1.json")
			if tc.fixture != "" {
				b, err := os.ReadFile(filepath.Join("testdata", "pagearm", tc.fixture))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(armed, b, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			req, err := claimPageStream(dir, tc.id, tc.now, tc.deadline, !tc.deadline.IsZero())
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Fatalf("claim: %v, want %v", err, tc.wantErr)
			}
			if (req != nil) != tc.want {
				t.Fatalf("claim returned %+v, want a request: %v", req, tc.want)
			}
			if req != nil && (req.Container != "c1" || req.Socket != "default-p-1.sock" || req.Name != "default-p-1") {
				t.Fatalf("claim returned %+v", req)
			}
			ents, _ := os.ReadDir(dir)
			if tc.left != (len(ents) == 1) || (!tc.left && len(ents) != 0) {
				t.Fatalf("left in the directory: %v; want the armed request left: %v", ents, tc.left)
			}
		})
	}
}

// Of checkpoints racing for one armed request, exactly one gets it.
func TestClaimPageStreamOnce(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile(filepath.Join("testdata", "pagearm", "valid.json"))
	if err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 20; round++ {
		if err := os.WriteFile(filepath.Join(dir, "c1.json"), b, 0o600); err != nil {
			t.Fatal(err)
		}
		var (
			wg  sync.WaitGroup
			mu  sync.Mutex
			got int
		)
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, err := claimPageStream(dir, "c1", pageArmNow, pageArmCall(pageArmNow), true)
				if err != nil {
					t.Error(err)
				}
				if req != nil {
					mu.Lock()
					got++
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if got != 1 {
			t.Fatalf("round %d: %d claims succeeded, want 1", round, got)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Fatalf("round %d: left %v", round, ents)
		}
	}
}

// armTestRequest writes a request, digested with alg ("" for an agent that names none), armed for one checkpoint call of container c1 toward socket in dir,
// and returns the context of the checkpoint call it was armed for (its deadline).
func armTestRequest(t *testing.T, dir, socket, alg string) context.Context {
	t.Helper()
	now := time.Now()
	req := `{"container":"c1","name":"p","socket":"` + socket + `","armed":"` + now.Add(-time.Second).UTC().Format(time.RFC3339Nano) +
		`","checkpointTimeout":86400,"expires":"` + now.Add(time.Minute).UTC().Format(time.RFC3339) + `","digest":"` + alg + `"}`
	if err := os.WriteFile(filepath.Join(dir, "c1.json"), []byte(req), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(24*time.Hour))
	t.Cleanup(cancel)
	return ctx
}

// armTestRelay arms a page stream for container c1, digested with alg, toward an agent socket in a temporary
// page_stream_dir, and returns the relay, the address the shim wrote for CRIU's page client and
// the agent's end of the connection the shim opened.
func armTestRelay(t *testing.T, alg string) (*armedRelay, []byte, net.Conn) {
	t.Helper()
	dir := t.TempDir()
	ln, err := net.Listen("unix", filepath.Join(dir, "p.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx := armTestRequest(t, dir, "p.sock", alg)
	s := NewService(nil, Config{PageStreamDir: dir}, Deps{})
	work := t.TempDir()
	a, err := s.armPageStream(ctx, "c1", work)
	if err != nil || a == nil {
		t.Fatalf("arm: %v, %v", a, err)
	}
	addr, err := os.ReadFile(filepath.Join(work, checkpoint.PageServerRequestFile))
	if err != nil {
		t.Fatal(err)
	}
	agent, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return a, addr, agent
}

// The relay forwards CRIU's stream to the agent in oci/transfer's frames, digests it, passes the
// answers back, and reports the stream once the agent closed; a stream the agent cuts is an
// error, never a digest.
func TestArmedRelay(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the relay takes only root's connections (CRIU's): run as root")
	}
	for _, tc := range []struct {
		alg string
		cut bool
		sum func([]byte) string // the library's own digest of what CRIU sent
	}{
		{alg: "blake3", sum: func(b []byte) string { s := blake3.Sum256(b); return "blake3:" + hex.EncodeToString(s[:]) }},
		{alg: "", sum: func(b []byte) string { s := sha256.Sum256(b); return "sha256:" + hex.EncodeToString(s[:]) }}, // an agent before pageDigest
		{alg: "blake3", cut: true},
	} {
		cut := tc.cut
		t.Run(map[bool]string{false: "whole", true: "cut"}[cut]+"/"+tc.alg, func(t *testing.T) {
			a, addr, agent := armTestRelay(t, tc.alg)
			payload := bytes.Repeat([]byte("page"), 700000) // more than one frame
			got := make(chan []byte, 1)
			go func() { // the agent: unframe, answer, close
				var out bytes.Buffer
				var hdr [4]byte
				for {
					if _, err := io.ReadFull(agent, hdr[:]); err != nil {
						break
					}
					k := binary.BigEndian.Uint32(hdr[:])
					if k == 0 {
						break
					}
					if _, err := io.CopyN(&out, agent, int64(k)); err != nil {
						break
					}
					if cut && out.Len() > 1<<20 {
						agent.Close()
						got <- out.Bytes()
						return
					}
				}
				_, _ = agent.Write([]byte("ok"))
				agent.Close()
				got <- out.Bytes()
			}()
			criu, err := net.Dial("tcp", string(bytes.TrimSpace(addr)))
			if err != nil {
				t.Fatal(err)
			}
			_, werr := criu.Write(payload)
			_ = criu.(*net.TCPConn).CloseWrite()
			answer, _ := io.ReadAll(criu)
			criu.Close()
			ps, err := a.wait(context.Background())
			received := <-got
			if cut {
				if err == nil || !errors.Is(err, ErrPageStreamLost) {
					t.Fatalf("cut stream: %+v, %v (write %v); want ErrPageStreamLost", ps, err, werr)
				}
				return
			}
			if want := tc.sum(payload); err != nil || ps.Size != int64(len(payload)) || ps.Digest != want {
				t.Fatalf("stream %+v, %v; want %d bytes, %s", ps, err, len(payload), want)
			}
			if !bytes.Equal(received, payload) || string(answer) != "ok" {
				t.Fatalf("agent got %d bytes, CRIU the answer %q", len(received), answer)
			}
		})
	}
}

// TestArmedRelayStalledAgent: an agent that accepts the page stream and never reads it ends the
// relay (ErrPageStreamLost) within armedStallTimeout, so CRIU's dump fails and the container thaws,
// instead of staying frozen until the checkpoint request's own deadline.
func TestArmedRelayStalledAgent(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("the relay takes only root's connections (CRIU's): run as root")
	}
	defer func(d time.Duration) { armedStallTimeout = d }(armedStallTimeout)
	armedStallTimeout = 300 * time.Millisecond
	a, addr, agent := armTestRelay(t, checkpoint.PageDigestDefault) // and the agent never reads
	defer agent.Close()
	criu, err := net.Dial("tcp", string(bytes.TrimSpace(addr)))
	if err != nil {
		t.Fatal(err)
	}
	defer criu.Close()
	go func() { _, _ = criu.Write(make([]byte, 64<<20)) }() // far more than the sockets buffer
	done := make(chan error, 1)
	go func() { _, err := a.wait(context.Background()); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrPageStreamLost) {
			t.Fatalf("stalled agent: %v; want ErrPageStreamLost", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the relay still waits on an agent that stopped reading")
	}
}
