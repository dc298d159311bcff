package shim

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/berth-dev/berth/oci"
	"github.com/berth-dev/berth/oci/checkpoint"
)

// CRIU's log files in its work directory (runc names them).
const (
	restoreLogFile = "restore.log"
	// RestoreLogsDir is the directory under the checkpoint root where the restore logs of
	// checkpoints that are not in the root (containerd's, e.g. ctr containers restore) are kept.
	RestoreLogsDir = "restore-logs"
	// maxQuotedCRIULines is how many of CRIU's error lines an error quotes.
	maxQuotedCRIULines = 4
	// restoreHeadroom is the memory, in bytes, a restore's advice asks for above the
	// checkpoint's pages: what CRIU charges to the container's cgroup besides them while it
	// restores (its own memory, page tables; a few MiB measured), with room to spare.
	restoreHeadroom = 16 << 20
)

// criuLines are CRIU's lines that name a cause (CRIU 4.x; criu/cr-restore.c, files-reg.c,
// cr-dump.c, util.c), compiled by the first failure that reads a CRIU log: every container's shim
// would otherwise hold them.
var criuLines = sync.OnceValue(func() criuLinePatterns {
	return criuLinePatterns{
		// "Error (criu/cr-restore.c:1237): Can't fork for 7: File exists"
		forkExists: regexp.MustCompile(`Can't fork for (\d+): File exists`),
		// "Error (criu/files-reg.c:2267): Can't open file dev/shm/x: No such file or directory" (CRIU
		// 4.2.1, seen in TestXccOpenShmFile), or "... Can't open file dev/shm/x on restore: No such
		// file or directory" (files-reg.c's other message, for a file it reopens by its path)
		openMissing: regexp.MustCompile(`Can't open file (\S+?)(?: on restore)?: No such file or directory`),
		// "Error (criu/cr-restore.c:1269): 7 killed by signal 9: Killed"
		killed: regexp.MustCompile(`killed by signal 9\b`),
		// "Error (criu/cr-restore.c:2331): Restoring FAILED.": CRIU's verdict on a failed restore,
		// the last thing it logs unless it was killed first
		restoreFailed: regexp.MustCompile(`Restoring FAILED`),
		// "Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted"
		rlimitEPERM: regexp.MustCompile(`Can't get rlimit \d+: Operation not permitted`),
		// "Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not
		// permitted": CRIU raising its own limit, harmless (it goes on with the limit it has)
		harmless: regexp.MustCompile(`Can't setup RLIMIT_NOFILE for self`),
	}
})

// criuLinePatterns holds criuLines' expressions.
type criuLinePatterns struct {
	forkExists, openMissing, killed, restoreFailed, rlimitEPERM, harmless *regexp.Regexp
}

// criuLogErrors returns the error lines of the CRIU log at path (those with "Error (" and the
// lines that report a killed process), without the harmless ones, trimmed; ok is false when the
// log cannot be read.
func criuLogErrors(path string) (lines []string, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, false
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if (strings.Contains(l, "Error (") || criuLines().killed.MatchString(l)) && !criuLines().harmless.MatchString(l) {
			lines = append(lines, l)
		}
	}
	return lines, true
}

// lastLines returns the last n of lines joined with " | ".
func lastLines(lines []string, n int) string {
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}

// bundleWorkDir is the name, in a task's bundle, of containerd's link to the task's work
// directory (containerd's runc shim: process.Init.WorkDir).
const bundleWorkDir = "work"

// criuWorkDir is where CRIU writes its restore log for the task: the work path of the task's
// runc options, else the task's work directory, bundle/work (containerd's runc shim gives runc
// that as --work-path when the options name none).
func (t *restoredTask) criuWorkDir() string {
	if t.criuWork != "" {
		return t.criuWork
	}
	return filepath.Join(t.bundle, bundleWorkDir)
}

