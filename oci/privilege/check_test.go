package privilege

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// loadSpec reads testdata/specs/<name>.json: containerd-default is `ctr oci spec` of containerd
// 2.4.2; cri-pod is a pod's container as the CRI plugin writes it (user 1000, no_new_privs,
// AppArmor, a seccomp profile, network/ipc/uts joined from the sandbox by path).
func loadSpec(t *testing.T, name string) *specs.Spec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "specs", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return &s
}

// granted returns the thread runc would start under s: its user, its capability sets.
func granted(s *specs.Spec) Process {
	c := FromSpec(s)
	u := c.User
	p := Process{PID: 1, TID: 1, Comm: "python3",
		UID: u.UID, EUID: u.UID, SUID: u.UID, FSUID: u.UID,
		GID: u.GID, EGID: u.GID, SGID: u.GID, FSGID: u.GID, Groups: u.AdditionalGids,
		CapEff: c.Capabilities.Effective, CapPrm: c.Capabilities.Permitted, CapInh: c.Capabilities.Inheritable,
		CapBnd: c.Capabilities.Bounding, CapAmb: c.Capabilities.Ambient,
		NoNewPrivs: c.NoNewPrivileges, LSMProfile: c.AppArmorProfile,
	}
	if c.Seccomp != nil {
		p.Seccomp = SeccompFilter
	}
	return p
}

const (
	capSysAdmin  = 21
	capNetAdmin  = 12
	capSysPtrace = 19
)

// privileged makes s what containerd writes for a privileged container.
func privileged(s *specs.Spec) {
	var all []string
	for n := range 41 {
		all = append(all, CapName(n))
	}
	s.Process.Capabilities = &specs.LinuxCapabilities{Bounding: all, Effective: all, Permitted: all}
	s.Process.ApparmorProfile = ""
	s.Linux.Seccomp = nil
	s.Linux.MaskedPaths, s.Linux.ReadonlyPaths = nil, nil
}

// fields returns "subject/field" of each violation in err, or nil for nil.
func fields(t *testing.T, err error) []string {
	t.Helper()
	if err == nil {
		return nil
	}
	if !errors.Is(err, ErrExceedsSpec) {
		t.Fatalf("error %v does not wrap ErrExceedsSpec", err)
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v is not an *Error", err)
	}
	var out []string
	for _, v := range e.Violations {
		out = append(out, v.Subject+"/"+v.Field)
	}
	return out
}

