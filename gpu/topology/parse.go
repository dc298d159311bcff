package topology

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Header names of the affinity columns, located by name rather than position.
const (
	colCPU     = "CPU Affinity"
	colNUMA    = "NUMA Affinity"
	colGPUNUMA = "GPU NUMA ID"
)

// maxLine bounds one input line (bytes); nvidia-smi lines are a few hundred bytes.
const maxLine = 1 << 20

// ParseError is the error Parse returns for input it rejects. It says where: the 1-based line
// number, the row label ("GPU3") and the column name ("GPU1", "CPU Affinity") where known, and
// the offending cell's text. Err is one of this package's sentinel errors (so errors.Is works
// through a *ParseError) wrapped with the reason.
type ParseError struct {
	Line   int    // 1-based line number; 0 when the error is about the input as a whole
	Row    string // row label, "" if none
	Column string // column name, "" if none
	Value  string // the offending cell or line, "" if none
	Err    error
}

// Error names where the parse failed (line, row, column, the value cut to 40 bytes) and why.
func (e *ParseError) Error() string {
	var b strings.Builder
	b.WriteString("parse nvidia-smi topology")
	if e.Line > 0 {
		fmt.Fprintf(&b, ": line %d", e.Line)
	}
	if e.Row != "" {
		fmt.Fprintf(&b, ": row %s", e.Row)
	}
	if e.Column != "" {
		fmt.Fprintf(&b, ", column %q", e.Column)
	}
	if e.Value != "" {
		v := e.Value
		if len(v) > 40 { // a binary or garbled file: name the start, not kilobytes of it
			v = v[:40] + "..."
		}
		fmt.Fprintf(&b, ", value %q", v)
	}
	b.WriteString(": ")
	b.WriteString(e.Err.Error())
	return b.String()
}

// Unwrap returns the cause (ErrMalformed and the like), for errors.Is.
func (e *ParseError) Unwrap() error { return e.Err }

// Parse reads the text that `nvidia-smi topo -m` prints and returns the GPU topology it
// describes.
//
// Accepted input: lines separated by "\n" or "\r\n"; blank lines and lines starting with "#"
// are skipped; ANSI escape sequences (the underline nvidia-smi puts on a terminal) are removed.
// The first other line is the header: cells separated by tabs, the first one empty (the row
// label column; a header that starts directly with "GPU0" is accepted too), then GPU columns
// "GPU0".."GPU<n-1>" in order, other device columns ("NIC0", "mlx5_0", ...), and the columns
// "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID", each optional and found by name. Every
// following line is a row whose first cell is a header column's name: GPU rows are read, other
// device rows (NICs) are ignored. A line starting with "Legend" ends the matrix; the rest of the
// input is ignored. Cells are trimmed of spaces (" X ").
//
// A GPU row must have exactly as many cells as the header, except for the empty cell nvidia-smi
// prints before "GPU NUMA ID" (two tabs), which is dropped; empty cells after the last column are
// dropped too. Link cells are parsed with ParseLink; the diagonal must be "X" and nowhere else;
// the matrix must be symmetric. "CPU Affinity" and "NUMA Affinity" are id lists (ParseIDList) or
// "N/A"; "GPU NUMA ID" is a NUMA node id or "N/A" (-1). An empty affinity cell means unknown.
//
// Errors are *ParseError wrapping ErrEmpty (nothing to parse), ErrTruncated (a short GPU row or
// a GPU without a row), ErrAsymmetric, or ErrMalformed (anything else), or the reader's error
// wrapped. Parse never returns a partial topology.
func Parse(r io.Reader) (*Topology, error) {
	p := parser{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), maxLine)
	lineNo := 0
	for sc.Scan() {
		lineNo++
		if err := p.line(lineNo, stripANSI(sc.Text())); err != nil {
			return nil, err
		}
		if p.done {
			break
		}
	}
	if err := sc.Err(); err != nil {
		return nil, &ParseError{Line: lineNo + 1, Err: fmt.Errorf("read topology: %w", err)}
	}
	return p.finish()
}

type parser struct {
	header     []string // trimmed header cells; header[0] is the row label column ("")
	headerLine int
	gpuCols    int // GPU columns are header[1 : 1+gpuCols]
	cpuCol     int // index in header, -1 if absent
	numaCol    int
	gpuNUMACol int
	rows       []gpuRow // by GPU index; line == 0 means not seen yet
	done       bool
}

