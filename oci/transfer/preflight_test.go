package transfer

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
)

// TestQueryPreflight: the receiver's Preflight answers the query it received, an error of its
// comes back as ErrNoPreflight with its text, and so does a receiver without Preflight; nothing
// is written under Root.
func TestQueryPreflight(t *testing.T) {
	root := t.TempDir()
	var got json.RawMessage
	r := &Receiver{Root: root, Preflight: func(_ context.Context, q json.RawMessage) (json.RawMessage, error) {
		got = q
		var need struct{ Memory int64 }
		if err := json.Unmarshal(q, &need); err != nil {
			return nil, err
		}
		if need.Memory > 100 {
			return nil, fmt.Errorf("cannot tell")
		}
		return json.RawMessage(`{"refusals":[{"field":"MemAvailable"}]}`), nil
	}}
	addr, out := startReceiver(t, r)
	a, err := QueryPreflight(t.Context(), dial(t, addr), "ck", map[string]int64{"memory": 42})
	if err != nil || string(a) != `{"refusals":[{"field":"MemAvailable"}]}` || string(got) != `{"memory":42}` {
		t.Fatalf("QueryPreflight = %s, %v (query received %s)", a, err, got)
	}
	if o := wait(t, out); o.err != nil || o.path != "" {
		t.Errorf("receiver: %+v", o)
	}
	_, err = QueryPreflight(t.Context(), dial(t, addr), "ck", map[string]int64{"memory": 420})
	if !errors.Is(err, ErrNoPreflight) || !strings.Contains(err.Error(), "cannot tell") {
		t.Errorf("failing Preflight: %v", err)
	}
	wait(t, out)
	if _, err := QueryPreflight(t.Context(), dial(t, addr), "../x", 1); !errors.Is(err, ErrInvalidName) {
		t.Errorf("bad name: %v", err)
	}

	addr2, out2 := startReceiver(t, &Receiver{Root: root})
	if _, err := QueryPreflight(t.Context(), dial(t, addr2), "ck", 1); !errors.Is(err, ErrNoPreflight) {
		t.Errorf("receiver without Preflight: %v", err)
	}
	wait(t, out2)
	assertRootClean(t, root)
}

// TestQueryPreflightOlderReceiver: a version 2 receiver that predates the query reads a header
// without a manifest and refuses it; the sender reads that as ErrNoPreflight, quoting it.
func TestQueryPreflightOlderReceiver(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write([]byte(Greeting))
		_, _ = bufio.NewReader(c).ReadString('\n')
		_, _ = c.Write([]byte(`{"ok":false,"error":"receive ck: header manifest: invalid manifest: unexpected end of JSON input"}` + "\n"))
	}()
	_, err = QueryPreflight(t.Context(), dial(t, ln.Addr().String()), "ck", 1)
	if !errors.Is(err, ErrNoPreflight) || !strings.Contains(err.Error(), "header manifest") {
		t.Errorf("older receiver: %v", err)
	}
}
