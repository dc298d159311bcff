package commands

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/berth-dev/berth/cmd/berthctl/move"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
)

// TestMigrateResult: migrate's result carries every phase, the checkpoint's (the shim's among
// them) before the move's, and a total over the move's.
func TestMigrateResult(t *testing.T) {
	res := &move.MigrateResult{
		Bytes: 3 << 20,
		Manifest: &checkpoint.Manifest{
			Phases: []checkpoint.Phase{{Name: "pause", Ms: 1}, {Name: "shim-checkpoint", Ms: 20}, {Name: "shim/gpu-lock", Ms: 2}, {Name: "shim/criu-dump", Ms: 15}},
			CRIU:   checkpoint.CRIUStats{PagesWritten: 7},
		},
		Phases: []checkpoint.Phase{{Name: "checkpoint", Ms: 30}, {Name: "transfer", Ms: 10}, {Name: "restore", Ms: 25}, {Name: "stop-source", Ms: 5}},
	}
	r := newMigrateResult(res)
	r.Container, r.ID, r.Checkpoint, r.To = "infer", "infer-moved", "infer-ck", "/dst.sock"
	var buf bytes.Buffer
	if err := writeJSON(&buf, r); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Container, ID, Checkpoint string
		Bytes                     int64
		Phases                    []checkpoint.Phase
		TotalMs                   float64
		CRIU                      checkpoint.CRIUStats
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range got.Phases {
		names = append(names, p.Name)
	}
	want := "checkpoint/pause checkpoint/shim-checkpoint checkpoint/shim/gpu-lock checkpoint/shim/criu-dump checkpoint transfer restore stop-source"
	if strings.Join(names, " ") != want {
		t.Errorf("phases %v, want %s", names, want)
	}
	if got.TotalMs != 70 || got.Bytes != 3<<20 || got.ID != "infer-moved" || got.Container != "infer" || got.CRIU.PagesWritten != 7 {
		t.Errorf("result %+v", got)
	}
	buf.Reset()
	r.writeText(&buf)
	text := buf.String()
	for _, s := range []string{"migrated infer -> /dst.sock as infer-moved (3.0 MiB sent, checkpoint infer-ck, unsigned)", "checkpoint/shim/criu-dump", "total"} {
		if !strings.Contains(text, s) {
			t.Errorf("text lacks %q:\n%s", s, text)
		}
	}
}

// TestMigrateResultPageBytes: in copy and lazy mode the memory pages travel on the page stream,
// not in the checkpoint's stream: the text and the JSON count both, and say which is which.
func TestMigrateResultPageBytes(t *testing.T) {
	for _, tc := range []struct {
		mode, want string
	}{
		{modeCopy, "(405.0 KiB checkpoint + 256.0 MiB pages streamed = 256.4 MiB sent, checkpoint c, unsigned)"},
		{modeLazy, "(405.0 KiB checkpoint + 256.0 MiB pages after the resume = 256.4 MiB sent, checkpoint c, unsigned)"},
		{modeStored, "(405.0 KiB sent, checkpoint c, unsigned)"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			res := &move.MigrateResult{Bytes: 405 << 10, Manifest: &checkpoint.Manifest{}}
			if tc.mode != modeStored {
				res.PageBytes = 256 << 20
			}
			r := newMigrateResult(res)
			r.Container, r.ID, r.Checkpoint, r.To, r.Mode = "x", "x", "c", "/dst.sock", tc.mode
			var buf bytes.Buffer
			r.writeText(&buf)
			if !strings.Contains(buf.String(), "migrated x -> /dst.sock as x "+tc.want) {
				t.Errorf("text lacks %q:\n%s", tc.want, buf.String())
			}
			buf.Reset()
			if err := writeJSON(&buf, r); err != nil {
				t.Fatal(err)
			}
			var got struct{ Bytes, PageBytes int64 }
			if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
				t.Fatal(err)
			}
			if got.Bytes != 405<<10 || got.PageBytes != res.PageBytes {
				t.Errorf("JSON bytes %d, pageBytes %d; want %d, %d:\n%s", got.Bytes, got.PageBytes, 405<<10, res.PageBytes, buf.String())
			}
		})
	}
}