func TestCheckProcesses(t *testing.T) {
	for _, tc := range []struct {
		name    string
		spec    string
		dst     func(*specs.Spec) // edits the destination spec
		procs   func(p Process) []Process
		want    []string // subject/field of each violation
		mention []string // the message names these
	}{
		{name: "exactly what the spec grants", spec: "containerd-default",
			procs: func(p Process) []Process { return []Process{p} }},
		{name: "pod process as granted", spec: "cri-pod",
			procs: func(p Process) []Process { return []Process{p} }},
		{name: "less: child dropped to a user, no capabilities", spec: "containerd-default",
			procs: func(p Process) []Process {
				c := p
				c.PID, c.TID, c.Comm = 7, 7, "worker"
				c.UID, c.EUID, c.SUID, c.FSUID, c.GID, c.EGID, c.SGID, c.FSGID = 33, 33, 33, 33, 33, 33, 33, 33
				c.CapEff, c.CapPrm, c.CapBnd = 0, 0, p.CapBnd.Minus(1<<capSysAdmin)
				c.NoNewPrivs, c.Seccomp = true, SeccompStrict
				return []Process{p, c}
			}},
		{name: "CAP_SYS_ADMIN effective and permitted", spec: "containerd-default",
			procs: func(p Process) []Process {
				p.CapEff |= 1 << capSysAdmin
				p.CapPrm |= 1 << capSysAdmin
				return []Process{p}
			},
			want:    []string{"process 1 (python3)/cap_eff", "process 1 (python3)/cap_prm"},
			mention: []string{"CAP_SYS_ADMIN beyond the destination", "CAP_CHOWN,CAP_DAC_OVERRIDE"}},
		{name: "bounding, inheritable and ambient beyond the spec", spec: "containerd-default",
			procs: func(p Process) []Process {
				p.CapBnd |= 1 << capNetAdmin
				p.CapInh |= 1 << capSysPtrace
				p.CapAmb |= 1 << capSysPtrace
				return []Process{p}
			},
			want:    []string{"process 1 (python3)/cap_inh", "process 1 (python3)/cap_bnd", "process 1 (python3)/cap_amb"},
			mention: []string{"CAP_NET_ADMIN", "CAP_SYS_PTRACE"}},
		{name: "a bit the table does not name", spec: "containerd-default",
			procs: func(p Process) []Process { p.CapBnd |= 1 << 62; return []Process{p} },
			want:  []string{"process 1 (python3)/cap_bnd"}, mention: []string{"CAP_62"}},
		{name: "root into a user 1000 spec", spec: "containerd-default",
			dst: func(s *specs.Spec) { s.Process.User = specs.User{UID: 1000, GID: 1000} },
			procs: func(p Process) []Process {
				p.UID, p.EUID, p.SUID, p.FSUID, p.GID, p.EGID, p.SGID, p.FSGID = 0, 0, 0, 0, 0, 0, 0, 0
				p.CapEff, p.CapPrm = 0, 0
				return []Process{p}
			},
			want: []string{"process 1 (python3)/uid", "process 1 (python3)/euid", "process 1 (python3)/suid",
				"process 1 (python3)/fsuid", "process 1 (python3)/gid", "process 1 (python3)/egid",
				"process 1 (python3)/sgid", "process 1 (python3)/fsgid"},
			mention: []string{"uid: 0, destination 1000"}},
		{name: "root pod: groups it could have set itself (CAP_SETGID)", spec: "containerd-default",
			procs: func(p Process) []Process { p.Groups = []uint32{0, 6, 4343}; return []Process{p} }},
		{name: "root pod without CAP_SETGID: groups beyond its own (issue 19)", spec: "containerd-default",
			dst: func(s *specs.Spec) { dropCap(s, "CAP_SETGID") },
			procs: func(p Process) []Process {
				p.CapEff, p.CapPrm, p.CapBnd = p.CapEff.Minus(1<<capSetgid), p.CapPrm.Minus(1<<capSetgid), p.CapBnd.Minus(1<<capSetgid)
				p.Groups, p.EGID = []uint32{0, 6, 4343}, 6
				return []Process{p}
			},
			want:    []string{"process 1 (python3)/egid", "process 1 (python3)/groups"},
			mention: []string{"groups: 6,4343 beyond the destination (has 0,6,4343; destination 0)"}},
		{name: "root pod without CAP_SETUID: another uid", spec: "containerd-default",
			dst: func(s *specs.Spec) { dropCap(s, "CAP_SETUID") },
			procs: func(p Process) []Process {
				p.CapEff, p.CapPrm, p.CapBnd = p.CapEff.Minus(1<<capSetuid), p.CapPrm.Minus(1<<capSetuid), p.CapBnd.Minus(1<<capSetuid)
				p.FSUID = 33
				return []Process{p}
			},
			want: []string{"process 1 (python3)/fsuid"}},
		{name: "set-user-ID root in a user 1000 spec", spec: "cri-pod",
			procs: func(p Process) []Process { p.EUID = 0; return []Process{p} },
			want:  []string{"process 1 (python3)/euid"}},
		{name: "one thread's fsuid", spec: "cri-pod",
			procs: func(p Process) []Process {
				th := p
				th.TID, th.Comm, th.FSUID = 9, "io", 1001
				return []Process{p, th}
			},
			want: []string{"process 1 thread 9 (io)/fsuid"}, mention: []string{"fsuid: 1001, destination 1000"}},
		{name: "additional gids are granted", spec: "cri-pod",
			procs: func(p Process) []Process { p.EGID, p.Groups = 44, []uint32{44}; return []Process{p} }},
		{name: "a group the spec does not give", spec: "cri-pod",
			procs: func(p Process) []Process { p.Groups = []uint32{1000, 0, 6}; return []Process{p} },
			want:  []string{"process 1 (python3)/groups"}, mention: []string{"0,6 beyond the destination"}},
		{name: "root spec: any ids", spec: "containerd-default",
			procs: func(p Process) []Process {
				p.UID, p.FSGID, p.Groups = 1234, 99, []uint32{5, 6}
				return []Process{p}
			}},
		{name: "no_new_privs missing", spec: "cri-pod",
			procs: func(p Process) []Process { p.NoNewPrivs = false; return []Process{p} },
			want:  []string{"process 1 (python3)/no_new_privs"}, mention: []string{"no_new_privs: false, destination true"}},
		{name: "no_new_privs not asked for", spec: "containerd-default",
			procs: func(p Process) []Process { p.NoNewPrivs = true; return []Process{p} }},
		{name: "seccomp disabled under a profile", spec: "cri-pod",
			procs: func(p Process) []Process { p.Seccomp = SeccompDisabled; return []Process{p} },
			want:  []string{"process 1 (python3)/seccomp"}, mention: []string{"seccomp: disabled, destination profile sha256:"}},
		{name: "seccomp strict under a profile", spec: "cri-pod",
			procs: func(p Process) []Process { p.Seccomp = SeccompStrict; return []Process{p} }},
		{name: "seccomp filter without a profile", spec: "containerd-default",
			procs: func(p Process) []Process { p.Seccomp = SeccompFilter; return []Process{p} }},
		{name: "unconfined into a confined spec", spec: "cri-pod",
			procs: func(p Process) []Process { p.LSMProfile = ""; return []Process{p} },
			want:  []string{"process 1 (python3)/apparmor"}, mention: []string{"apparmor: unconfined, destination cri-containerd.apparmor.d"}},
		{name: "another profile", spec: "cri-pod",
			procs: func(p Process) []Process { p.LSMProfile = "custom"; return []Process{p} },
			want:  []string{"process 1 (python3)/apparmor"}},
		{name: "confined into an unconfined spec", spec: "containerd-default",
			procs: func(p Process) []Process { p.LSMProfile = "cri-containerd.apparmor.d"; return []Process{p} }},
		{name: "a spec granting more: privileged", spec: "containerd-default", dst: privileged,
			procs: func(p Process) []Process {
				p.CapEff, p.CapPrm, p.CapBnd = 1<<41-1, 1<<41-1, 1<<41-1
				return []Process{p}
			}},
		{name: "many threads: every one listed", spec: "cri-pod",
			procs: func(p Process) []Process {
				var ps []Process
				for i := range 10 {
					th := p
					th.TID, th.CapBnd = 1+i, p.CapBnd|1<<capSysAdmin
					ps = append(ps, th)
				}
				return ps
			},
			want: []string{"process 1 (python3)/cap_bnd", "process 1 thread 2 (python3)/cap_bnd", "process 1 thread 3 (python3)/cap_bnd",
				"process 1 thread 4 (python3)/cap_bnd", "process 1 thread 5 (python3)/cap_bnd", "process 1 thread 6 (python3)/cap_bnd",
				"process 1 thread 7 (python3)/cap_bnd", "process 1 thread 8 (python3)/cap_bnd", "process 1 thread 9 (python3)/cap_bnd",
				"process 1 thread 10 (python3)/cap_bnd"},
			mention: []string{"; and 2 more"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := loadSpec(t, tc.spec)
			dst := loadSpec(t, tc.spec)
			if tc.dst != nil {
				tc.dst(dst)
			}
			err := CheckProcesses(tc.procs(granted(src)), dst)
			if got := fields(t, err); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("violations = %q, want %q (error: %v)", got, tc.want, err)
			}
			for _, m := range tc.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
			if err != nil {
				t.Log(err)
			}
		})
	}
}

