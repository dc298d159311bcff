package e2e

import (
	"errors"
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"testing"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// plotStream draws BenchmarkStream's downtime against memory size, one line per path (a point
// for a path measured at one size), on a logarithmic downtime axis, into path (the extension
// picks the format: .png, .svg, .pdf). Paths with no figure (0: not run or failed) are left out.
// A single figure (one path at one size) gets a downtime axis from half of it to twice it. A
// panic of the plotting library is returned as an error: it must not end the benchmark's
// process before it stopped its nodes.
func plotStream(rows []streamRow, path string) (retErr error) {
	defer func() {
		if r := recover(); r != nil {
			retErr = fmt.Errorf("plot %s: %v", path, r)
		}
	}()
	p := plot.New()
	p.Title.Text = "Downtime seen by the workload's client"
	p.X.Label.Text = "workload memory (MiB)"
	p.Y.Label.Text = "downtime (s)"
	p.Legend.Top, p.Legend.Left = true, true
	// log scale: the paths span two orders of magnitude (lazy mode's tenths of a second, the ctr
	// path's tens of seconds)
	p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	paths := []struct {
		name string
		get  func(streamRow) float64
		c    color.RGBA
	}{
		{"raw CRIU dump+restore (A)", func(r streamRow) float64 { return r.raw.Seconds() }, color.RGBA{R: 90, G: 90, B: 90, A: 255}},
		{"CRIU page server (B)", func(r streamRow) float64 { return r.ps.Seconds() }, color.RGBA{R: 150, G: 150, B: 220, A: 255}},
		{"raw CRIU post-copy (C)", func(r streamRow) float64 { return r.postcopy.Seconds() }, color.RGBA{R: 200, G: 170, B: 220, A: 255}},
		{"berth stored", func(r streamRow) float64 { return r.stored.Seconds() }, color.RGBA{R: 220, G: 120, B: 40, A: 255}},
		{"berth copy", func(r streamRow) float64 { return r.copy.Seconds() }, color.RGBA{R: 30, G: 140, B: 60, A: 255}},
		{"berth lazy (post-copy)", func(r streamRow) float64 { return r.lazy.Seconds() }, color.RGBA{R: 160, G: 40, B: 160, A: 255}},
		{"ctr checkpoint/export/import/restore (runc)", func(r streamRow) float64 { return r.ctr.Seconds() }, color.RGBA{R: 200, G: 30, B: 30, A: 255}},
	}
	drawn := 0
	for _, ph := range paths {
		pts := make(plotter.XYs, 0, len(rows))
		for _, r := range rows {
			if v := ph.get(r); v > 0 {
				pts = append(pts, plotter.XY{X: float64(r.mib), Y: v})
			}
		}
		if len(pts) == 0 {
			continue
		}
		drawn++
		if len(pts) == 1 { // measured at one size (the ctr path by default): a point, no line
			s, err := plotter.NewScatter(pts)
			if err != nil {
				return err
			}
			s.Color, s.Shape, s.Radius = ph.c, draw.BoxGlyph{}, vg.Points(4)
			p.Add(s)
			p.Legend.Add(ph.name, s)
			continue
		}
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		l.Color, s.Color = ph.c, ph.c
		p.Add(l, s)
		p.Legend.Add(ph.name, l, s)
	}
	if drawn == 0 {
		return errors.New("no path has a figure")
	}
	if p.Y.Min == p.Y.Max { // one figure: gonum would widen the range by 1 s, below 0 on a log axis
		p.Y.Min, p.Y.Max = p.Y.Min/2, p.Y.Max*2
	}
	if err := p.Save(6*vg.Inch, 4*vg.Inch, path); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return nil
}

// TestPlotStreamOnePoint: a benchmark run of one path at one size (BERTH_BENCH_MIB=1024 and
// -bench 'BenchmarkStream/1024MiB/^lazy$') still gets its plot; gonum's log axis panicked on
// it and took the benchmark's process down before it stopped its nodes.
func TestPlotStreamOnePoint(t *testing.T) {
	for _, rows := range [][]streamRow{
		{{mib: 1024, lazy: 933 * time.Millisecond}},
		{{mib: 1024, lazy: 933 * time.Millisecond}, {mib: 4096, lazy: 933 * time.Millisecond}},
		{{mib: 256, raw: 400 * time.Millisecond, lazy: 800 * time.Millisecond}, {mib: 1024, ctr: 26 * time.Second}},
	} {
		out := filepath.Join(t.TempDir(), "p.png")
		if err := plotStream(rows, out); err != nil {
			t.Fatalf("plotStream(%v): %v", rows, err)
		}
		if fi, err := os.Stat(out); err != nil || fi.Size() == 0 {
			t.Fatalf("no plot written: %v", err)
		}
	}
	if err := plotStream([]streamRow{{mib: 1024}}, filepath.Join(t.TempDir(), "p.png")); err == nil {
		t.Fatal("plotStream drew a plot of no figure")
	}
}
