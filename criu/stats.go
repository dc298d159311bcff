package criu

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"

	"github.com/berth-dev/berth/oci/checkpoint"
	"github.com/checkpoint-restore/go-criu/v7/stats"
)

// RestoreStats are CRIU's restore statistics, from the stats-restore file CRIU writes into the
// images directory (RestoreStatsEntry in CRIU's stats.proto). Times are in microseconds, as CRIU
// records them; pages are counts of pages (of the page size of the machine).
type RestoreStats struct {
	// ForkingTimeUs is the time CRIU spent recreating the process tree (forking_time).
	ForkingTimeUs uint32 `json:"forkingTimeUs"`
	// RestoreTimeUs is the whole restore, from start to resuming the tasks (restore_time).
	RestoreTimeUs uint32 `json:"restoreTimeUs"`
	// PagesCompared and PagesSkippedCow count pages compared with, and left shared with, the
	// parent during COW-aware restore (pages_compared, pages_skipped_cow).
	PagesCompared   uint64 `json:"pagesCompared"`
	PagesSkippedCow uint64 `json:"pagesSkippedCow"`
	// PagesRestored counts pages read back from the images (pages_restored; 0 when the CRIU
	// that wrote the file does not record it).
	PagesRestored uint64 `json:"pagesRestored"`
}

// ReadDumpStats reads the stats-dump file CRIU writes into images directory dir at the end of a
// dump (go-criu's stats.CriuGetDumpStats) and returns it as the manifest's checkpoint.CRIUStats: the
// freezing_time, frozen_time, memdump_time and memwrite_time fields (microseconds) and the
// pages_scanned, pages_skipped_parent, pages_written and pages_lazy counts.
//
// Errors: a missing file gives an error naming its path and matching fs.ErrNotExist (CRIU writes
// the file only when a dump gets far enough); a file that is not a stats image, or holds no dump
// entry, gives an error naming its path and wrapping ErrBadStats.
func ReadDumpStats(dir string) (checkpoint.CRIUStats, error) {
	file := filepath.Join(dir, stats.StatsDump)
	if err := checkStatsFile(file); err != nil {
		return checkpoint.CRIUStats{}, fmt.Errorf("criu: dump statistics: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return checkpoint.CRIUStats{}, fmt.Errorf("criu: dump statistics: %w", err)
	}
	defer d.Close()
	st, err := stats.CriuGetDumpStats(d)
	if err != nil {
		return checkpoint.CRIUStats{}, fmt.Errorf("criu: dump statistics %s: %w: %w", file, ErrBadStats, err)
	}
	if st == nil {
		return checkpoint.CRIUStats{}, fmt.Errorf("criu: dump statistics %s: %w: no dump entry", file, ErrBadStats)
	}
	return checkpoint.CRIUStats{
		FreezingTimeUs:     st.GetFreezingTime(),
		FrozenTimeUs:       st.GetFrozenTime(),
		MemdumpTimeUs:      st.GetMemdumpTime(),
		MemwriteTimeUs:     st.GetMemwriteTime(),
		PagesScanned:       st.GetPagesScanned(),
		PagesSkippedParent: st.GetPagesSkippedParent(),
		PagesWritten:       st.GetPagesWritten(),
		PagesLazy:          st.GetPagesLazy(),
	}, nil
}

// ReadRestoreStats reads the stats-restore file CRIU writes into images directory dir at the end
// of a restore (go-criu's stats.CriuGetRestoreStats). Errors are those of ReadDumpStats, for
// stats-restore.
func ReadRestoreStats(dir string) (RestoreStats, error) {
	file := filepath.Join(dir, stats.StatsRestore)
	if err := checkStatsFile(file); err != nil {
		return RestoreStats{}, fmt.Errorf("criu: restore statistics: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return RestoreStats{}, fmt.Errorf("criu: restore statistics: %w", err)
	}
	defer d.Close()
	st, err := stats.CriuGetRestoreStats(d)
	if err != nil {
		return RestoreStats{}, fmt.Errorf("criu: restore statistics %s: %w: %w", file, ErrBadStats, err)
	}
	if st == nil {
		return RestoreStats{}, fmt.Errorf("criu: restore statistics %s: %w: no restore entry", file, ErrBadStats)
	}
	return RestoreStats{
		ForkingTimeUs:   st.GetForkingTime(),
		RestoreTimeUs:   st.GetRestoreTime(),
		PagesCompared:   st.GetPagesCompared(),
		PagesSkippedCow: st.GetPagesSkippedCow(),
		PagesRestored:   st.GetPagesRestored(),
	}, nil
}

// checkStatsFile validates a stats image's framing (two magics, a payload size that fits)
// before go-criu parses it: go-criu indexes the file without bounds checks and panics on a short
// one. Errors name the path; a missing file matches fs.ErrNotExist, a bad one ErrBadStats.
func checkStatsFile(file string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	if len(b) < stats.PayloadOffset {
		return fmt.Errorf("%s: %w: %d bytes, shorter than the header", file, ErrBadStats, len(b))
	}
	if m := binary.LittleEndian.Uint32(b[stats.PrimaryMagicOffset:]); m != stats.ImgServiceMagic {
		return fmt.Errorf("%s: %w: magic %#x, want %#x", file, ErrBadStats, m, uint32(stats.ImgServiceMagic))
	}
	if m := binary.LittleEndian.Uint32(b[stats.SecondaryMagicOffset:]); m != stats.StatsMagic {
		return fmt.Errorf("%s: %w: stats magic %#x, want %#x", file, ErrBadStats, m, uint32(stats.StatsMagic))
	}
	if size := binary.LittleEndian.Uint32(b[stats.SizeOffset:]); uint64(size) > uint64(len(b)-stats.PayloadOffset) {
		return fmt.Errorf("%s: %w: payload of %d bytes, file holds %d", file, ErrBadStats, size, len(b)-stats.PayloadOffset)
	}
	return nil
}
