package scenario

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/berth-dev/berth/test/image"
	"github.com/berth-dev/berth/test/node"
	"github.com/berth-dev/berth/test/workload/client"
	"github.com/berth-dev/berth/test/workload/model"
)

// PodOptions configure MovePod.
type PodOptions struct {
	// Namespace is created for the pod and deleted at the end; Pod is the pod's name, the
	// restore pod is Pod+"-moved".
	Namespace, Pod string
	// WeightsMiB is the model's weight size in MiB.
	WeightsMiB int
	// Sessions is the number of concurrent streaming sessions; Tokens the tokens each streams.
	Sessions, Tokens int
	// MoveAfter is the number of tokens every session must have received before the move.
	MoveAfter int
	// DelayMs is the server's pause between tokens. The kubelet checkpoint API leaves the source
	// running, so sessions go on there until the source pod is deleted: Tokens*DelayMs must last
	// longer than the move for the sessions to continue on the destination.
	DelayMs int
	// Out receives progress lines and kubectl berth move's output (may be io.Discard).
	Out io.Writer
}

// PodReport is what MovePod observed: the InferenceReport's fields (MigrateOutput and
// MigrateWall are kubectl berth move's) and where the sessions went on.
type PodReport struct {
	InferenceReport
	// From and To are the source and destination nodes, Restored the restore pod.
	From, To, Restored string
	// ResumedAt[i] is the index of the first token session i received from the restore pod; -1
	// if the session ended on the source.
	ResumedAt []int
	// SourceDeleted: the source pod is gone from the API server.
	SourceDeleted bool
}

// Continuous reports whether every session continued exactly on the restore pod and nothing
// was recomputed.
func (r *PodReport) Continuous() bool {
	for _, i := range r.ResumedAt {
		if i < 0 {
			return false
		}
	}
	return r.InferenceReport.Continuous() && r.SourceDeleted
}