func TestCheckProcessesNoDestinationProcess(t *testing.T) {
	p := granted(loadSpec(t, "containerd-default"))
	for name, dst := range map[string]*specs.Spec{"nil": nil, "no process": {Linux: &specs.Linux{}}} {
		if err := CheckProcesses([]Process{p}, dst); !errors.Is(err, ErrExceedsSpec) {
			t.Errorf("%s: got %v, want ErrExceedsSpec", name, err)
		}
		if err := CheckContainer(FromSpec(nil), dst); !errors.Is(err, ErrExceedsSpec) {
			t.Errorf("%s: CheckContainer got %v, want ErrExceedsSpec", name, err)
		}
	}
}

func TestCheckContainer(t *testing.T) {
	const subj = "source container/"
	for _, tc := range []struct {
		name     string
		src, dst string
		editSrc  func(*specs.Spec)
		editDst  func(*specs.Spec)
		want     []string // fields
		mention  []string
	}{
		{name: "same spec", src: "containerd-default", dst: "containerd-default"},
		{name: "same pod spec", src: "cri-pod", dst: "cri-pod"},
		{name: "destination grants more", src: "cri-pod", dst: "containerd-default", editDst: podNamespaces},
		{name: "destination privileged", src: "cri-pod", dst: "containerd-default",
			editDst: func(s *specs.Spec) { privileged(s); podNamespaces(s) }},
		{name: "pod namespaces into a plain container's", src: "cri-pod", dst: "containerd-default",
			want:    []string{"namespace.network", "namespace.ipc", "namespace.uts"},
			mention: []string{"namespace.network: path, destination private"}},
		{name: "privileged into default", src: "containerd-default", dst: "containerd-default", editSrc: privileged,
			want:    []string{"privileged", "cap_eff", "cap_prm", "cap_bnd"},
			mention: []string{"privileged: true, destination false", "CAP_SYS_ADMIN"}},
		{name: "root into a user 1000 pod", src: "containerd-default", dst: "cri-pod",
			editSrc: podNamespaces,
			want:    []string{"uid", "gid", "seccomp", "apparmor"},
			mention: []string{"uid: 0, destination 1000", "seccomp: none, destination profile sha256:", "apparmor: unconfined, destination cri-containerd.apparmor.d"}},
		{name: "no_new_privs missing", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) { s.Process.NoNewPrivileges = false },
			want:    []string{"no_new_privs"}},
		{name: "other additional gids", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) { s.Process.User.AdditionalGids = []uint32{1000, 27} },
			want:    []string{"groups"}, mention: []string{"27 beyond the destination"}},
		{name: "another seccomp profile", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) {
				s.Linux.Seccomp.Syscalls[0].Names = append(s.Linux.Seccomp.Syscalls[0].Names, "ptrace")
			},
			want: []string{"seccomp"}},
		{name: "seccomp profile into none", src: "cri-pod", dst: "cri-pod",
			editDst: func(s *specs.Spec) { s.Linux.Seccomp = nil }},
		{name: "another AppArmor profile", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) { s.Process.ApparmorProfile = "custom" },
			want:    []string{"apparmor"}, mention: []string{"apparmor: custom, destination cri-containerd.apparmor.d"}},
		{name: "confined into unconfined", src: "cri-pod", dst: "cri-pod",
			editDst: func(s *specs.Spec) { s.Process.ApparmorProfile = "unconfined" }},
		{name: "host network into a pod network", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) { s.Linux.Namespaces = drop(s.Linux.Namespaces, specs.NetworkNamespace) },
			editDst: func(s *specs.Spec) { s.Linux.Namespaces = unjoin(s.Linux.Namespaces, specs.NetworkNamespace) },
			want:    []string{"namespace.network"}, mention: []string{"namespace.network: host, destination private"}},
		{name: "host pid into a private pid namespace", src: "cri-pod", dst: "cri-pod",
			editSrc: func(s *specs.Spec) { s.Linux.Namespaces = drop(s.Linux.Namespaces, specs.PIDNamespace) },
			want:    []string{"namespace.pid"}},
		{name: "joined by path into a private one", src: "cri-pod", dst: "cri-pod",
			editDst: func(s *specs.Spec) { s.Linux.Namespaces = unjoin(s.Linux.Namespaces, specs.IPCNamespace) },
			want:    []string{"namespace.ipc"}, mention: []string{"namespace.ipc: path, destination private"}},
		{name: "joined by path into host", src: "cri-pod", dst: "cri-pod",
			editDst: func(s *specs.Spec) { s.Linux.Namespaces = drop(s.Linux.Namespaces, specs.UTSNamespace) }},
		{name: "no user namespace into one", src: "cri-pod", dst: "cri-pod",
			editDst: func(s *specs.Spec) {
				s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
			},
			want: []string{"namespace.user"}},
		{name: "private into host", src: "containerd-default", dst: "containerd-default",
			editDst: func(s *specs.Spec) { s.Linux.Namespaces = nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst := loadSpec(t, tc.src), loadSpec(t, tc.dst)
			if tc.editSrc != nil {
				tc.editSrc(src)
			}
			if tc.editDst != nil {
				tc.editDst(dst)
			}
			err := CheckContainer(FromSpec(src), dst)
			var want []string
			for _, f := range tc.want {
				want = append(want, subj+f)
			}
			if got := fields(t, err); !reflect.DeepEqual(got, want) {
				t.Fatalf("violations = %q, want %q (error: %v)", got, want, err)
			}
			for _, m := range tc.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
			if err != nil {
				t.Log(err)
			}
		})
	}
}

