package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/berth-dev/berth/oci/signature"
	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/keys"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
)

// TestCtlRestoreNeverRunsCheckpointHooks (issue 19, finding 2): a berthctl checkpoint whose
// spec.dump carries OCI prestart and createRuntime hooks and says namespace staging, signed by a
// key trusted only for staging, ran both hooks on the destination host as root through
// `berthctl restore`. Now: the key is not trusted for a restore outside Kubernetes (the
// namespace a restore is judged by is its destination's and the signed manifest's, never a
// spec's), and the same checkpoint signed by a key trusted everywhere restores with the
// destination's spec: the hooks never run, the workload answers.
func TestCtlRestoreNeverRunsCheckpointHooks(t *testing.T) {
	c := needCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src, dst := c.Nodes[0], c.Nodes[1]
	const id, rid = "hooks-src", "hooks-restored"
	t.Cleanup(func() {
		_ = src.Remove(context.Background(), id)
		_ = dst.Remove(context.Background(), rid)
	})
	pid, err := src.Run(ctx, node.RunOptions{ID: id, Image: image.WorkloadRef,
		Args: []string{image.WorkloadBinary, "-listen", "127.0.0.1:8080", "-weights-mib", "8", "-delay-ms", "0"}})
	fltNoErr(t, err)
	fltNoErr(t, client.WaitReady(ctx, client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(pid))}, 100*time.Millisecond))

	work := filepath.Join(src.Dir, "hooks-work")
	fltNoErr(t, os.MkdirAll(work, 0o700))
	t.Cleanup(func() { os.RemoveAll(work) })
	good := filepath.Join(work, "good")
	ctMust(t, ctx, c, "checkpoint", "create", "-a", src.Socket, "-n", node.Namespace, id, good)

	// the hostile signer's edit: hooks that leave a mark on the host, and namespace staging
	marks := t.TempDir()
	specPath := filepath.Join(good, checkpoint.SpecFile)
	b, err := os.ReadFile(specPath)
	fltNoErr(t, err)
	var sp specs.Spec
	fltNoErr(t, json.Unmarshal(b, &sp))
	hook := func(name string) []specs.Hook {
		return []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "touch " + filepath.Join(marks, name)}}}
	}
	//lint:ignore SA1019 the attack uses prestart, deprecated in the runtime spec but still run by runc
	sp.Hooks = &specs.Hooks{Prestart: hook("prestart"), CreateRuntime: hook("createRuntime"), StartContainer: hook("startContainer")}
	if sp.Annotations == nil {
		sp.Annotations = map[string]string{}
	}
	sp.Annotations[oci.AnnotationCRISandboxNamespace] = "staging"
	b, err = json.Marshal(&sp)
	fltNoErr(t, err)
	fltNoErr(t, os.WriteFile(specPath, b, 0o600))
	ctRedigest(t, good)

	stagingPriv, stagingPub, err := keys.SigningKey(t.TempDir(), "staging")
	fltNoErr(t, err)
	restoreTrust, err := dst.SetTrust(node.Trust{Keys: []signature.TrustedKey{{Path: stagingPub, Namespaces: []string{"staging"}}}})
	fltNoErr(t, err)
	t.Cleanup(func() { _ = restoreTrust() })
	noMarks := func(when string) {
		t.Helper()
		if entries, _ := os.ReadDir(marks); len(entries) > 0 {
			t.Errorf("%s: a hook of the checkpoint's spec ran on the host: %s", when, entries[0].Name())
		}
	}

	staging := ctCopy(t, good, filepath.Join(dst.CheckpointRoot, "hooks-staging"))
	t.Cleanup(func() { os.RemoveAll(staging) })
	ctResign(t, staging, stagingPriv)
	ctRefused(t, ctx, c, []string{"not trusted for namespace \"\""},
		"restore", "-a", dst.Socket, "-n", node.Namespace, "--root", dst.CheckpointRoot, "--id", rid, filepath.Base(staging))
	noMarks("a key trusted for staging only")

	trusted := ctCopy(t, good, filepath.Join(dst.CheckpointRoot, "hooks-trusted"))
	t.Cleanup(func() { os.RemoveAll(trusted) })
	_, err = dst.Sign(ctx, trusted)
	fltNoErr(t, err)
	ctMust(t, ctx, c, "restore", "-a", dst.Socket, "-n", node.Namespace, "--root", dst.CheckpointRoot, "--id", rid, filepath.Base(trusted))
	noMarks("a key trusted everywhere")
	rpid, status, err := dst.TaskPID(ctx, rid)
	if err != nil || status != "running" {
		t.Fatalf("restored task: %q %v", status, err)
	}
	if err := client.WaitReady(ctx, client.Target{BaseURL: "127.0.0.1:8080", DialContext: node.NetnsDialer(int(rpid))}, 100*time.Millisecond); err != nil {
		t.Errorf("the restored workload does not answer: %v", err)
	}
}