// restoreFacts is what a restore's cause is told from besides CRIU's log.
type restoreFacts struct {
	// spec is the destination container's spec (nil when it cannot be read).
	spec *specs.Spec
	// need is the checkpoint's memory (checkpoint.Manifest.MemoryBytes); 0 when unknown.
	need int64
	// configName names the shim's configuration file.
	configName string
}

// cause is a failed CRIU step told in one sentence with its fix, and its sentinel.
type cause struct {
	sentinel error
	sentence string
}

// restoreCause tells the cause of a failed restore from CRIU's error lines (logOK false: CRIU
// wrote no log) and facts; nil when it is none berth knows.
func restoreCause(lines []string, logOK bool, f restoreFacts) *cause {
	if !logOK {
		return &cause{ErrCRIUOptions, fmt.Sprintf("CRIU wrote no restore log, so it refused its options: check criu_options in %s and the bundle's %s",
			f.configName, criuConfigName)}
	}
	limit := oci.MemoryLimit(f.spec)
	for _, l := range lines {
		if m := criuLines().forkExists.FindStringSubmatch(l); m != nil {
			return &cause{ErrPIDInUse, fmt.Sprintf("PID %s of the checkpoint is already taken in the PID namespace the container joins (a pod's shared PID namespace, or the host's): CRIU restores every process with its own PID; restore into a container with a PID namespace of its own (Kubernetes: shareProcessNamespace false; ctr: the default), or where PID %s is free",
				m[1], m[1])}
		}
		if m := criuLines().openMissing.FindStringSubmatch(l); m != nil {
			return openMissingCause("/"+strings.TrimPrefix(m[1], "/"), f.spec)
		}
		if criuLines().killed.MatchString(l) {
			return oomCause(limit, f.need, oomKilledTask)
		}
	}
	if !slices.ContainsFunc(lines, criuLines().restoreFailed.MatchString) {
		// CRIU itself was killed (runc then reads EOF from it): runc puts CRIU into the
		// container's cgroup while it restores, so the cgroup's OOM killer may pick CRIU
		return oomCause(limit, f.need, oomKilledCRIU)
	}
	if limit > 0 && f.need > limit {
		return oomCause(limit, f.need, oomNoSign)
	}
	return nil
}

// openMissingCause is the cause for a file the checkpointed process held open that is missing
// here: on /dev/shm, on a bind mount (its source on this node lacks it), or elsewhere.
func openMissingCause(file string, spec *specs.Spec) *cause {
	if file == "/dev/shm" || strings.HasPrefix(file, "/dev/shm/") {
		return &cause{ErrShmFile, fmt.Sprintf("the checkpointed process holds %s open, and this container's /dev/shm has no such file: /dev/shm belongs to the container (or pod) and its files do not travel with a checkpoint taken from a shared /dev/shm; have the workload keep no file open on /dev/shm when it is checkpointed (or keep it on a volume that exists on both nodes)", file)}
	}
	if m := bindMountOf(file, spec); m != nil {
		src := filepath.Join(m.Source, strings.TrimPrefix(file, m.Destination))
		return &cause{ErrMountSource, fmt.Sprintf("the checkpointed process holds %s open, on the bind mount %s -> %s, and %s does not exist on this node: give the mount's source on this node the files it had on the source node (or restore where it has them)",
			file, m.Source, m.Destination, src)}
	}
	return &cause{ErrMountSource, fmt.Sprintf("the checkpointed process holds %s open, and this node's container has no such file: give the destination the file (an external mount's source must hold what it held on the source node)", file)}
}

// How an out-of-memory restore showed itself.
const (
	// oomNoSign: CRIU failed, with nothing in its log that says why, under a limit below the
	// checkpoint's memory.
	oomNoSign = iota
	// oomKilledTask: CRIU reports a process it was restoring killed by SIGKILL.
	oomKilledTask
	// oomKilledCRIU: CRIU's log ends without its verdict: CRIU itself was killed.
	oomKilledCRIU
)

