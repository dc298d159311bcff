package shim

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/archive"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/fingerprint"
	"github.com/berth-dev/berth/oci/registry/regdef"
)

func TestErrorClass(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("restore c1: annotation x: %w", err) }
	tests := []struct {
		name string
		err  error
		want error
	}{
		{"outside root", wrap(checkpoint.ErrOutsideRoot), errdefs.ErrInvalidArgument},
		{"invalid ref", wrap(checkpoint.ErrInvalidRef), errdefs.ErrInvalidArgument},
		{"bad bundle spec", wrap(mark(errors.New("unexpected end of JSON input"), ErrInvalidSpec)), errdefs.ErrInvalidArgument},
		{"archive cut short", wrap(mark(io.ErrUnexpectedEOF, ErrBadArchive)), errdefs.ErrInvalidArgument},
		{"archive entry unsafe", wrap(fmt.Errorf("../x: %w", archive.ErrUnsafePath)), errdefs.ErrInvalidArgument},
		{"registry digest", wrap(mark(errors.New("digest md5:x"), ErrRegistryDigest)), errdefs.ErrInvalidArgument},
		{"missing checkpoint", wrap(&fs.PathError{Op: "lstat", Path: "/x", Err: fs.ErrNotExist}), errdefs.ErrNotFound},
		{"unknown tag", wrap(fmt.Errorf("ck:v9: %w", regdef.ErrNotFound)), errdefs.ErrNotFound},
		{"digest mismatch", wrap(fmt.Errorf("pages-1.img: %w", checkpoint.ErrDigestMismatch)), errdefs.ErrFailedPrecondition},
		{"missing file, not os.ErrNotExist", wrap(fmt.Errorf("pages-1.img: %w", checkpoint.ErrMissingFile)), errdefs.ErrFailedPrecondition},
		{"fingerprint", wrap(&fingerprint.MismatchError{Field: "kernel"}), errdefs.ErrFailedPrecondition},
		{"not a checkpoint artifact", wrap(regdef.ErrNotCheckpoint), errdefs.ErrFailedPrecondition},
		{"namespace", wrap(mark(errors.New("taken in namespace a"), ErrNamespaceRefused)), errdefs.ErrPermissionDenied},
		{"registry not allowed", wrap(mark(errors.New("registry r"), ErrRegistryNotAllowed)), errdefs.ErrPermissionDenied},
		{"registry credentials", wrap(regdef.ErrUnauthorized), errdefs.ErrPermissionDenied},
		{"GPU lock timeout", wrap(fmt.Errorf("GPU lock of pid 1: %w", gpu.ErrTimeout)), errdefs.ErrUnavailable},
		{"GPU out of memory", wrap(fmt.Errorf("GPU restore of pid 1: %w", gpu.ErrOutOfMemory)), errdefs.ErrResourceExhausted},
		{"GPU restore timeout", wrap(fmt.Errorf("GPU restore of pid 1 did not finish within 1s: %w", gpu.ErrTimeout)), errdefs.ErrUnavailable},
		{"GPU driver too old", wrap(fmt.Errorf("driver 550: %w", gpu.ErrUnsupported)), errdefs.ErrFailedPrecondition},
		{"GPU illegal state", wrap(gpu.ErrIllegalState), errdefs.ErrFailedPrecondition},
		{"errdefs class kept", fmt.Errorf("task is stopped, not running: %w", errdefs.ErrFailedPrecondition), errdefs.ErrFailedPrecondition},
		{"runc's native error kept", fmt.Errorf("thaw: %w", errgrpc.ToNative(errgrpc.ToGRPC(fmt.Errorf("task c: %w", errdefs.ErrNotFound)))), errdefs.ErrNotFound},
		{"runc's wire error kept", fmt.Errorf("thaw: %w", errgrpc.ToGRPC(fmt.Errorf("task c: %w", errdefs.ErrNotFound))), errdefs.ErrNotFound},
		{"cancelled", fmt.Errorf("pull: %w", context.Canceled), context.Canceled},
		{"anything else", errors.New("injected"), errdefs.ErrUnknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := errorClass(tc.err); got != tc.want {
				t.Errorf("errorClass(%q) = %v, want %v", tc.err, got, tc.want)
			}
			wire := wireError(tc.err)
			if got := errdefs.Resolve(errgrpc.ToNative(wire)); got != tc.want {
				t.Errorf("wire error %q is of class %v, want %v", wire, got, tc.want)
			}
			if got := errgrpc.ToNative(wire).Error(); got != tc.err.Error() {
				t.Errorf("message changed on the wire:\n got %q\nwant %q", got, tc.err.Error())
			}
		})
	}
	if wireError(nil) != nil || errorClass(nil) != nil {
		t.Error("nil is not kept")
	}
}