type gpuRow struct {
	line  int
	cells []string // len(header), trimmed
}

func (p *parser) line(n int, text string) error {
	text = strings.TrimSuffix(text, "\r")
	trimmed := strings.TrimSpace(text)
	if trimmed == "" || strings.HasPrefix(trimmed, "#") {
		return nil
	}
	if p.header == nil {
		return p.parseHeader(n, text)
	}
	if strings.HasPrefix(trimmed, "Legend") {
		p.done = true
		return nil
	}
	cells := splitCells(text)
	label := cells[0]
	col := p.column(label)
	switch {
	case col < 0:
		return &ParseError{Line: n, Row: label, Value: trimmed,
			Err: fmt.Errorf("%w: row label %q is not a column of the header (line %d)", ErrMalformed, label, p.headerLine)}
	case col > p.gpuCols:
		return nil // a NIC or other device row: not part of the GPU model
	}
	gpu := col - 1
	if prev := p.rows[gpu].line; prev != 0 {
		return &ParseError{Line: n, Row: label,
			Err: fmt.Errorf("%w: duplicate row %s (first on line %d)", ErrMalformed, label, prev)}
	}
	// nvidia-smi prints an empty cell before "GPU NUMA ID" in rows but not in the header.
	if p.gpuNUMACol > 0 && len(cells) == len(p.header)+1 && cells[p.gpuNUMACol] == "" {
		cells = append(cells[:p.gpuNUMACol], cells[p.gpuNUMACol+1:]...)
	}
	for len(cells) > len(p.header) && cells[len(cells)-1] == "" {
		cells = cells[:len(cells)-1]
	}
	if len(cells) < len(p.header) {
		return &ParseError{Line: n, Row: label, Column: p.header[len(cells)],
			Err: fmt.Errorf("%w: row has %d cells, header (line %d) has %d; the first missing one is %q",
				ErrTruncated, len(cells), p.headerLine, len(p.header), p.header[len(cells)])}
	}
	if len(cells) > len(p.header) {
		return &ParseError{Line: n, Row: label, Value: cells[len(p.header)],
			Err: fmt.Errorf("%w: row has %d cells, header (line %d) has %d", ErrMalformed, len(cells), p.headerLine, len(p.header))}
	}
	p.rows[gpu] = gpuRow{line: n, cells: cells}
	return nil
}

func (p *parser) parseHeader(n int, text string) error {
	cells := splitCells(text)
	if cells[0] != "" {
		// The leading tab was lost (e.g. pasted): the label column is implied.
		cells = append([]string{""}, cells...)
	}
	p.cpuCol, p.numaCol, p.gpuNUMACol = -1, -1, -1
	seen := map[string]int{}
	for j, name := range cells[1:] {
		j++
		if name == "" {
			return &ParseError{Line: n, Err: fmt.Errorf("%w: header: empty column name in column %d", ErrMalformed, j+1)}
		}
		if prev, ok := seen[name]; ok {
			return &ParseError{Line: n, Column: name,
				Err: fmt.Errorf("%w: header: column %q appears twice (columns %d and %d)", ErrMalformed, name, prev+1, j+1)}
		}
		seen[name] = j
		if idx, ok := gpuLabel(name); ok {
			if j != p.gpuCols+1 || idx != p.gpuCols {
				return &ParseError{Line: n, Column: name,
					Err: fmt.Errorf("%w: header: GPU columns must come first as GPU0, GPU1, ... in order; column %d is %q, want %q",
						ErrMalformed, j+1, name, "GPU"+strconv.Itoa(p.gpuCols))}
			}
			p.gpuCols++
			continue
		}
		switch name {
		case colCPU:
			p.cpuCol = j
		case colNUMA:
			p.numaCol = j
		case colGPUNUMA:
			p.gpuNUMACol = j
		}
	}
	if p.gpuCols == 0 {
		return &ParseError{Line: n, Value: strings.TrimSpace(text),
			Err: fmt.Errorf("%w: header has no GPU columns (want tab-separated GPU0, GPU1, ...)", ErrMalformed)}
	}
	p.header, p.headerLine = cells, n
	p.rows = make([]gpuRow, p.gpuCols)
	return nil
}

