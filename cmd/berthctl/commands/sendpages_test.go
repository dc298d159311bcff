package commands

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/oci/checkpoint"
)

// testCheckpointTimeout is the checkpoint timeout of testArmRequest's requests.
const testCheckpointTimeout = 86400 + 17

// testArmRequest is what send-pages asks armPages to arm.
func testArmRequest(container, name string, expires time.Time) checkpoint.PageStreamRequest {
	return checkpoint.PageStreamRequest{Container: container, Name: name, CheckpointTimeout: testCheckpointTimeout, Expires: expires}
}

// A second arming for the same container while one is armed is refused and leaves the first's
// request as it was (a rename over it would hand the first move's checkpoint call to the second);
// an expired request left by a killed send-pages is replaced.
func TestArmPagesTwice(t *testing.T) {
	dir := t.TempDir()
	req := filepath.Join(dir, "c1.json")
	first := []byte(`{"container":"c1","name":"first","socket":"pages-1.sock","armed":"2026-01-01T00:00:00Z","checkpointTimeout":86400,"expires":"2999-01-01T00:00:00Z"}`)
	if err := os.WriteFile(req, first, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := armPages(context.Background(), &bytes.Buffer{}, dir, testArmRequest("c1", "second", time.Now().Add(time.Minute)))
	if err == nil || !strings.Contains(err.Error(), "armed for container c1 already") {
		t.Fatalf("second arming: %v", err)
	}
	if b, err := os.ReadFile(req); err != nil || !bytes.Equal(b, first) {
		t.Fatalf("the first request after a second arming: %q %v", b, err)
	}
	expired := bytes.Replace(first, []byte("2999-01-01"), []byte("2026-01-01"), 1)
	if err := os.WriteFile(req, expired, 0o600); err != nil {
		t.Fatal(err)
	}
	out := newSyncBuffer()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := armPages(ctx, out, dir, testArmRequest("c1", "second", time.Now().Add(time.Minute)))
		done <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(out.String(), SendPagesArmed); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not armed over an expired request")
		}
	}
	var got checkpoint.PageStreamRequest
	if b, err := os.ReadFile(req); err != nil || json.Unmarshal(b, &got) != nil || got.Name != "second" {
		t.Fatalf("armed over an expired request: %q %v", b, err)
	}
	cancel()
	<-done
}

// armPages writes the request the shim claims (container, name, socket in the same directory,
// expiry), says "armed" only once it is in place, hands over the shim's connection, and leaves
// neither the request nor the socket behind.
func TestArmPagesTaken(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("armPages takes only root's connections (the shim's): run as root")
	}
	dir := t.TempDir()
	out := newSyncBuffer()
	expires := time.Now().Add(time.Minute).Truncate(time.Second)
	type res struct {
		c   net.Conn
		err error
	}
	done := make(chan res, 1)
	go func() {
		c, err := armPages(context.Background(), out, dir, testArmRequest("c1abcdef0123456789", "ns-pod-1", expires))
		done <- res{c, err}
	}()
	var req checkpoint.PageStreamRequest
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(out.String(), SendPagesArmed) {
		if time.Now().After(deadline) {
			t.Fatal("not armed")
		}
		time.Sleep(5 * time.Millisecond)
	}
	b, err := os.ReadFile(filepath.Join(dir, "c1abcdef0123456789.json"))
	if err != nil {
		t.Fatalf("armed, but no request: %v", err)
	}
	if err := json.Unmarshal(b, &req); err != nil {
		t.Fatal(err)
	}
	if req.Container != "c1abcdef0123456789" || req.Name != "ns-pod-1" || !req.Expires.Equal(expires) || req.Socket != filepath.Base(req.Socket) ||
		req.CheckpointTimeout != testCheckpointTimeout || time.Since(req.Armed) > time.Minute || time.Until(req.Armed) > 0 {
		t.Fatalf("request %+v", req)
	}
	shim, err := net.Dial("unix", filepath.Join(dir, req.Socket))
	if err != nil {
		t.Fatal(err)
	}
	defer shim.Close()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.c.Close()
	if _, err := shim.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	if _, err := r.c.Read(buf); err != nil || buf[0] != 'x' {
		t.Fatalf("the shim's connection: %q %v", buf, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("left once taken: %v", ents)
	}
}

