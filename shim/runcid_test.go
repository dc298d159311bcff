package shim

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
)

func TestCheckRuncID(t *testing.T) {
	root := t.TempDir()
	opts, err := typeurl.MarshalAnyToProto(&options.Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	ctx := namespaces.WithNamespace(context.Background(), "ns")
	r := &taskAPI.CreateTaskRequest{ID: "x", Options: opts, Bundle: t.TempDir()}
	if err := checkRuncID(ctx, r); err != nil {
		t.Fatalf("free id: %v", err)
	}
	if err := os.MkdirAll(filepath.Join(root, "ns", "x"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "ns", "x", "state.json"), []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	err = checkRuncID(ctx, r)
	if err == nil || !errors.Is(err, errdefs.ErrAlreadyExists) || !strings.Contains(err.Error(), "another id") {
		t.Fatalf("id runc holds: %v; want AlreadyExists that says to use another id", err)
	}
	if _, serr := os.Stat(filepath.Join(r.Bundle, runcIDTakenFile)); serr != nil {
		t.Errorf("bundle not marked for the manager's Stop: %v", serr)
	}
	if errorClass(err) != errdefs.ErrAlreadyExists {
		t.Errorf("class %v", errorClass(err))
	}
	if err := checkRuncID(namespaces.WithNamespace(context.Background(), "other"), r); err != nil {
		t.Errorf("another namespace: %v", err)
	}
}