// column returns the header index of the column named name, or -1.
func (p *parser) column(name string) int {
	if name == "" {
		return -1
	}
	for j := 1; j < len(p.header); j++ {
		if p.header[j] == name {
			return j
		}
	}
	return -1
}

func (p *parser) finish() (*Topology, error) {
	if p.header == nil {
		return nil, &ParseError{Err: ErrEmpty}
	}
	n := p.gpuCols
	t := &Topology{GPUs: make([]GPU, n), Links: make([][]Link, n)}
	for i, row := range p.rows {
		label := p.header[i+1]
		if row.line == 0 {
			return nil, &ParseError{Row: label,
				Err: fmt.Errorf("%w: no row for %s, which the header (line %d) lists", ErrTruncated, label, p.headerLine)}
		}
		t.Links[i] = make([]Link, n)
		for j := range n {
			cell := row.cells[j+1]
			l, err := ParseLink(cell)
			if err != nil {
				return nil, &ParseError{Line: row.line, Row: label, Column: p.header[j+1], Value: cell, Err: err}
			}
			if (i == j) != (l == Self) {
				what := "diagonal must be X"
				if i != j {
					what = "X is only valid on the diagonal"
				}
				return nil, &ParseError{Line: row.line, Row: label, Column: p.header[j+1], Value: cell,
					Err: fmt.Errorf("%w: %s", ErrMalformed, what)}
			}
			t.Links[i][j] = l
		}
		g := GPU{Index: i, GPUNUMA: -1}
		var err error
		if g.CPUs, err = p.optionalList(row, label, p.cpuCol); err != nil {
			return nil, err
		}
		if g.NUMA, err = p.optionalList(row, label, p.numaCol); err != nil {
			return nil, err
		}
		if c := p.gpuNUMACol; c > 0 {
			if v := row.cells[c]; v != "" && v != "N/A" {
				if !isDigits(v) {
					return nil, &ParseError{Line: row.line, Row: label, Column: colGPUNUMA, Value: v,
						Err: fmt.Errorf("%w: want a NUMA node id or N/A", ErrMalformed)}
				}
				id, err := parseID(v)
				if err != nil {
					return nil, &ParseError{Line: row.line, Row: label, Column: colGPUNUMA, Value: v,
						Err: fmt.Errorf("%w: %w", ErrMalformed, err)}
				}
				g.GPUNUMA = id
			}
		}
		t.GPUs[i] = g
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			if a, b := t.Links[i][j], t.Links[j][i]; a != b {
				return nil, &ParseError{Line: p.rows[j].line, Row: p.header[j+1], Column: p.header[i+1], Value: b.String(),
					Err: fmt.Errorf("%w: row %s column %s (line %d) is %s, but row %s column %s (line %d) is %s",
						ErrAsymmetric, p.header[i+1], p.header[j+1], p.rows[i].line, a,
						p.header[j+1], p.header[i+1], p.rows[j].line, b)}
			}
		}
	}
	if err := t.Validate(); err != nil { // cannot fail after the checks above; kept as a guard
		return nil, &ParseError{Err: err}
	}
	return t, nil
}

func (p *parser) optionalList(row gpuRow, label string, col int) ([]int, error) {
	if col <= 0 {
		return nil, nil
	}
	v := row.cells[col]
	if v == "" || v == "N/A" {
		return nil, nil
	}
	ids, err := ParseIDList(v)
	if err != nil {
		return nil, &ParseError{Line: row.line, Row: label, Column: p.header[col], Value: v, Err: err}
	}
	return ids, nil
}

// gpuLabel reports whether s is "GPU<index>" and returns the index.
func gpuLabel(s string) (int, bool) {
	rest, ok := strings.CutPrefix(s, "GPU")
	if !ok || !isDigits(rest) || (len(rest) > 1 && rest[0] == '0') || len(rest) > 6 {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil
}

func splitCells(line string) []string {
	cells := strings.Split(line, "\t")
	for i, c := range cells {
		cells[i] = strings.TrimSpace(c)
	}
	return cells
}

// stripANSI removes ANSI CSI escape sequences ("\x1b[4m") from s.
func stripANSI(s string) string {
	if !strings.Contains(s, "\x1b") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == 0x1b && i+1 < len(s) && s[i+1] == '[' {
			j := i + 2
			for j < len(s) && (s[j] < 0x40 || s[j] > 0x7e) {
				j++
			}
			i = j // skip the final byte too
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

var _ error = (*ParseError)(nil)