// Without a checkpoint by its expiry, or once its context ends (move gave up), armPages fails and
// disarms: neither the request nor the socket is left.
func TestArmPagesExpires(t *testing.T) {
	for _, cancelled := range []bool{false, true} {
		dir := t.TempDir()
		if err := os.Chmod(dir, 0o755); err != nil { // as the kubelet's DirectoryOrCreate makes it
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		expires := time.Now().Add(300 * time.Millisecond)
		if cancelled {
			expires = time.Now().Add(time.Hour)
			time.AfterFunc(300*time.Millisecond, cancel)
		}
		_, err := armPages(ctx, &bytes.Buffer{}, dir, testArmRequest("c1", "ns-pod-1", expires))
		cancel()
		want := "no checkpoint took it"
		if cancelled {
			want = context.Canceled.Error()
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("cancelled %v: %v, want %q", cancelled, err, want)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Fatalf("cancelled %v: left %v", cancelled, ents)
		}
		if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
			t.Fatalf("cancelled %v: page_stream_dir mode %v, %v; want 0700 (ours, closed to other users)", cancelled, fi.Mode().Perm(), err)
		}
	}
}

// --disarm removes an armed request and ends the send-pages waiting on it (whose connection then
// ends at once); with nothing armed it says so.
func TestDisarmPages(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("armPages takes only root's connections: run as root")
	}
	dir := t.TempDir()
	var out bytes.Buffer
	if err := disarmPages(&out, dir, "c1", ""); err != nil || strings.TrimSpace(out.String()) != "nothing armed" {
		t.Fatalf("disarm with nothing armed: %q, %v", out.String(), err)
	}
	armedOut := newSyncBuffer()
	done := make(chan net.Conn, 1)
	go func() {
		c, err := armPages(context.Background(), armedOut, dir, testArmRequest("c1", "ns-pod-1", time.Now().Add(time.Minute)))
		if err != nil {
			t.Error(err)
		}
		done <- c
	}()
	for !strings.Contains(armedOut.String(), SendPagesArmed) {
		time.Sleep(5 * time.Millisecond)
	}
	out.Reset()
	// another move's disarm (another checkpoint name) leaves it armed
	if err := disarmPages(&out, dir, "c1", "ns-pod-2"); err != nil || strings.TrimSpace(out.String()) != "nothing armed" {
		t.Fatalf("disarm under another name: %q, %v", out.String(), err)
	}
	if _, err := os.Stat(filepath.Join(dir, "c1.json")); err != nil {
		t.Fatalf("after another name's disarm: %v", err)
	}
	out.Reset()
	if err := disarmPages(&out, dir, "c1", "ns-pod-1"); err != nil || strings.TrimSpace(out.String()) != "disarmed" {
		t.Fatalf("disarm: %q, %v", out.String(), err)
	}
	c := <-done
	if c == nil {
		t.Fatal("the armed send-pages did not end")
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("the disarmed stream: %d bytes, %v; want its end", n, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("left after disarming: %v", ents)
	}
}

