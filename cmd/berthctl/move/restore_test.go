package move

import (
	"errors"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// hostileSpec is a checkpoint's spec.dump as a hostile signer writes it: hooks that run on the
// host, a host bind mount, a device, the host's namespaces, every capability, uid 0, runc's CRIU
// configuration file and a Kubernetes namespace annotation.
func hostileSpec() *specs.Spec {
	return &specs.Spec{
		Hostname: "src-host",
		Process: &specs.Process{
			Args: []string{"/bin/server", "--port", "8080"}, Env: []string{"PATH=/bin", "MODEL=llama"}, Cwd: "/srv",
			User:         specs.User{UID: 0},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_SYS_ADMIN"}, Effective: []string{"CAP_SYS_ADMIN"}},
			Rlimits:      []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: 1 << 20, Soft: 1 << 20}},
		},
		Hooks: &specs.Hooks{
			//lint:ignore SA1019 the attack uses prestart, deprecated in the runtime spec but still run by runc
			Prestart:      []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "touch /host-pwned"}}},
			CreateRuntime: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "touch /host-pwned2"}}},
		},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/host", Type: "bind", Source: "/", Options: []string{"rbind", "rw"}},
			{Destination: "/dev/berth-gpu/0", Type: "bind", Source: "/var/lib/fake-gpu/GPU-a", Options: []string{"rbind", "rw"}},
			{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm", Options: []string{"rbind", "rw"}},
		},
		Annotations: map[string]string{oci.AnnotationCRIUConfig: "/tmp/evil.conf", oci.AnnotationCRISandboxNamespace: "staging"},
		Linux: &specs.Linux{
			Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: "/proc/1/ns/pid"}},
			Devices:    []specs.LinuxDevice{{Path: "/dev/sda", Type: "b", Major: 8}},
			Seccomp:    nil,
			Sysctl:     map[string]string{"kernel.core_pattern": "|/tmp/x"},
		},
	}
}

// defaultSpec stands for containerd's default spec of the destination.
func defaultSpec() *specs.Spec {
	return &specs.Spec{
		Process: &specs.Process{Args: []string{"/entrypoint"}, Cwd: "/", User: specs.User{UID: 1000},
			Capabilities: &specs.LinuxCapabilities{Bounding: []string{"CAP_CHOWN"}}, NoNewPrivileges: true},
		Mounts: []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}, {Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm"}},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace}},
			CgroupsPath: "/default/new"},
	}
}

// TestRestoreSpecTakesOnlyAllowedFields: a checkpoint's spec gives the new container its
// arguments, environment, working directory, terminal and hostname; its hooks, mounts, devices,
// namespaces, privileges and annotations are never taken (issue 19: prestart and createRuntime
// hooks of a signed spec.dump ran on the host as root).
func TestRestoreSpecTakesOnlyAllowedFields(t *testing.T) {
	ck := hostileSpec()
	host := specs.Mount{Destination: "/host", Type: "bind", Source: "/srv/data", Options: []string{"rbind", "ro"}}
	shm := specs.Mount{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm", Options: []string{"rbind", "rw"}}
	got, err := RestoreSpec(defaultSpec(), ck, RestoreOptions{Ref: "ck-1", Mounts: []specs.Mount{host, shm}})
	if err != nil {
		t.Fatal(err)
	}
	if got.Hooks != nil {
		t.Errorf("hooks taken: %+v", got.Hooks)
	}
	if strings.Join(got.Process.Args, " ") != "/bin/server --port 8080" || got.Process.Cwd != "/srv" || len(got.Process.Env) != 2 || got.Hostname != "src-host" {
		t.Errorf("allowed fields not taken: %+v, hostname %q", got.Process, got.Hostname)
	}
	if got.Process.User.UID != 1000 || got.Process.Capabilities.Bounding[0] != "CAP_CHOWN" || !got.Process.NoNewPrivileges || len(got.Process.Rlimits) != 0 {
		t.Errorf("privileges taken from the checkpoint: %+v", got.Process)
	}
	if len(got.Linux.Devices) != 0 || got.Linux.Sysctl != nil || got.Linux.Namespaces[0].Path != "" || got.Linux.CgroupsPath != "/default/new" {
		t.Errorf("linux taken from the checkpoint: %+v", got.Linux)
	}
	if len(got.Annotations) != 1 || got.Annotations[oci.AnnotationRestoreFrom] != "ck-1" {
		t.Errorf("annotations %v, want the restore-from one only", got.Annotations)
	}
	var dsts []string
	for _, m := range got.Mounts {
		dsts = append(dsts, m.Destination+"="+m.Source)
	}
	if strings.Join(dsts, " ") != "/proc=proc /dev=tmpfs /host=/srv/data /dev/shm=/dev/shm" {
		t.Errorf("mounts %v: the destination's and the operator's only", dsts)
	}
}

// TestRestoreSpecMissingMount: a bind mount of the checkpoint's container that the operator did
// not give is refused before anything is created, naming the --mount that gives it; a fake GPU's
// mount is the shim's to give.
func TestRestoreSpecMissingMount(t *testing.T) {
	_, err := RestoreSpec(defaultSpec(), hostileSpec(), RestoreOptions{Ref: "ck-1"})
	if !errors.Is(err, ErrSpecRefused) || !strings.Contains(err.Error(), "--mount type=bind,src=/,dst=/host,options=rbind:rw") ||
		!strings.Contains(err.Error(), "--mount type=bind,src=/dev/shm,dst=/dev/shm,options=rbind:rw") {
		t.Fatalf("RestoreSpec: %v, want ErrSpecRefused naming the /host mount and /dev/shm (a tmpfs by default)", err)
	}
	if strings.Contains(err.Error(), "berth-gpu") {
		t.Errorf("the fake GPU's mount is named: %v", err)
	}
}

// TestSourceSpec: migrate restores the operator's own running container's spec, without its
// hooks and annotations, in the new cgroup; a namespace joined by path is refused.
func TestSourceSpec(t *testing.T) {
	src := hostileSpec()
	src.Linux.Namespaces = nil
	src.Linux.CgroupsPath = "/default/old"
	got, err := SourceSpec(src, checkpoint.ContainerInfo{ID: "old"}, RestoreOptions{Namespace: "default", ID: "new", Ref: "ck-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got.Hooks != nil || len(got.Annotations) != 1 || got.Linux.CgroupsPath != "/default/new" {
		t.Errorf("hooks %v, annotations %v, cgroup %q", got.Hooks, got.Annotations, got.Linux.CgroupsPath)
	}
	if src.Hooks == nil || src.Annotations[oci.AnnotationCRIUConfig] == "" {
		t.Errorf("the source spec was changed")
	}
	if _, err := SourceSpec(hostileSpec(), checkpoint.ContainerInfo{ID: "old"}, RestoreOptions{}); !errors.Is(err, ErrSpecRefused) {
		t.Errorf("a namespace joined by path: %v", err)
	}
}