func TestCheckContainerMissingNamespaceIsHost(t *testing.T) {
	src := FromSpec(loadSpec(t, "containerd-default"))
	delete(src.Namespaces, specs.PIDNamespace)
	got := fields(t, CheckContainer(src, loadSpec(t, "containerd-default")))
	if want := []string{"source container/namespace.pid"}; !reflect.DeepEqual(got, want) {
		t.Errorf("violations = %q, want %q", got, want)
	}
}

// podNamespaces gives s the namespaces of the cri-pod fixture (network, ipc, uts joined by path).
func podNamespaces(s *specs.Spec) {
	var pod specs.Spec
	b, _ := os.ReadFile(filepath.Join("testdata", "specs", "cri-pod.json"))
	_ = json.Unmarshal(b, &pod)
	s.Linux.Namespaces = pod.Linux.Namespaces
}

func drop(nss []specs.LinuxNamespace, t specs.LinuxNamespaceType) []specs.LinuxNamespace {
	return slices.DeleteFunc(slices.Clone(nss), func(ns specs.LinuxNamespace) bool { return ns.Type == t })
}

func unjoin(nss []specs.LinuxNamespace, t specs.LinuxNamespaceType) []specs.LinuxNamespace {
	out := slices.Clone(nss)
	for i := range out {
		if out[i].Type == t {
			out[i].Path = ""
		}
	}
	return out
}

