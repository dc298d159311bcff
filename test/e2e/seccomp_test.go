package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"google.golang.org/protobuf/proto"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
)

// seccompDefault is a root container's CRI security context with the runtime's default seccomp
// profile (RuntimeDefault: profile_type 0).
const seccompDefault = `{"namespace_options": {"pid": 1}, "seccomp": {"profile_type": 0}}`

// TestTrustSeccompFilter (issue 19, finding 4): with allow_unsigned, a checkpoint whose
// seccomp.img was rewritten to a single RET ALLOW restored into a RuntimeDefault pod (the
// restored task ran with a one-instruction filter). The shim now compares every process's
// filters with the filter runc installs for the pod's profile, by what they decide, signed or
// not: the checkpoint of a RuntimeDefault container restores into a RuntimeDefault pod (runc's
// compilation on node1 against berth-shim-helper's on node2), the forged one is refused.
func TestTrustSeccompFilter(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	for _, n := range c.Nodes {
		fltNoErr(t, n.Import(ctx, "k8s.io", c.Images[image.WorkloadRef]))
	}
	dir := t.TempDir()
	pod := criPod(t, ctx, src, dir, "sc-src", "default")
	id := trustContainer(t, ctx, src, dir, pod, "sc-src", "infer", seccompDefault, nil)
	if _, err := src.Crictl(ctx, "start", id); err != nil {
		t.Fatal(err)
	}
	ar := filepath.Join(dst.CheckpointRoot, "sc-plain.tar")
	if out, err := src.Crictl(ctx, "checkpoint", "--export="+ar, id); err != nil {
		t.Fatalf("crictl checkpoint: %v %s", err, out)
	}
	t.Cleanup(func() { os.Remove(ar) })
	_, _ = src.Crictl(ctx, "stop", "-t", "0", id)

	podB := criPod(t, ctx, dst, dir, "sc-dst", "default")
	t.Run("RuntimeDefault into RuntimeDefault", func(t *testing.T) {
		rid, err := trustRestore(t, ctx, dst, dir, podB, "sc-dst", "legit", seccompDefault, filepath.Base(ar))
		if err != nil {
			t.Fatalf("the checkpoint of a RuntimeDefault container into a RuntimeDefault pod: %v", err)
		}
		_, _ = dst.Crictl(ctx, "stop", "-t", "0", rid)
	})

	t.Run("RET ALLOW under allow_unsigned", func(t *testing.T) {
		d := filepath.Join(dst.CheckpointRoot, "sc-forged")
		trustExtract(t, ar, d)
		t.Cleanup(func() { os.RemoveAll(d) })
		images := filepath.Join(d, checkpoint.ImagesDir)
		forgeSeccompAllow(t, filepath.Join(images, "seccomp.img"))
		fltNoErr(t, os.Remove(filepath.Join(images, checkpoint.SignatureFile)))
		ctRedigest(t, images)
		restore, err := dst.SetTrust(node.Trust{AllowUnsigned: true})
		fltNoErr(t, err)
		defer func() { fltNoErr(t, restore()) }()
		podC := criPod(t, ctx, dst, dir, "sc-lab", "default") // its shim reads allow_unsigned
		_, err = trustRestore(t, ctx, dst, dir, podC, "sc-lab", "forged", seccompDefault, filepath.Base(d))
		trustRefused(t, dst, "RET ALLOW filter", err, "seccomp filter more permissive than the destination's profile", "ALLOW where the profile gives ERRNO")
	})
}

// forgeSeccompAllow rewrites every filter of the seccomp.img at p to the one instruction
// "return ALLOW", keeping the chains.
func forgeSeccompAllow(t *testing.T, p string) {
	t.Helper()
	b, err := os.ReadFile(p)
	fltNoErr(t, err)
	// IMG_COMMON and the SECCOMP magic, then one entry: its length and its bytes
	const header = 8
	if len(b) < header+4 {
		t.Fatalf("%s: %d bytes", p, len(b))
	}
	n := int(binary.LittleEndian.Uint32(b[header:]))
	entry := &seccomp.SeccompEntry{}
	fltNoErr(t, proto.Unmarshal(b[header+4:header+4+n], entry))
	if len(entry.GetSeccompFilters()) == 0 {
		t.Fatalf("%s: no filter: the source ran without seccomp", p)
	}
	allow := []byte{0x06, 0, 0, 0, 0, 0, 0xff, 0x7f}
	for _, f := range entry.GetSeccompFilters() {
		f.Filter = allow
	}
	m, err := proto.Marshal(entry)
	fltNoErr(t, err)
	out := append(append([]byte{}, b[:header]...), binary.LittleEndian.AppendUint32(nil, uint32(len(m)))...)
	out = append(out, m...)
	if bytes.Equal(out, b) {
		t.Fatalf("%s unchanged", p)
	}
	fltNoErr(t, os.WriteFile(p, out, 0o600))
}
