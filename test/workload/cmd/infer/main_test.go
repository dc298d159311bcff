package main

import (
	"bufio"
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

func TestRunServesUntilCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-listen", "127.0.0.1:0", "-weights-mib", "8", "-seed", "5", "-vocab", "99", "-delay-ms", "1"}, pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("read ready line: %v (run: %v)", err, <-done)
	}
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	fields := map[string]string{}
	for _, f := range strings.Fields(line)[2:] {
		k, v, _ := strings.Cut(f, "=")
		fields[k] = v
	}
	cfg := model.Config{WeightsMiB: 8, Seed: 5, VocabSize: 99}
	sum, err := model.WeightsChecksum(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(line, "infer ready ") || fields["weights_mib"] != "8" || fields["seed"] != "5" ||
		fields["vocab"] != "99" || fields["checksum"] != model.FormatChecksum(sum) {
		t.Fatalf("ready line %q", line)
	}
	target := client.Target{BaseURL: fields["listen"]}
	got, err := client.Stream(ctx, target, client.Request{Session: "main", Prompt: "p", N: 20})
	if err != nil {
		t.Fatal(err)
	}
	want, err := model.Reference(cfg, "p", 20)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, model.Words(want)) {
		t.Errorf("stream differs from reference")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run after cancel: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("run did not return after cancel")
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
	}{
		{"unknown flag", []string{"-nope"}},
		{"extra argument", []string{"extra"}},
		{"negative delay", []string{"-delay-ms", "-1"}},
		{"bad weights", []string{"-weights-mib", "-4"}},
		{"bad vocab", []string{"-vocab", "1"}},
		{"bad listen", []string{"-weights-mib", "1", "-listen", "not-an-address"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := run(context.Background(), tt.args, io.Discard, io.Discard); err == nil {
				t.Errorf("run(%q) = nil, want error", tt.args)
			}
		})
	}
}
