package e2e

import (
	"fmt"
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// plotStream draws BenchmarkStream's downtime against memory size, one line per path, into path
// (the extension picks the format: .png, .svg, .pdf).
func plotStream(rows []streamRow, path string) error {
	p := plot.New()
	p.Title.Text = "Downtime seen by the workload's client"
	p.X.Label.Text = "workload memory (MiB)"
	p.Y.Label.Text = "downtime (s)"
	p.Legend.Top, p.Legend.Left = true, true
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
	}
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
		l, s, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		l.Color, s.Color = ph.c, ph.c
		p.Add(l, s)
		p.Legend.Add(ph.name, l, s)
	}
	if err := p.Save(6*vg.Inch, 4*vg.Inch, path); err != nil {
		return fmt.Errorf("plot %s: %w", path, err)
	}
	return nil
}