func TestFromSpec(t *testing.T) {
	c := FromSpec(loadSpec(t, "cri-pod"))
	if want := (User{UID: 1000, GID: 1000, AdditionalGids: []uint32{1000, 44}}); !reflect.DeepEqual(c.User, want) {
		t.Errorf("User = %+v, want %+v", c.User, want)
	}
	if got := c.Capabilities.Bounding.String(); got != "CAP_CHOWN,CAP_DAC_OVERRIDE,CAP_FOWNER,CAP_FSETID,CAP_KILL,CAP_SETGID,CAP_SETUID,CAP_SETPCAP,CAP_NET_BIND_SERVICE,CAP_NET_RAW,CAP_SYS_CHROOT,CAP_MKNOD,CAP_AUDIT_WRITE,CAP_SETFCAP" {
		t.Errorf("Bounding = %s", got)
	}
	if c.Capabilities.Inheritable != 0 || c.Capabilities.Ambient != 0 {
		t.Errorf("Inheritable, Ambient = %s, %s, want none", c.Capabilities.Inheritable, c.Capabilities.Ambient)
	}
	if !c.NoNewPrivileges || c.AppArmorProfile != "cri-containerd.apparmor.d" || c.Privileged {
		t.Errorf("NoNewPrivileges, AppArmorProfile, Privileged = %v, %q, %v", c.NoNewPrivileges, c.AppArmorProfile, c.Privileged)
	}
	if c.Seccomp == nil || c.Seccomp.DefaultAction != specs.ActErrno || !strings.HasPrefix(c.Seccomp.Digest, "sha256:") || len(c.Seccomp.Digest) != 71 {
		t.Errorf("Seccomp = %+v", c.Seccomp)
	}
	want := map[specs.LinuxNamespaceType]NamespaceMode{
		specs.PIDNamespace: NamespacePrivate, specs.NetworkNamespace: NamespaceJoined, specs.IPCNamespace: NamespaceJoined,
		specs.UTSNamespace: NamespaceJoined, specs.MountNamespace: NamespacePrivate, specs.UserNamespace: NamespaceHost,
		specs.CgroupNamespace: NamespacePrivate,
	}
	if !reflect.DeepEqual(c.Namespaces, want) {
		t.Errorf("Namespaces = %v, want %v", c.Namespaces, want)
	}

	p := loadSpec(t, "containerd-default")
	privileged(p)
	if !FromSpec(p).Privileged {
		t.Error("privileged spec: Privileged = false")
	}
	p.Linux.MaskedPaths = []string{"/proc/kcore"}
	if FromSpec(p).Privileged {
		t.Error("privileged spec with a masked path: Privileged = true")
	}

	// Unknown names are left out, as runc leaves them out.
	p.Process.Capabilities.Effective = []string{"CAP_CHOWN", "CAP_NO_SUCH", "cap_kill"}
	if got := FromSpec(p).Capabilities.Effective; got != 1 {
		t.Errorf("Effective = %s, want CAP_CHOWN", got)
	}

	nothing := FromSpec(nil)
	for _, ty := range NamespaceTypes {
		if nothing.Namespaces[ty] != NamespaceHost {
			t.Errorf("FromSpec(nil) namespace %s = %s, want host", ty, nothing.Namespaces[ty])
		}
	}
}

