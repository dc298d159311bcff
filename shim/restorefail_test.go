package shim

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/berth-dev/berth/oci/checkpoint"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestCRIULogErrors(t *testing.T) {
	p := filepath.Join(t.TempDir(), "dump.log")
	log := "(00.1) ok\n(00.1) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n(00.2) Error (criu/sk-inet.c:137): inet: Unsupported proto 262\n(00.3) fine\n(00.4) Error (criu/cr-dump.c:1975): Dumping FAILED.\n"
	if err := os.WriteFile(p, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	lines, ok := criuLogErrors(p)
	got := lastLines(lines, 4)
	if !ok || !strings.Contains(got, "Unsupported proto 262") || !strings.Contains(got, "Dumping FAILED") || strings.Contains(got, "fine") || strings.Contains(got, "RLIMIT_NOFILE") {
		t.Errorf("criuLogErrors = %q, %v", got, ok)
	}
	if _, ok := criuLogErrors(filepath.Join(t.TempDir(), "none")); ok {
		t.Error("a missing log reads as present")
	}
}

// TestRestoreCause tells each known cause from CRIU 4.2.1's own lines (as the e2e tests met them).
func TestRestoreCause(t *testing.T) {
	limit := int64(64 << 20)
	spec := &specs.Spec{
		Mounts: []specs.Mount{{Destination: "/data", Source: "/srv/data", Type: "bind", Options: []string{"rbind", "ro"}}},
		Linux:  &specs.Linux{Resources: &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}}},
	}
	for _, tc := range []struct {
		name  string
		lines []string
		logOK bool
		need  int64
		want  error
		class error
		words []string
	}{
		{"no log", nil, false, 0, ErrCRIUOptions, errdefs.ErrInvalidArgument, []string{"criu_options in cfg.toml", criuConfigName}},
		{"pid", []string{"Error (criu/cr-restore.c:1237): Can't fork for 7: File exists", "(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 0, ErrPIDInUse, errdefs.ErrFailedPrecondition, []string{"PID 7", "PID namespace"}},
		{"shm", []string{"(00.158197)      1: Error (criu/files-reg.c:2267): Can't open file dev/shm/berth-shm: No such file or directory", "(00.158198)      1: Error (criu/files.c:1221): Unable to open fd=3 id=0x3", "(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 0, ErrShmFile, errdefs.ErrFailedPrecondition, []string{"/dev/shm/berth-shm open"}},
		{"bind", []string{"Error (criu/files-reg.c:2353): Can't open file data/model.bin on restore: No such file or directory", "(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 0, ErrMountSource, errdefs.ErrFailedPrecondition, []string{"/data/model.bin", "/srv/data -> /data", "/srv/data/model.bin does not exist"}},
		{"other file", []string{"Error (criu/files-reg.c:2353): Can't open file tmp/x on restore: No such file or directory", "(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 0, ErrMountSource, errdefs.ErrFailedPrecondition, []string{"/tmp/x"}},
		{"oom killed", []string{"Error (criu/cr-restore.c:1269): 7 killed by signal 9: Killed"}, true, 1 << 30, ErrOutOfMemory, errdefs.ErrResourceExhausted, []string{"linux.resources.memory.limit) is 67108864 bytes", "1073741824 bytes of memory pages"}},
		{"under limit, no cause", []string{"(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 1 << 30, ErrOutOfMemory, errdefs.ErrResourceExhausted, []string{"raise the limit to at least 1090519040 bytes"}},
		{"CRIU killed (no verdict)", []string{"(00.146974) Error (criu/cgroup.c:2055): cg: cgroupd: recv req error: No such file or directory"}, true, 60 << 20, ErrOutOfMemory, errdefs.ErrResourceExhausted, []string{"CRIU was killed while it restored (its log ends without its verdict)", "is 67108864 bytes, not enough above the 62914560 bytes", "at least 79691776 bytes"}},
		{"oom killed above the pages", []string{"Error (criu/cr-restore.c:1269): 7 killed by signal 9: Killed"}, true, 60 << 20, ErrOutOfMemory, errdefs.ErrResourceExhausted, []string{"killed (SIGKILL", "is 67108864 bytes, not enough above the 62914560 bytes of memory pages", "CRIU itself runs in the container's cgroup", "at least 79691776 bytes"}},
		{"unknown", []string{"Error (criu/x.c:1): something else", "(00.040680) Error (criu/cr-restore.c:2331): Restoring FAILED."}, true, 1 << 20, nil, nil, nil},
	} {
		c := restoreCause(tc.lines, tc.logOK, restoreFacts{spec: spec, need: tc.need, configName: "cfg.toml"})
		if tc.want == nil {
			if c != nil {
				t.Errorf("%s: cause %v, want none", tc.name, c.sentinel)
			}
			continue
		}
		if c == nil || c.sentinel != tc.want {
			t.Errorf("%s: cause %+v, want %v", tc.name, c, tc.want)
			continue
		}
		for _, w := range tc.words {
			if !strings.Contains(c.sentence, w) {
				t.Errorf("%s: %q does not say %q", tc.name, c.sentence, w)
			}
		}
		if got := errorClass(mark(errors.New("x"), c.sentinel)); got != tc.class {
			t.Errorf("%s: class %v, want %v", tc.name, got, tc.class)
		}
	}
}

func TestDumpCause(t *testing.T) {
	c := dumpCause([]string{"Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted"}, true, "cfg")
	if c == nil || c.sentinel != ErrMissingCapability || !strings.Contains(c.sentence, "CAP_SYS_RESOURCE") || !strings.Contains(c.sentence, "user namespace") {
		t.Errorf("rlimit: %+v", c)
	}
	if c := dumpCause([]string{"Error (criu/sk-inet.c:137): inet: Unsupported proto 262"}, true, "cfg"); c != nil {
		t.Errorf("unknown cause told: %+v", c)
	}
	if c := dumpCause(nil, false, "cfg"); c == nil || c.sentinel != ErrCRIUOptions {
		t.Errorf("no log: %+v", c)
	}
}

// TestExplainRestore: the error quotes the cause, CRIU's lines and where the log is kept,
// beside a checkpoint in the root, and keeps runc's error and the sentinel.
func TestExplainRestore(t *testing.T) {
	root := t.TempDir()
	bundle := t.TempDir()
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), []byte(`{"ociVersion":"1.2.0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	// containerd links bundle/work to the task's work directory, where runc has CRIU write
	work := t.TempDir()
	if err := os.Symlink(work, filepath.Join(bundle, bundleWorkDir)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, restoreLogFile), []byte("(0.1) Error (criu/cr-restore.c:1237): Can't fork for 7: File exists\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := &Service{cfg: Config{CheckpointRoot: root, Path: "cfg.toml"}}
	runc := errors.New("OCI runtime restore failed: criu failed: type RESTORE errno 17")
	err := s.explainRestore(t.Context(), "r1", &restoredTask{bundle: bundle}, runc)
	kept := filepath.Join(root, RestoreLogsDir, "r1.restore.log")
	for _, w := range []string{"restore r1: PID 7 of the checkpoint", "CRIU says: (0.1) Error (criu/cr-restore.c:1237): Can't fork for 7: File exists", "restore log is kept at " + kept, "runc: OCI runtime restore failed"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q does not say %q", err, w)
		}
	}
	if !errors.Is(err, ErrPIDInUse) || !errors.Is(err, runc) {
		t.Errorf("%v: sentinel or runc's error lost", err)
	}
	if b, rerr := os.ReadFile(kept); rerr != nil || !strings.Contains(string(b), "Can't fork") {
		t.Errorf("kept log: %v %q", rerr, b)
	}
}

func TestCheckRestoreFits(t *testing.T) {
	dir := t.TempDir()
	limit := int64(1 << 20)
	spec := func(src string) *specs.Spec {
		return &specs.Spec{
			Mounts: []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}, {Destination: "/data", Source: src, Type: "bind"}},
			Linux:  &specs.Linux{Resources: &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}}},
		}
	}
	small := &restorePlan{dir: "ck"}
	if err := checkRestoreFits(small, spec(dir)); err != nil {
		t.Errorf("fits: %v", err)
	}
	err := checkRestoreFits(nil, spec(filepath.Join(dir, "gone")))
	if !errors.Is(err, ErrMountSource) || !strings.Contains(err.Error(), "mounts[1] (destination /data): bind source "+filepath.Join(dir, "gone")) {
		t.Errorf("missing source: %v", err)
	}
	big := &restorePlan{dir: "ck", manifest: &checkpointManifestWithPages}
	err = checkRestoreFits(big, spec(dir))
	if !errors.Is(err, ErrOutOfMemory) || !strings.Contains(err.Error(), "linux.resources.memory.limit is 1048576 bytes, below the 4194304 bytes") {
		t.Errorf("memory: %v", err)
	}
}

var checkpointManifestWithPages = checkpoint.Manifest{CRIU: checkpoint.CRIUStats{PagesWritten: 1024}}
