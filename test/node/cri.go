package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// CRI pods and containers driven with crictl, the way the kubelet drives containerd (NRI plugins
// only see containers created through CRI).

// CRIPod is a pod sandbox config for `crictl runp`: host network, the node's pause image.
type CRIPod struct {
	// Name is the pod's name (also its uid and log directory name); Namespace defaults to "default".
	Name, Namespace string
	// Annotations are the pod's annotations.
	Annotations map[string]string
}

// CRIContainer is a container config for `crictl create`.
type CRIContainer struct {
	// Name is the container's name; Image an image ref in namespace k8s.io; Command its command.
	Name, Image string
	Command     []string
	// Annotations are the container's annotations; Env "KEY=VALUE" entries.
	Annotations map[string]string
	Env         []string
	// CPUQuota/CPUPeriod (µs) and CPUShares are the CPU cgroup settings the kubelet derives from
	// limits and requests; 0 leaves them unset.
	CPUQuota, CPUPeriod, CPUShares int64
}

// RunPod writes the pod config under dir and starts the sandbox with `crictl runp`. It returns
// the pod id and the config path (needed by CreateContainer).
func (n *Node) RunPod(ctx context.Context, dir string, p CRIPod) (id, config string, err error) {
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	logs := filepath.Join(dir, p.Name+"-logs")
	if err := os.MkdirAll(logs, 0o755); err != nil {
		return "", "", err
	}
	cfg := map[string]any{
		"metadata":      map[string]any{"name": p.Name, "namespace": p.Namespace, "uid": p.Name + "-uid", "attempt": 0},
		"log_directory": logs,
		"annotations":   p.Annotations,
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	}
	config = filepath.Join(dir, p.Name+"-pod.json")
	if err := writeJSON(config, cfg); err != nil {
		return "", "", err
	}
	id, err = n.Crictl(ctx, "runp", config)
	return id, config, err
}

// CreateContainer writes the container config under dir and creates it in pod podID with
// `crictl create` (own PID namespace, as the kubelet does). It returns the container id; on a
// refusal the error carries crictl's standard error (for NRI: the plugin's message).
func (n *Node) CreateContainer(ctx context.Context, dir, podID, podConfig string, c CRIContainer) (string, error) {
	res := map[string]any{}
	if c.CPUPeriod > 0 {
		res["cpu_period"] = c.CPUPeriod
	}
	if c.CPUQuota > 0 {
		res["cpu_quota"] = c.CPUQuota
	}
	if c.CPUShares > 0 {
		res["cpu_shares"] = c.CPUShares
	}
	var env []map[string]string
	for _, kv := range c.Env {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, map[string]string{"key": k, "value": v})
	}
	cfg := map[string]any{
		"metadata":    map[string]any{"name": c.Name},
		"image":       map[string]any{"image": c.Image},
		"command":     c.Command,
		"annotations": c.Annotations,
		"envs":        env,
		"log_path":    c.Name + ".log",
		"linux": map[string]any{
			"resources":        res,
			"security_context": map[string]any{"namespace_options": map[string]any{"pid": 1}},
		},
	}
	path := filepath.Join(dir, podID[:12]+"-"+c.Name+".json")
	if err := writeJSON(path, cfg); err != nil {
		return "", err
	}
	return n.Crictl(ctx, "create", podID, path, podConfig)
}

// CRIInspect is what `crictl inspect` says of a container: its OCI spec and its init PID.
type CRIInspect struct {
	Spec *specs.Spec
	PID  int
}

// Inspect returns the container's OCI spec (as containerd created it, NRI adjustments included)
// and its init PID (0 when not running).
func (n *Node) Inspect(ctx context.Context, id string) (CRIInspect, error) {
	out, err := n.Crictl(ctx, "inspect", id)
	if err != nil {
		return CRIInspect{}, err
	}
	var v struct {
		Info struct {
			Pid         int         `json:"pid"`
			RuntimeSpec *specs.Spec `json:"runtimeSpec"`
		} `json:"info"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		return CRIInspect{}, fmt.Errorf("crictl inspect %s: %w", id, err)
	}
	if v.Info.RuntimeSpec == nil {
		return CRIInspect{}, fmt.Errorf("crictl inspect %s: no runtimeSpec", id)
	}
	return CRIInspect{Spec: v.Info.RuntimeSpec, PID: v.Info.Pid}, nil
}

// RemovePod stops and removes pod id and its containers (errors ignored: cleanup).
func (n *Node) RemovePod(ctx context.Context, id string) {
	_, _ = n.Crictl(ctx, "stopp", id)
	_, _ = n.Crictl(ctx, "rmp", "-f", id)
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}