// Two containers whose ids share their first 12 characters (ids that ctr or a script chose) are
// armed at once: each request names a socket of its own, which reaches its own send-pages. (The
// socket was named after the id's first 12 characters: the second arming removed the first's
// socket and took its place, so the first container's pages went out under the second's name.)
func TestArmPagesSharedIDPrefix(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("armPages takes only root's connections (the shim's): run as root")
	}
	dir := t.TempDir()
	ids := []string{"my-container-a", "my-container-b"}
	type res struct {
		c   net.Conn
		err error
	}
	done := map[string]chan res{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, id := range ids {
		out := newSyncBuffer()
		done[id] = make(chan res, 1)
		go func() {
			c, err := armPages(ctx, out, dir, testArmRequest(id, "ns-"+id, time.Now().Add(time.Minute)))
			done[id] <- res{c, err}
		}()
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(out.String(), SendPagesArmed) {
			if time.Now().After(deadline) {
				t.Fatalf("%s not armed", id)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	socks := map[string]bool{}
	for _, id := range ids {
		b, err := os.ReadFile(filepath.Join(dir, id+".json"))
		if err != nil {
			t.Fatal(err)
		}
		var req checkpoint.PageStreamRequest
		if err := json.Unmarshal(b, &req); err != nil {
			t.Fatal(err)
		}
		if socks[req.Socket] {
			t.Fatalf("%s and another container armed on one socket %s", id, req.Socket)
		}
		socks[req.Socket] = true
		shim, err := net.Dial("unix", filepath.Join(dir, req.Socket))
		if err != nil {
			t.Fatalf("%s: its socket %s: %v", id, req.Socket, err)
		}
		defer shim.Close()
		select {
		case r := <-done[id]:
			if r.err != nil {
				t.Fatalf("%s: %v", id, r.err)
			}
			r.c.Close()
		case <-time.After(10 * time.Second):
			t.Fatalf("the shim's connection for %s did not reach its send-pages", id)
		}
	}
}

// TestReadCheckpointTimeout: send-pages takes the checkpoint timeout from the first line of its
// standard input, a positive number of seconds; anything else is refused without repeating it.
func TestReadCheckpointTimeout(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"86417\n", 86417},
		{"86417", 86417},
		{" 86417 \nmore\n", 86417},
		{"", 0},
		{"\n", 0},
		{"abc\n", 0},
		{"0\n", 0},
		{"-5\n", 0},
		{strings.Repeat("9", 100) + "\n", 0},
	} {
		got, err := readCheckpointTimeout(strings.NewReader(tc.in))
		if got != tc.want || (err == nil) != (tc.want > 0) {
			t.Errorf("readCheckpointTimeout(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

// TestSendPagesTimeoutNotOnCommandLine: the timeout that binds an armed stream is not a flag
// (/proc/PID/cmdline shows a command line to every local user and hostPID pod): send-pages has
// no such flag, and without the timeout on standard input it fails before it arms or dials.
func TestSendPagesTimeoutNotOnCommandLine(t *testing.T) {
	cmd := SendPages()
	if f := cmd.Flags().Lookup("checkpoint-timeout"); f != nil {
		t.Fatalf("send-pages has a --%s flag: the timeout would be on its command line", f.Name)
	}
	dir := t.TempDir()
	cmd.SetArgs([]string{"--container", "c1", "--name", "ns-pod-1", "--dir", dir, "127.0.0.1:1"})
	cmd.SetIn(strings.NewReader(""))
	cmd.SetOut(&bytes.Buffer{})
	cmd.SetErr(&bytes.Buffer{})
	err := cmd.ExecuteContext(context.Background())
	if err == nil || !strings.Contains(err.Error(), "standard input") {
		t.Fatalf("send-pages without a timeout on standard input: %v; want an error naming it", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("armed without a timeout: %v", ents)
	}
}

// TestDisarmPagesTakesItsOwn: --disarm judges and removes the same request. Another move's
// request (another checkpoint name) is put back as it was; and when, between the disarm's read
// and its removal, the request was claimed by a checkpoint and another move armed its own
// (takeRequestHook), that one stays armed. (disarm read the file and then removed whatever was
// at the path: the other move's request.)
func TestDisarmPagesTakesItsOwn(t *testing.T) {
	ours, err := os.ReadFile(filepath.Join("testdata", "pagestream", "ours.json"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := os.ReadFile(filepath.Join("testdata", "pagestream", "other-move.json"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	req := filepath.Join(dir, "c1.json")

	if err := os.WriteFile(req, other, 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := disarmPages(&out, dir, "c1", "ns-pod-1"); err != nil || strings.TrimSpace(out.String()) != "nothing armed" {
		t.Fatalf("disarm of another move's request: %q, %v", out.String(), err)
	}
	if b, err := os.ReadFile(req); err != nil || !bytes.Equal(b, other) {
		t.Fatalf("another move's request after a disarm: %q, %v; want it as it was", b, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("left in the directory: %v; want only the request", ents)
	}

	if err := os.WriteFile(req, ours, 0o600); err != nil {
		t.Fatal(err)
	}
	takeRequestHook = func() {
		// a checkpoint claims what is at the path (if anything), another move arms its own
		_ = os.Remove(req)
		if err := os.WriteFile(req, other, 0o600); err != nil {
			t.Error(err)
		}
	}
	defer func() { takeRequestHook = nil }()
	out.Reset()
	if err := disarmPages(&out, dir, "c1", "ns-pod-1"); err != nil {
		t.Fatalf("disarm: %q, %v", out.String(), err)
	}
	takeRequestHook = nil
	if b, err := os.ReadFile(req); err != nil || !bytes.Equal(b, other) {
		t.Fatalf("the request another move armed during a disarm: %q, %v; want it armed", b, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("left in the directory: %v; want only the other move's request", ents)
	}
}