// TestFingerprintOutput: JSON by default (as before -o existed), a table with -o text.
func TestFingerprintOutput(t *testing.T) {
	root := fakeGPURoot(t)
	run := func(args ...string) string {
		cmd := Fingerprint()
		cmd.SilenceUsage = true
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(io.Discard)
		cmd.SetArgs(append([]string{"--gpu", "fake", "--fake-gpu-root", root}, args...))
		if err := cmd.ExecuteContext(context.Background()); err != nil && !strings.Contains(err.Error(), "fingerprint") {
			t.Fatal(err)
		}
		return out.String()
	}
	out := run()
	if out == "" {
		t.Skip("fingerprint failed here (criu, runc or containerd not on PATH)")
	}
	{
		var fp fingerprint.Fingerprint
		if err := json.Unmarshal([]byte(out), &fp); err != nil || len(fp.GPUs) != 2 {
			t.Errorf("default output is not the fingerprint as JSON: %v\n%s", err, out)
		}
		if text := run("-o", "text"); !strings.Contains(text, "GPU 1") || !strings.Contains(text, "kernel") {
			t.Errorf("-o text:\n%s", text)
		}
	}
}

// TestSendReceiveJSON: receive -o json reports listening and received as JSON lines; send -o
// json reports what it sent.
func TestSendReceiveJSON(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	root := t.TempDir()
	tr := newReceiverTrust(t)
	pr, pw := io.Pipe()
	rcv := Receive(tr.g)
	rcv.SetOut(pw)
	rcv.SetErr(io.Discard)
	rcv.SetArgs([]string{"--listen", "127.0.0.1:0", "--root", root, "-o", "json"})
	done := make(chan error, 1)
	go func() { done <- rcv.ExecuteContext(ctx); pw.Close() }()
	events := bufio.NewScanner(pr)
	next := func() receiveEvent {
		t.Helper()
		if !events.Scan() {
			t.Fatalf("receive ended: %v", events.Err())
		}
		var e receiveEvent
		if err := json.Unmarshal(events.Bytes(), &e); err != nil {
			t.Fatalf("receive printed %q: %v", events.Text(), err)
		}
		return e
	}
	l := next()
	if l.Event != "listening" || l.Address == "" || l.Root != root {
		t.Fatalf("first event %+v", l)
	}

	dir := checkpointDir(t, checkpointFingerprint())
	tr.sign(t, dir)
	send := Send()
	var out bytes.Buffer
	send.SetOut(&out)
	send.SetErr(io.Discard)
	send.SetArgs([]string{"--name", "ck1", "-o", "json", dir, l.Address})
	if err := send.ExecuteContext(ctx); err != nil {
		t.Fatal(err)
	}
	var s sendResult
	if err := json.Unmarshal(out.Bytes(), &s); err != nil || s.Name != "ck1" || s.Bytes == 0 || s.Address != l.Address {
		t.Errorf("send -o json: %+v, %v\n%s", s, err, out.String())
	}
	if e := next(); e.Event != "received" || e.Path != filepath.Join(root, "ck1") {
		t.Errorf("event %+v, want received %s", e, filepath.Join(root, "ck1"))
	}
	if _, err := os.Stat(filepath.Join(root, "ck1", checkpoint.ManifestFile)); err != nil {
		t.Error(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("receive: %v", err)
	}
}

func TestFormatFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-o", "xml", "x", "y"}, `invalid argument "xml" for "-o, --output" flag: want text or json`},
		{[]string{"--output=yaml", "x", "y"}, "want text or json"},
	} {
		cmd := Send()
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		cmd.SetArgs(tc.args)
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("send %v: %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

// TestFlagErrors: an error names the flag (and the value) at fault.
func TestFlagErrors(t *testing.T) {
	none := filepath.Join(t.TempDir(), "none")
	topo := filepath.Join(t.TempDir(), "topo.txt")
	if err := os.WriteFile(topo, []byte("not nvidia-smi topo -m\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cmd  func() *cobra.Command
		args []string
		want string
	}{
		{"topology file missing", Topology, []string{"--topology", none}, "--topology: "},
		{"topology file unreadable", Topology, []string{"--topology", topo}, "--topology " + topo},
		{"sysfs missing", Topology, []string{"--sysfs", none}, "--sysfs: "},
		{"gpu source", Topology, []string{"--gpu-source", "tpu"}, `--gpu-source "tpu"`},
		{"gpu source file without topology", Topology, []string{"--gpu-source", "file"}, "--gpu-source file needs --topology"},
		{"plan negative gpus", Plan, []string{"--topology", topo, "--gpus", "-1"}, "--gpus -1"},
		{"plan policy", Plan, []string{"--topology", topo, "--policy", "tight"}, "--policy"},
		{"fake gpu", Fingerprint, []string{"--gpu", "fake", "--fake-gpu-root", none}, "--gpu fake"},
		{"output format", func() *cobra.Command { return CheckpointInspect(&Globals{}) }, []string{"-o", "yaml", none}, `"yaml" for "-o, --output"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.cmd()
			c.SetOut(io.Discard)
			c.SetErr(io.Discard)
			c.SetArgs(tc.args)
			if err := c.ExecuteContext(context.Background()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestCheckReceiver: `checkpoint check --receiver --need` asks a berthctl receive's node over the
// receive protocol's preflight query (what kubectl berth move runs in the destination's agent):
// a need that fits its checkpoint root passes; one that does not is refused naming the field,
// the value and the limit, with the answer as JSON on stdout and a non-zero exit.
func TestCheckReceiver(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	root := t.TempDir()
	tr := newReceiverTrust(t)
	pr, pw := io.Pipe()
	rcv := Receive(tr.g)
	rcv.SetOut(pw)
	rcv.SetErr(io.Discard)
	rcv.SetArgs([]string{"--listen", "127.0.0.1:0", "--root", root, "-o", "json"})
	done := make(chan error, 1)
	go func() { done <- rcv.ExecuteContext(ctx); pw.Close() }()
	events := bufio.NewScanner(pr)
	if !events.Scan() {
		t.Fatalf("receive ended: %v", events.Err())
	}
	var l receiveEvent
	if err := json.Unmarshal(events.Bytes(), &l); err != nil || l.Event != "listening" {
		t.Fatalf("first event %q: %v", events.Text(), err)
	}
	answered := make(chan string, 4)
	go func() {
		for events.Scan() {
			answered <- events.Text()
		}
	}()
	check := func(need string) (checkResult, error) {
		t.Helper()
		cmd := CheckpointCheck(tr.g)
		cmd.SilenceUsage = true // as under berthctl's root
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(io.Discard)
		cmd.SetArgs([]string{"--receiver", l.Address, "--name", "ns-pod-1", "--need", need, "-o", "json"})
		err := cmd.ExecuteContext(ctx)
		var res checkResult
		if jerr := json.Unmarshal(out.Bytes(), &res); jerr != nil {
			t.Fatalf("check -o json printed %q: %v (exit %v)", out.String(), jerr, err)
		}
		return res, err
	}
	if res, err := check(`{"diskBytes": 1024}`); err != nil || !res.OK || len(res.Refusals) != 0 || res.On != l.Address {
		t.Errorf("a need that fits: %+v, %v", res, err)
	}
	res, err := check(`{"diskBytes": 1000000000000000000}`)
	if err == nil || !errors.Is(err, move.ErrPreflight) || res.OK || len(res.Refusals) != 1 {
		t.Fatalf("a need beyond the disk: %+v, %v", res, err)
	}
	if r := res.Refusals[0]; r.Field != "free disk under "+root || !strings.HasSuffix(r.Value, " bytes") || r.Limit != ">= 1000000000000000000 bytes" {
		t.Errorf("refusal %+v", r)
	}
	if e := <-answered; !strings.Contains(e, `"event":"preflight"`) {
		t.Errorf("receive reported %s, want its preflight answer", e)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("receive: %v", err)
	}
}
