package move

import (
	"archive/tar"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/gpu"
	"github.com/berth-dev/berth/oci/checkpoint"
)

func TestPreflightRefusals(t *testing.T) {
	proc := t.TempDir()
	if err := os.WriteFile(filepath.Join(proc, "meminfo"), []byte("MemTotal: 100 kB\nMemAvailable:  1024 kB\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(proc, "42"), 0o700); err != nil {
		t.Fatal(err)
	}
	limit := int64(1 << 20)
	missing := filepath.Join(t.TempDir(), "gone")
	need := Need{
		MemoryBytes: 4 << 20,
		PIDs:        []int{42, 43},
		Spec: &specs.Spec{
			Mounts: []specs.Mount{{Destination: "/data", Source: missing, Type: "bind"}, {Destination: "/ok", Source: proc, Options: []string{"rbind"}}},
			Linux: &specs.Linux{
				Resources:  &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}},
				Namespaces: []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/var/run/netns/x"}},
			},
		},
	}
	err := Preflight(t.Context(), Destination{Local: true, ProcRoot: proc}, need)
	var pe *PreflightError
	if !errors.As(err, &pe) || !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("Preflight = %v, want a PreflightError of class FailedPrecondition", err)
	}
	for _, want := range []string{
		"linux.namespaces[network].path is /var/run/netns/x",
		"linux.resources.memory.limit is 1048576 bytes, needs >= 4194304 bytes",
		"mounts[0].source (destination /data) is " + missing + " (missing)",
		"PID 42 is in use in the host's PID namespace",
		"MemAvailable is 1048576 bytes, needs >= 4194304 bytes",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%v\ndoes not say %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "PID 43") || strings.Contains(err.Error(), "/ok") {
		t.Errorf("refused what is fine: %v", err)
	}
	// a remote destination is checked for what a client can see from here only
	err = Preflight(t.Context(), Destination{ProcRoot: proc}, need)
	if err == nil || strings.Contains(err.Error(), "MemAvailable") || strings.Contains(err.Error(), "mounts[0]") {
		t.Errorf("remote: %v", err)
	}
	if err := Preflight(t.Context(), Destination{Local: true, ProcRoot: proc}, Need{MemoryBytes: 1024}); err != nil {
		t.Errorf("fits: %v", err)
	}
}