// oomCause is the cause for a restore that ran out of memory, shown as how says (oomNoSign,
// oomKilledTask, oomKilledCRIU), under the container's memory limit (0: none) with need bytes of
// pages in the checkpoint (0: unknown).
func oomCause(limit, need int64, how int) *cause {
	what := "CRIU's restore failed"
	switch how {
	case oomKilledTask:
		what = "CRIU's restore was killed (SIGKILL, the cgroup's OOM killer)"
	case oomKilledCRIU:
		what = "CRIU was killed while it restored (its log ends without its verdict), as the cgroup's OOM killer kills it"
	}
	switch {
	case limit > 0 && need > limit:
		return &cause{ErrOutOfMemory, fmt.Sprintf("%s: the container's memory limit (linux.resources.memory.limit) is %d bytes and the checkpoint holds %d bytes of memory pages; raise the limit to at least %d bytes",
			what, limit, need, need+restoreHeadroom)}
	case limit > 0 && need > 0:
		// CRIU runs in the container's cgroup while it restores (runc puts it there), so the
		// pages are not all it charges: measured on CRIU 4.2.1, a 64 MiB checkpoint failed under
		// its pages plus 2 MiB and restored under its pages plus 4 MiB
		return &cause{ErrOutOfMemory, fmt.Sprintf("%s: the container's memory limit (linux.resources.memory.limit) is %d bytes, not enough above the %d bytes of memory pages the checkpoint holds, since CRIU itself runs in the container's cgroup while it restores; raise the limit to at least %d bytes",
			what, limit, need, need+restoreHeadroom)}
	case limit > 0:
		return &cause{ErrOutOfMemory, fmt.Sprintf("%s: the container's memory limit (linux.resources.memory.limit) is %d bytes, likely below what the checkpoint holds; raise it to what the source container used", what, limit)}
	}
	return &cause{ErrOutOfMemory, what + ": the node or the container's cgroup ran out of memory; free memory or raise the limit to what the source container used"}
}

// dumpCause tells the cause of a failed CRIU dump from its error lines (logOK false: it wrote
// no log); nil when it is none berth knows.
func dumpCause(lines []string, logOK bool, configName string) *cause {
	if !logOK {
		return &cause{ErrCRIUOptions, fmt.Sprintf("CRIU wrote no log, so it refused its options: check criu_options in %s and the bundle's %s",
			configName, criuConfigName)}
	}
	for _, l := range lines {
		if criuLines().rlimitEPERM.MatchString(l) {
			return &cause{ErrMissingCapability, "CRIU cannot read the resource limits of the container's non-root processes because root on this node lacks CAP_SYS_RESOURCE (common in VMs and nested containers), so no non-root container can be checkpointed here: run containerd (and so the shim and CRIU) with CAP_SYS_RESOURCE, or run the container in a user namespace (Kubernetes: hostUsers: false; OCI: linux.uidMappings) so that its processes are root inside it"}
		}
	}
	return nil
}

// bindMountOf returns the bind mount of spec that file (a path in the container) lies on, the
// deepest one; nil when none.
func bindMountOf(file string, spec *specs.Spec) *specs.Mount {
	if spec == nil {
		return nil
	}
	var best *specs.Mount
	for i, m := range spec.Mounts {
		if !oci.IsBindMount(m) || m.Destination == "" {
			continue
		}
		d := filepath.Clean(m.Destination)
		if file == d || strings.HasPrefix(file, d+"/") {
			if best == nil || len(d) > len(filepath.Clean(best.Destination)) {
				best = &spec.Mounts[i]
			}
		}
	}
	return best
}