func TestMark(t *testing.T) {
	inner := &fs.PathError{Op: "open", Path: "/x", Err: fs.ErrNotExist}
	err := fmt.Errorf("outer: %w", mark(inner, ErrBadArchive))
	if err.Error() != "outer: open /x: file does not exist" {
		t.Errorf("message %q", err)
	}
	var pe *fs.PathError
	if !errors.Is(err, ErrBadArchive) || !errors.Is(err, fs.ErrNotExist) || !errors.As(err, &pe) {
		t.Errorf("%v: the sentinel and the marked chain are not both found", err)
	}
	// the sentinel decides over what it marks
	if errorClass(err) != errdefs.ErrInvalidArgument {
		t.Errorf("class %v", errorClass(err))
	}
	if mark(nil, ErrBadArchive) != nil {
		t.Error("mark(nil) is not nil")
	}
}

// TestCreateWireErrors checks the errors Create answers: one wire error per refusal, of the
// table's class, with the message of the step that refused.
func TestCreateWireErrors(t *testing.T) {
	root := t.TempDir()
	writeCheckpoint(t, root, "good", nodeFP)
	tarball := filepath.Join(root, "cut.tar")
	f, err := os.Create(tarball)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	_ = tw.WriteHeader(&tar.Header{Name: "berth.json", Mode: 0o600, Size: 100, Typeflag: tar.TypeReg})
	_, _ = tw.Write([]byte("{"))
	f.Close()
	s := NewService(nil, Config{Path: "/etc/berth/shim.toml", CheckpointRoot: root, MaxArchiveBytes: 1 << 30}, testDeps(policy(t, false)))
	tests := []struct {
		name string
		spec string // config.json
		ref  string
		want []string
		code error
	}{
		{"missing", "", "nope", []string{"restore c1", `"nope"`, "no such file or directory"}, errdefs.ErrNotFound},
		{"escape", "", "../x", []string{"restore c1", "invalid restore-from reference"}, errdefs.ErrInvalidArgument},
		{"archive cut short", "", "cut.tar", []string{"extract checkpoint archive " + tarball}, errdefs.ErrInvalidArgument},
		{"registry not allowed", "", "oci://r.example/ck:v1", []string{"registry r.example is not in allowed_registries", "/etc/berth/shim.toml"}, errdefs.ErrPermissionDenied},
		{"bad bundle spec", "{", "", []string{"parse bundle spec"}, errdefs.ErrInvalidArgument},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bundle := t.TempDir()
			body := []byte(tc.spec)
			if tc.spec == "" {
				body, _ = json.Marshal(specs.Spec{Annotations: map[string]string{oci.AnnotationRestoreFrom: tc.ref}})
			}
			if err := os.WriteFile(filepath.Join(bundle, "config.json"), body, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := s.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "c1", Bundle: bundle})
			if err == nil {
				t.Fatal("created")
			}
			native := errgrpc.ToNative(err)
			if errdefs.Resolve(native) != tc.code {
				t.Errorf("error %q is of class %v, want %v", err, errdefs.Resolve(native), tc.code)
			}
			for _, w := range tc.want {
				if !strings.Contains(native.Error(), w) {
					t.Errorf("error %q does not name %q", native, w)
				}
			}
		})
	}
}