func TestContainerJSONRoundTrip(t *testing.T) {
	c := FromSpec(loadSpec(t, "cri-pod"))
	c.Capabilities.Ambient = 1<<capSysAdmin | 1<<63
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"ambient":["CAP_SYS_ADMIN","CAP_63"]`) {
		t.Errorf("JSON %s: ambient not written by name", b)
	}
	var back Container
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, c) {
		t.Errorf("round trip:\n got %+v\nwant %+v", back, c)
	}
	for _, bad := range []string{`["CAP_NO_SUCH"]`, `["CAP_64"]`, `["chown"]`, `"CAP_CHOWN"`} {
		var s CapSet
		if err := json.Unmarshal([]byte(bad), &s); err == nil {
			t.Errorf("CapSet from %s: no error", bad)
		}
	}
}

func TestCapSet(t *testing.T) {
	s, unknown := ParseCapSet([]string{"CAP_SYS_ADMIN", "CAP_CHOWN", "CAP_CHECKPOINT_RESTORE", "CAP_FOO"})
	if s != 1<<21|1|1<<40 || !reflect.DeepEqual(unknown, []string{"CAP_FOO"}) {
		t.Errorf("ParseCapSet = %#x, %q", uint64(s), unknown)
	}
	if got := s.String(); got != "CAP_CHOWN,CAP_SYS_ADMIN,CAP_CHECKPOINT_RESTORE" {
		t.Errorf("String = %q", got)
	}
	if !s.Has(21) || s.Has(22) || s.Has(64) || s.Has(-1) {
		t.Error("Has")
	}
	if got := s.Minus(1); got != 1<<21|1<<40 {
		t.Errorf("Minus = %s", got)
	}
	if CapSet(0).String() != "none" {
		t.Error("empty set String")
	}
}

func TestProcessJSONRoundTrip(t *testing.T) {
	for _, m := range []SeccompMode{SeccompDisabled, SeccompStrict, SeccompFilter, 7} {
		p := Process{PID: 3, TID: 4, Comm: "w", Seccomp: m, CapAmb: 1 << capSysAdmin, Groups: []uint32{5}}
		b, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		var back Process
		if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back, p) {
			t.Errorf("%s: round trip %s = %+v, %v", m, b, back, err)
		}
	}
	var m SeccompMode
	if err := m.UnmarshalText([]byte("permissive")); err == nil {
		t.Error("UnmarshalText(permissive): no error")
	}
	if s := (Process{PID: 3, TID: 4, Comm: "w"}).String(); s != "process 3 thread 4 (w)" {
		t.Errorf("String = %q", s)
	}
}

// dropCap removes capability name from every set of s's process.
func dropCap(s *specs.Spec, name string) {
	c := s.Process.Capabilities
	for _, set := range []*[]string{&c.Bounding, &c.Effective, &c.Permitted, &c.Inheritable, &c.Ambient} {
		*set = slices.DeleteFunc(*set, func(n string) bool { return n == name })
	}
}