func TestNeedOfCheckpoint(t *testing.T) {
	dir := t.TempDir()
	m := &checkpoint.Manifest{Version: checkpoint.ManifestVersion, Container: checkpoint.ContainerInfo{Image: "img:1", ImageDigest: "sha256:ab"},
		CRIU: checkpoint.CRIUStats{PagesWritten: 3}, Files: []checkpoint.File{{Path: "checkpoint/core-1.img", Size: 99, Digest: "sha256:" + strings.Repeat("0", 64)}}}
	if err := checkpoint.WriteManifest(dir, m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, checkpoint.SpecFile), []byte(`{"ociVersion":"1.2.0","mounts":[{"destination":"/d","source":"/s","type":"bind"}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	arch := filepath.Join(t.TempDir(), "ck.tar")
	f, err := os.Create(arch)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	for _, name := range []string{checkpoint.ManifestFile, checkpoint.SpecFile} {
		b, _ := os.ReadFile(filepath.Join(dir, name))
		_ = tw.WriteHeader(&tar.Header{Name: "./" + name, Mode: 0o600, Size: int64(len(b)), Typeflag: tar.TypeReg})
		_, _ = tw.Write(b)
	}
	tw.Close()
	f.Close()
	for _, p := range []string{dir, arch} {
		n, err := NeedOfCheckpoint(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if n.Image != "img:1" || n.ImageDigest != "sha256:ab" || n.MemoryBytes != 3*checkpoint.PageSize || n.DiskBytes != 99 ||
			n.Spec == nil || len(n.Spec.Mounts) != 1 || n.Fingerprint == nil {
			t.Errorf("%s: %+v", p, n)
		}
	}
}

// gpuInventory is a destination's GPUs for TestPreflightGPUMemory.
type gpuInventory []gpu.Device

func (g gpuInventory) Devices() ([]gpu.Device, error)               { return g, nil }
func (g gpuInventory) Versions() (gpu.Versions, error)              { return gpu.Versions{}, nil }
func (g gpuInventory) ProcessMemory(int) (map[string]uint64, error) { return nil, nil }

// TestPreflightGPUMemory: a checkpoint's GPUs must fit on the destination's GPUs of their model
// with the device memory the container held free; each refusal names the GPU, the most free
// memory there and what the container held.
func TestPreflightGPUMemory(t *testing.T) {
	const gib = 1 << 30
	dev := func(i int, name string, used uint64) gpu.Device {
		return gpu.Device{Index: i, UUID: "GPU-d" + string(rune('0'+i)), Name: name, MemoryTotal: 16 * gib, MemoryUsed: used}
	}
	st := func(used ...uint64) *checkpoint.GPUState {
		s := &checkpoint.GPUState{}
		for i, u := range used {
			s.Devices = append(s.Devices, checkpoint.GPUDevice{UUID: "GPU-s" + string(rune('0'+i)), Name: "H200", MemoryTotal: 16 * gib, MemoryUsed: u})
		}
		return s
	}
	for _, tc := range []struct {
		name string
		gpus *checkpoint.GPUState
		devs gpuInventory
		want []string // nil: accepted
	}{
		{"fits", st(8 * gib), gpuInventory{dev(0, "H200", 12*gib), dev(1, "H200", 1*gib)}, nil},
		{"full", st(8 * gib), gpuInventory{dev(0, "H200", 16*gib), dev(1, "H200", 12*gib)},
			[]string{"gpu[0] device memory free (H200) is 4294967296 bytes at most, on GPU-d1 (12884901888 of 17179869184 bytes used), needs >= 8589934592 bytes (what the container held on GPU-s0)"}},
		{"model", st(1), gpuInventory{dev(0, "A100", 0)}, []string{"gpu[0] model is no H200 (GPU-d0 A100 (17179869184 bytes free)), needs H200 (as GPU-s0 on the source)"}},
		{"not together", st(8*gib, 8*gib), gpuInventory{dev(0, "H200", 0), dev(1, "H200", 12*gib)},
			[]string{"gpus is GPU-d0 H200 (17179869184 bytes free), GPU-d1 H200 (4294967296 bytes free), needs 2 GPUs of their models"}},
	} {
		err := Preflight(t.Context(), Destination{Local: true, GPUs: tc.devs}, Need{GPU: tc.gpus})
		if tc.want == nil {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		var pe *PreflightError
		if !errors.As(err, &pe) {
			t.Errorf("%s: Preflight = %v, want a PreflightError", tc.name, err)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v\ndoes not say %q", tc.name, err, w)
			}
		}
	}
	// a remote destination's GPUs are not this host's: not checked here
	if err := Preflight(t.Context(), Destination{GPUs: gpuInventory{}}, Need{GPU: st(1)}); err != nil {
		t.Errorf("remote: %v", err)
	}
}

// heldInventory is a source node's GPUs whose processes hold device memory (host PID -> UUID ->
// bytes), or cannot tell (unsupported).
type heldInventory struct {
	gpuInventory
	held        map[int]map[string]uint64
	unsupported bool
}

func (h heldInventory) ProcessMemory(pid int) (map[string]uint64, error) {
	if h.unsupported {
		return nil, gpu.ErrUnsupported
	}
	return h.held[pid], nil
}

// TestGPUNeedOfSource: the device memory a source's processes hold, summed per GPU in the
// inventory's order, with the GPU's model; nothing when they hold none or the inventory cannot
// tell.
func TestGPUNeedOfSource(t *testing.T) {
	devs := gpuInventory{{Index: 0, UUID: "GPU-a", Name: "H200", MemoryTotal: 100}, {Index: 1, UUID: "GPU-b", Name: "H200", MemoryTotal: 100}}
	inv := heldInventory{gpuInventory: devs, held: map[int]map[string]uint64{7: {"GPU-b": 10}, 8: {"GPU-b": 5, "GPU-a": 1}}}
	st, err := GPUNeedOfSource(inv, []int{7, 8, 9})
	want := []checkpoint.GPUDevice{{UUID: "GPU-a", Name: "H200", MemoryTotal: 100, MemoryUsed: 1}, {UUID: "GPU-b", Name: "H200", MemoryTotal: 100, MemoryUsed: 15}}
	if err != nil || st == nil || !reflect.DeepEqual(st.Devices, want) {
		t.Errorf("GPUNeedOfSource = %+v, %v", st, err)
	}
	if st, err := GPUNeedOfSource(inv, []int{9}); st != nil || err != nil {
		t.Errorf("no device memory held: %+v, %v", st, err)
	}
	inv.unsupported = true
	if st, err := GPUNeedOfSource(inv, []int{7}); st != nil || err != nil {
		t.Errorf("per-process memory unsupported: %+v, %v", st, err)
	}
}

// TestPreflightHostRoot: with HostRoot (a probe's view of the host), bind sources and /proc are
// the host's under it, a host symlink resolved inside it, never this process's files.
func TestPreflightHostRoot(t *testing.T) {
	host := t.TempDir()
	for _, d := range []string{"proc/42", "srv/models", "data"} {
		if err := os.MkdirAll(filepath.Join(host, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// an absolute host link: /models -> /srv/models on the host, not this process's /srv
	if err := os.Symlink("/srv/models", filepath.Join(host, "models")); err != nil {
		t.Fatal(err)
	}
	// a link out of the host root: resolved inside it, so missing
	if err := os.Symlink("/etc", filepath.Join(host, "etc-link")); err != nil {
		t.Fatal(err)
	}
	need := Need{
		PIDs: []int{42, 43},
		Spec: &specs.Spec{Linux: &specs.Linux{}, Mounts: []specs.Mount{
			{Destination: "/m", Source: "/models", Type: "bind"},
			{Destination: "/d", Source: "/data", Type: "bind"},
			{Destination: "/gone", Source: "/var/lib/gone", Type: "bind"},
			{Destination: "/e", Source: "/etc-link/hostname", Type: "bind"},
			{Destination: "/proc-of-this", Source: "/proc/self", Type: "bind"},
		}},
	}
	err := Preflight(t.Context(), Destination{Local: true, HostRoot: host}, need)
	fields := refusalFields(t, err)
	want := map[string]string{
		"mounts[2].source (destination /gone)":         "/var/lib/gone (missing)",
		"mounts[3].source (destination /e)":            "/etc-link/hostname (missing)",
		"mounts[4].source (destination /proc-of-this)": "/proc/self (missing)",
		"PID 42": "in use in the host's PID namespace",
	}
	if !reflect.DeepEqual(fields, want) {
		t.Errorf("refusals %v\nwant %v", fields, want)
	}
	// with its own PID namespace, the PIDs are not the host's business
	need.Spec.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.PIDNamespace}}
	need.Spec.Mounts = need.Spec.Mounts[:2]
	if err := Preflight(t.Context(), Destination{Local: true, HostRoot: host}, need); err != nil {
		t.Errorf("present sources, own PID namespace: %v", err)
	}
}

// TestContainerPIDs: a container's processes are those whose cgroup path has its ID as its
// container element (cgroupfs) or its scope (systemd); another container's or the pod's are not.
func TestContainerPIDs(t *testing.T) {
	const id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	proc := t.TempDir()
	for pid, cg := range map[string]string{
		"10":   "12:memory:/kubepods/besteffort/pod1/" + id + "\n0::/\n",
		"11":   "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + id + ".scope\n",
		"12":   "12:memory:/kubepods/besteffort/pod1/fedcba9876543210\n",
		"13":   "12:memory:/kubepods/besteffort/pod1\n",
		"self": "12:memory:/kubepods/besteffort/pod1/" + id + "\n",
	} {
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte(cg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	pids, err := ContainerPIDs(proc, id, Anchor{PodUID: "1"})
	if err != nil || !reflect.DeepEqual(pids, []int{10, 11}) {
		t.Errorf("ContainerPIDs = %v, %v; want [10 11]", pids, err)
	}
	if _, err := ContainerPIDs(proc, "abc", Anchor{}); err == nil {
		t.Error("a 3-character id was accepted")
	}
	host := filepath.Dir(proc)
	if err := os.Rename(proc, filepath.Join(host, "proc")); err != nil {
		t.Fatal(err)
	}
	if n, err := HeldOnHost(host, id, Anchor{PodUID: "1"}, nil); err != nil || !reflect.DeepEqual(n.PIDs, []int{10, 11}) || n.GPU != nil {
		t.Errorf("HeldOnHost = %+v, %v", n, err)
	}
	if _, err := HeldOnHost(host, "ffffffffffffffff", Anchor{}, nil); err == nil || !strings.Contains(err.Error(), "no process") {
		t.Errorf("HeldOnHost of a container not there: %v", err)
	}
}

// TestContainerPIDsCgroups: each fixture of testdata/cgroup is one process's /proc/PID/cgroup;
// the process is the container's only when its cgroup (or one below it) is the container's own,
// anchored where the runtime puts it (in cgroup v1 or v2, cgroupfs or systemd, under a kubelet
// cgroupRoot or seen from another cgroup namespace): below its pod's cgroup under kubepods (CRI),
// or /NAMESPACE/ID at the root (containerd). Never a cgroup whose name merely contains the id,
// one named after it below another container's (which that container's tenant could make), nor
// one that a local user or service can make below its delegated systemd unit.
func TestContainerPIDsCgroups(t *testing.T) {
	const cri = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	const plain = "victim-app-0001"
	pod1 := Anchor{PodUID: "1"}
	ns := Anchor{Namespace: "default"}
	for _, tc := range []struct {
		fixture string
		id      string
		anchor  Anchor
		want    bool
	}{
		{"v1-cgroupfs", cri, pod1, true},
		{"v1-cgroup-root", cri, pod1, true},
		{"v2-systemd", cri, pod1, true},
		{"v2-systemd-guaranteed", cri, pod1, true},
		{"v2-child-of-container", cri, pod1, true},
		{"v2-outside-cgroupns", cri, pod1, true},
		{"v2-systemd", cri, Anchor{}, true},
		{"v2-other-pod", cri, Anchor{}, true},
		{"v2-other-pod", cri, pod1, false},
		{"v2-systemd", cri, Anchor{PodUID: "2"}, false},
		{"v2-other-container", cri, pod1, false},
		{"v2-pod", cri, pod1, false},
		{"lookalike-suffix", cri, pod1, false},
		{"lookalike-child", cri, pod1, false},
		{"lookalike-child-scope", cri, pod1, false},
		{"lookalike-v1-substring", cri, pod1, false},
		{"lookalike-service", cri, pod1, false},
		{"user-delegation", cri, pod1, false},
		{"user-delegation", cri, Anchor{}, false},
		{"user-delegation-kubepods", cri, pod1, false},
		{"podman-scope", cri, Anchor{}, false},
		{"service-child", cri, Anchor{}, false},
		{"root-child", cri, Anchor{}, false},
		{"not-cgroup", cri, pod1, false},
		{"containerd-ns", plain, ns, true},
		{"containerd-ns", plain, Anchor{}, true},
		{"containerd-ns-child", plain, ns, true},
		{"containerd-ns", plain, Anchor{Namespace: "other"}, false},
		{"containerd-ns", plain, pod1, false},
		{"containerd-tenant-child", plain, ns, false},
		{"containerd-tenant-child", plain, Anchor{}, false},
		{"containerd-tenant-child-scope", plain, Anchor{}, false},
		{"containerd-under-service", plain, Anchor{}, false},
	} {
		t.Run(fmt.Sprintf("%s/%+v", tc.fixture, tc.anchor), func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("testdata", "cgroup", tc.fixture))
			if err != nil {
				t.Fatal(err)
			}
			proc := t.TempDir()
			if err := os.MkdirAll(filepath.Join(proc, "42"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(proc, "42", "cgroup"), b, 0o644); err != nil {
				t.Fatal(err)
			}
			pids, err := ContainerPIDs(proc, tc.id, tc.anchor)
			if err != nil {
				t.Fatal(err)
			}
			if got := len(pids) == 1; got != tc.want {
				t.Errorf("ContainerPIDs(%s, %+v) = %v for %q; want the process: %v", tc.id, tc.anchor, pids, b, tc.want)
			}
		})
	}
}

// TestPreflightHostPathNotVisible: as the berth probe runs (uid 64535), a bind source under a
// host directory it may not search (0700, such as /home/USER) is refused as not visible, beside
// the other checks; it used to stop the whole check with securejoin's lstat error. Run as root,
// the test runs itself again as uid 64535.
func TestPreflightHostPathNotVisible(t *testing.T) {
	if os.Getenv("BERTH_TEST_NOT_VISIBLE_ROOT") == "" {
		if os.Getuid() != 0 {
			t.Skip("needs root, to run the check as uid 64535")
		}
		host, err := os.MkdirTemp("", "berth-notvisible-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(host) })
		for _, d := range []string{"proc", "home/u/data", "srv"} {
			if err := os.MkdirAll(filepath.Join(host, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(filepath.Join(host, "home/u"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(host, 0o755); err != nil {
			t.Fatal(err)
		}
		// the test binary, where uid 64535 may run it (go test's build directory is root's, 0700)
		bin := filepath.Join(host, "move.test")
		b, err := os.ReadFile(os.Args[0])
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(bin, b, 0o755); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "-test.run=^TestPreflightHostPathNotVisible$", "-test.v")
		cmd.Env = append(os.Environ(), "BERTH_TEST_NOT_VISIBLE_ROOT="+host)
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 64535, Gid: 64535}}
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestPreflightHostPathNotVisible") {
			t.Fatalf("as uid 64535: %v\n%s", err, out)
		}
		return
	}
	host := os.Getenv("BERTH_TEST_NOT_VISIBLE_ROOT")
	need := Need{Spec: &specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}}}, Mounts: []specs.Mount{
		{Destination: "/data", Source: "/home/u/data", Type: "bind"},
		{Destination: "/srv", Source: "/srv", Type: "bind"},
		{Destination: "/gone", Source: "/gone", Type: "bind"},
	}}}
	err := Preflight(t.Context(), Destination{Local: true, HostRoot: host}, need)
	fields := refusalFields(t, err)
	if v := fields["mounts[0].source (destination /data)"]; !strings.Contains(v, "/home/u/data (not visible to the check") {
		t.Errorf("the source under a 0700 directory: %q; refusals %v", v, fields)
	}
	if v := fields["mounts[2].source (destination /gone)"]; v != "/gone (missing)" || len(fields) != 2 {
		t.Errorf("refusals %v; want /home/u/data not visible and /gone missing", fields)
	}
}

// refusalFields returns the refused fields of err, a Preflight error, with their values; it fails
// the test when err is not a PreflightError.
func refusalFields(t *testing.T, err error) map[string]string {
	t.Helper()
	var pe *PreflightError
	if !errors.As(err, &pe) {
		t.Fatalf("Preflight = %v, want a PreflightError", err)
	}
	fields := map[string]string{}
	for _, r := range pe.Refusals {
		fields[r.Field] = r.Value
	}
	return fields
}