// InferPodYAML is the inference pod ns/name a user writes for berth: runtimeClassName berth, one
// exclusive CPU (Guaranteed QoS, which berth-nri pins), the RuntimeDefault seccomp profile, a
// locked-down security context, on node nodeName, with weightsMiB of weights (seed 7) and
// memory for them.
func InferPodYAML(ns, name, nodeName string, weightsMiB, delayMs int) string {
	mem := weightsMiB*3/2 + 256
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: %s
  labels: {app: infer}
spec:
  runtimeClassName: berth
  restartPolicy: Never
  nodeSelector: {kubernetes.io/hostname: %q}
  securityContext:
    seccompProfile: {type: RuntimeDefault}
  containers:
  - name: infer
    image: %s
    imagePullPolicy: Never
    args: ["-weights-mib", "%d", "-seed", "7", "-delay-ms", "%d"]
    ports: [{containerPort: 8080}]
    resources:
      requests: {cpu: "1", memory: %dMi}
      limits: {cpu: "1", memory: %dMi}
    securityContext:
      allowPrivilegeEscalation: false
      readOnlyRootFilesystem: true
      capabilities: {drop: ["ALL"]}
`, name, ns, nodeName, image.WorkloadRef, weightsMiB, delayMs, mem, mem)
}

// KubeMoveArgs are the flags berthctl move runs with in the demo and the benchmark: the archive
// goes node to node through the berth agents of contrib/kubernetes (the default, said
// explicitly), as on a cluster whose nodes share nothing with the machine berthctl runs on.
func KubeMoveArgs(c *node.KubeCluster) []string {
	return []string{"--transfer", "agent"}
}

// KubectlBerth returns `kubectl berth ARGS` as a user's shell runs it: berthctl as the kubectl
// plugin kubectl-berth on PATH (a link in c.Dir/plugins) and the admin's kubeconfig in
// $KUBECONFIG.
func KubectlBerth(ctx context.Context, c *node.KubeCluster, args ...string) (*exec.Cmd, error) {
	plugins := filepath.Join(c.Dir, "plugins")
	if err := os.MkdirAll(plugins, 0o755); err != nil {
		return nil, err
	}
	link := filepath.Join(plugins, "kubectl-berth")
	if _, err := os.Lstat(link); err != nil {
		if err := os.Symlink(c.Berthctl(), link); err != nil {
			return nil, err
		}
	}
	cmd := exec.CommandContext(ctx, c.Kube.Tool("kubectl"), append([]string{"berth"}, args...)...)
	cmd.Env = append(os.Environ(), "PATH="+plugins+":"+os.Getenv("PATH"), "KUBECONFIG="+c.Kubeconfig)
	return cmd, nil
}

// MovePod runs the inference workload as a pod of RuntimeClass berth on src, streams
// o.Sessions sessions from it, and once every session received o.MoveAfter tokens moves the pod
// to dst with `kubectl berth move` (the kubelet checkpoint API, a restore pod, the source pod
// deleted). The sessions reconnect to the restore pod when the source goes; every stream is
// compared with an uninterrupted run. The namespace is deleted at the end.
func MovePod(ctx context.Context, c *node.KubeCluster, src, dst *node.KubeNode, o PodOptions) (*PodReport, error) {
	out := o.Out
	if out == nil {
		out = io.Discard
	}
	if _, err := c.Kubectl(ctx, "create", "namespace", o.Namespace); err != nil {
		return nil, err
	}
	defer func() {
		_, _ = c.Kubectl(context.WithoutCancel(ctx), "delete", "namespace", o.Namespace, "--timeout=120s")
	}()
	if _, err := c.KubectlIn(ctx, strings.NewReader(InferPodYAML(o.Namespace, o.Pod, src.Name, o.WeightsMiB, o.DelayMs)), "apply", "-f", "-"); err != nil {
		return nil, err
	}
	t0 := time.Now()
	if _, err := c.Kubectl(ctx, "-n", o.Namespace, "wait", "--for=condition=Ready", "pod/"+o.Pod, "--timeout=180s"); err != nil {
		desc, _ := c.Kubectl(ctx, "-n", o.Namespace, "describe", "pod", o.Pod)
		return nil, fmt.Errorf("pod %s not Ready: %w\n%s", o.Pod, err, desc)
	}
	ip, err := c.Kubectl(ctx, "-n", o.Namespace, "get", "pod", o.Pod, "-o", "jsonpath={.status.podIP}")
	if err != nil {
		return nil, err
	}
	srcT := client.Target{BaseURL: "http://" + ip + ":8080"}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := client.WaitReady(wctx, srcT, 100*time.Millisecond); err != nil {
		return nil, fmt.Errorf("workload of pod %s not ready: %w", o.Pod, err)
	}
	fmt.Fprintf(out, "pod %s/%s (runtimeClassName: berth, %d MiB of weights) Ready on %s at %s in %.1f s\n",
		o.Namespace, o.Pod, o.WeightsMiB, src.Name, ip, time.Since(t0).Seconds())
	before, err := client.Stats(ctx, srcT)
	if err != nil {
		return nil, err
	}

	rep := &PodReport{From: src.Name, To: dst.Name, Restored: o.Pod + "-moved"}
	var moveErr error
	var dstT client.Target
	ss := streamSessions(ctx, srcT, o.Sessions, o.Tokens, o.MoveAfter)
	ss.waitPast()
	args := []string{"move", "-n", o.Namespace, o.Pod, "--to", dst.Name, "--name", rep.Restored}
	fmt.Fprintf(out, "%d sessions streaming, each past token %d: kubectl berth %s\n", o.Sessions, o.MoveAfter, strings.Join(args, " "))
	cmd, err := KubectlBerth(ctx, c, append(args, KubeMoveArgs(c)...)...)
	if err != nil {
		moveErr = err
	} else {
		var buf bytes.Buffer
		cmd.Stdout, cmd.Stderr = io.MultiWriter(&buf, out), io.MultiWriter(&buf, out)
		start := time.Now()
		moveErr = cmd.Run()
		rep.MigrateWall = time.Since(start)
		rep.MigrateOutput = buf.String()
		if moveErr != nil {
			moveErr = fmt.Errorf("kubectl berth move: %w: %s", moveErr, buf.String())
		}
	}
	if moveErr == nil {
		var rip string
		rip, moveErr = c.Kubectl(ctx, "-n", o.Namespace, "get", "pod", rep.Restored, "-o", "jsonpath={.status.podIP}")
		dstT = client.Target{BaseURL: "http://" + rip + ":8080"}
	}
	err = ss.finish(dstT, moveErr)
	rep.Streams, rep.ResumedAt = ss.streams, ss.resumedAt
	if err != nil {
		return rep, err
	}
	after, err := client.Stats(ctx, dstT)
	if err != nil {
		return rep, err
	}
	rep.PrefillsBefore, rep.PrefillsAfter = before.Prefills+int64(o.Sessions), after.Prefills
	rep.WeightsChecksumBefore, rep.WeightsChecksumAfter = before.WeightsChecksum, after.WeightsChecksum
	if rep.Reference, rep.MatchingSessions, err = ss.compare(model.Config{WeightsMiB: o.WeightsMiB, Seed: 7}, o.Tokens); err != nil {
		return rep, err
	}
	if _, err := c.Kubectl(ctx, "-n", o.Namespace, "get", "pod", o.Pod); err != nil {
		rep.SourceDeleted = strings.Contains(err.Error(), "NotFound")
	} else {
		_, err = c.Kubectl(ctx, "-n", o.Namespace, "wait", "--for=delete", "pod/"+o.Pod, "--timeout=60s")
		rep.SourceDeleted = err == nil
	}
	return rep, nil
}
