package criu

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/berth-dev/berth/criu/internal/criutest"
	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/checkpoint-restore/go-criu/v7/stats"
	"google.golang.org/protobuf/proto"
)

// writeStatsFile writes a stats image (CRIU's framing: service magic, stats magic, payload
// size, payload) holding st into dir/name.
func writeStatsFile(t *testing.T, dir, name string, st *stats.StatsEntry) {
	t.Helper()
	payload, err := proto.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	for _, v := range []uint32{stats.ImgServiceMagic, stats.StatsMagic, uint32(len(payload))} {
		_ = binary.Write(&b, binary.LittleEndian, v)
	}
	b.Write(payload)
	if err := os.WriteFile(filepath.Join(dir, name), b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestReadDumpStatsMapping(t *testing.T) {
	dir := t.TempDir()
	writeStatsFile(t, dir, stats.StatsDump, &stats.StatsEntry{Dump: &stats.DumpStatsEntry{
		FreezingTime:       proto.Uint32(11),
		FrozenTime:         proto.Uint32(22),
		MemdumpTime:        proto.Uint32(33),
		MemwriteTime:       proto.Uint32(44),
		PagesScanned:       proto.Uint64(1000),
		PagesSkippedParent: proto.Uint64(5),
		PagesWritten:       proto.Uint64(900),
		PagesLazy:          proto.Uint64(7),
	}})
	got, err := ReadDumpStats(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := checkpoint.CRIUStats{FreezingTimeUs: 11, FrozenTimeUs: 22, MemdumpTimeUs: 33, MemwriteTimeUs: 44,
		PagesScanned: 1000, PagesSkippedParent: 5, PagesWritten: 900, PagesLazy: 7}
	if got != want {
		t.Errorf("ReadDumpStats = %+v, want %+v", got, want)
	}
}

func TestReadRestoreStatsMapping(t *testing.T) {
	dir := t.TempDir()
	writeStatsFile(t, dir, stats.StatsRestore, &stats.StatsEntry{Restore: &stats.RestoreStatsEntry{
		PagesCompared:   proto.Uint64(1),
		PagesSkippedCow: proto.Uint64(2),
		ForkingTime:     proto.Uint32(3),
		RestoreTime:     proto.Uint32(4),
		PagesRestored:   proto.Uint64(5),
	}})
	got, err := ReadRestoreStats(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := RestoreStats{ForkingTimeUs: 3, RestoreTimeUs: 4, PagesCompared: 1, PagesSkippedCow: 2, PagesRestored: 5}
	if got != want {
		t.Errorf("ReadRestoreStats = %+v, want %+v", got, want)
	}
}

func TestReadStatsErrors(t *testing.T) {
	// Missing file: fs.ErrNotExist, naming the path.
	dir := t.TempDir()
	_, err := ReadDumpStats(dir)
	if want := filepath.Join(dir, "stats-dump"); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), want) {
		t.Errorf("missing stats-dump: got %v, want fs.ErrNotExist naming %s", err, want)
	}
	_, err = ReadRestoreStats(dir)
	if want := filepath.Join(dir, "stats-restore"); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), want) {
		t.Errorf("missing stats-restore: got %v, want fs.ErrNotExist naming %s", err, want)
	}
	_, err = ReadDumpStats(filepath.Join(dir, "no-such-dir"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing dir: got %v", err)
	}

	header := func(m1, m2, size uint32) []byte {
		b := make([]byte, 12)
		binary.LittleEndian.PutUint32(b, m1)
		binary.LittleEndian.PutUint32(b[4:], m2)
		binary.LittleEndian.PutUint32(b[8:], size)
		return b
	}
	for name, content := range map[string][]byte{
		"empty":          {},
		"short":          {1, 2, 3},
		"bad magic":      header(1, stats.StatsMagic, 0),
		"bad stats":      header(stats.ImgServiceMagic, 2, 0),
		"size too large": append(header(stats.ImgServiceMagic, stats.StatsMagic, 100), 1, 2),
		"bad payload":    append(header(stats.ImgServiceMagic, stats.StatsMagic, 2), 0xff, 0xff),
		"no dump entry":  header(stats.ImgServiceMagic, stats.StatsMagic, 0),
	} {
		d := t.TempDir()
		file := filepath.Join(d, "stats-dump")
		if err := os.WriteFile(file, content, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := ReadDumpStats(d)
		if !errors.Is(err, ErrBadStats) || !strings.Contains(err.Error(), file) {
			t.Errorf("%s: got %v, want ErrBadStats naming %s", name, err, file)
		}
	}
}

// TestReadStatsReal dumps a real process with the real criu (root only), reads the stats-dump
// CRIU wrote, then restores it and reads stats-restore.
func TestReadStatsReal(t *testing.T) {
	criu := criuPath(t)
	if os.Geteuid() != 0 {
		skipOrFail(t, "criu dump needs root")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	sleep := exec.Command("sleep", "1000")
	sleep.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	pid := sleep.Process.Pid
	t.Cleanup(func() {
		_ = sleep.Process.Kill()
		_ = sleep.Wait()
	})

	dir := t.TempDir()
	dump := exec.CommandContext(ctx, criu, "dump", "-t", strconv.Itoa(pid), "-D", dir,
		"--shell-job", "-o", "dump.log", "--leave-running")
	if out, err := dump.CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "dump.log"))
		t.Fatalf("criu dump: %v\n%s\ndump.log tail:\n%s", err, out, tail(log, 2000))
	}
	st, err := ReadDumpStats(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("dump stats: %+v", st)
	if st.PagesWritten == 0 || st.PagesScanned < st.PagesWritten || st.FrozenTimeUs == 0 || st.MemdumpTimeUs == 0 {
		t.Errorf("implausible dump stats %+v", st)
	}

	// Restore the same tree: the original must be gone so its pid is free.
	_ = sleep.Process.Kill()
	_ = sleep.Wait()
	restore := exec.CommandContext(ctx, criu, "restore", "-D", dir, "--shell-job", "-d", "-o", "restore.log")
	if out, err := restore.CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "restore.log"))
		t.Fatalf("criu restore: %v\n%s\nrestore.log tail:\n%s", err, out, tail(log, 2000))
	}
	defer func() { _ = syscall.Kill(pid, syscall.SIGKILL) }()
	if err := syscall.Kill(pid, 0); err != nil {
		t.Errorf("restored pid %d not running: %v", pid, err)
	}
	rst, err := ReadRestoreStats(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("restore stats: %+v", rst)
	if rst.RestoreTimeUs == 0 {
		t.Errorf("implausible restore stats %+v", rst)
	}
}

// tail is criutest.Tail.
func tail(b []byte, n int) string { return criutest.Tail(b, n) }