// explainRestore returns err, runc's error for the failed CRIU restore of task id, with its
// cause: the cause berth knows in one sentence with the fix (marked with its sentinel), CRIU's
// own error lines, and where CRIU's restore log is kept (keepRestoreLog), since containerd
// removes the task's work directory with the task.
func (s *Service) explainRestore(ctx context.Context, id string, t *restoredTask, err error) error {
	logPath := filepath.Join(t.criuWorkDir(), restoreLogFile)
	lines, logOK := criuLogErrors(logPath)
	facts := restoreFacts{configName: s.configName()}
	facts.spec, _ = readSpec(t.bundle)
	if t.plan != nil {
		facts.need = t.plan.manifest.MemoryBytes()
	}
	c := restoreCause(lines, logOK, facts)
	var b strings.Builder
	fmt.Fprintf(&b, "restore %s: ", id)
	if c != nil {
		b.WriteString(c.sentence)
		b.WriteString("; ")
	}
	if len(lines) > 0 {
		fmt.Fprintf(&b, "CRIU says: %s; ", lastLines(lines, maxQuotedCRIULines))
	}
	if logOK {
		if kept, kerr := s.keepRestoreLog(id, t, logPath); kerr != nil {
			log.G(ctx).WithError(kerr).Warn("CRIU's restore log not kept")
			fmt.Fprintf(&b, "CRIU's restore log: %s (removed with the task); ", logPath)
		} else {
			fmt.Fprintf(&b, "CRIU's restore log is kept at %s; ", kept)
		}
	}
	b.WriteString("runc: ")
	out := fmt.Errorf("%s%w", b.String(), err)
	if c != nil {
		out = mark(out, c.sentinel)
	}
	if t.plan != nil {
		out = t.plan.named(out)
	}
	return out
}

// keepRestoreLog copies CRIU's restore log at logPath (about to be removed with the task) to
// where an operator finds it, and returns that path: beside the checkpoint
// (CHECKPOINT.restore-ID.log) when the checkpoint lies in the checkpoint root, else
// RestoreLogsDir/ID.restore.log under the root. The copy is mode 0600.
func (s *Service) keepRestoreLog(id string, t *restoredTask, logPath string) (string, error) {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return "", err
	}
	dest := filepath.Join(s.cfg.CheckpointRoot, RestoreLogsDir, id+".restore.log")
	if t.plan != nil && t.plan.manifest != nil {
		if name := filepath.Clean(t.plan.name()); s.cfg.CheckpointRoot != "" && strings.HasPrefix(name, filepath.Clean(s.cfg.CheckpointRoot)+"/") {
			dest = name + ".restore-" + id + ".log"
		}
	}
	if err := os.MkdirAll(filepath.Dir(dest), 0o700); err != nil {
		return "", err
	}
	tmp := dest + ".tmp" + strconv.Itoa(os.Getpid())
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dest); err != nil {
		os.Remove(tmp)
		return "", err
	}
	return dest, nil
}

// explainDump returns err, runc's error for a failed CRIU dump whose log is in workDir, with
// the cause berth knows in one sentence with the fix (marked with its sentinel) and CRIU's own
// error lines.
func (s *Service) explainDump(err error, workDir string) error {
	lines, logOK := criuLogErrors(filepath.Join(workDir, checkpoint.DumpLogFile))
	c := dumpCause(lines, logOK, s.configName())
	var msg string
	if c != nil {
		msg += "; " + c.sentence
	}
	if len(lines) > 0 {
		msg += "; CRIU says: " + lastLines(lines, maxQuotedCRIULines)
	}
	if c == nil && strings.Contains(err.Error(), "read unixpacket") && strings.Contains(err.Error(), "EOF") {
		// runc lost its connection to CRIU: CRIU died (killed) while it dumped
		msg += "; CRIU died during the dump: while it copies the memory its parasite code runs inside the task, which may then be left stopped or broken (if the task no longer answers, restart it)"
	}
	out := fmt.Errorf("%w%s", err, msg)
	if c != nil {
		out = mark(out, c.sentinel)
	}
	return out
}

// criuWorkPath is the CRIU work directory r's runc options name; "" when none.
func criuWorkPath(r *taskAPI.CreateTaskRequest) string {
	if r.Options == nil || r.Options.GetValue() == nil {
		return ""
	}
	var o options.Options
	if err := typeurl.UnmarshalTo(r.Options, &o); err != nil {
		return ""
	}
	return o.CriuWorkPath
}
