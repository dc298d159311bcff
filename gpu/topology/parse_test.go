package topology

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// fixturesDir is the corpus of real `nvidia-smi topo -m` outputs (its README names each source).
// Tests in nri/ read it too.
const fixturesDir = "testdata/topologies"

func mustParse(t *testing.T, path string) *Topology {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	top, err := Parse(f)
	if err != nil {
		t.Fatalf("Parse(%s): %v", path, err)
	}
	return top
}

// TestParseFixtures parses every real fixture. Files that are not `nvidia-smi topo -m` tables
// (.txt descriptions) and truncated ones (PARTIAL in the name) must fail with a clear error;
// every other .tsv must parse and round-trip through String.
func TestParseFixtures(t *testing.T) {
	entries, err := os.ReadDir(fixturesDir)
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		gpus    int
		links   map[[2]int]Link
		cpus0   string // FormatIDList of GPU0's CPUs, "N/A" if nil
		numa    []int  // NUMA of the last GPU; nil = unknown
		gpuNUMA int    // GPUNUMA of GPU0
	}
	known := map[string]want{
		"01-dgx1-v100.tsv": {gpus: 8, cpus0: "0-19,40-59", gpuNUMA: -1,
			links: map[[2]int]Link{{0, 1}: NV(1), {0, 3}: NV(2), {0, 4}: NV(2), {0, 5}: SYS, {3, 7}: NV(1), {6, 6}: Self}},
		"02-8gpu-nvlink-bridge-pairs.tsv": {gpus: 8, cpus0: "0-31", numa: []int{1}, gpuNUMA: -1,
			links: map[[2]int]Link{{0, 2}: NV(12), {0, 1}: SYS, {1, 3}: NV(12), {6, 7}: NV(12)}},
		"05-dgx-h100.tsv": {gpus: 8, cpus0: "0-55,112-167", numa: []int{1}, gpuNUMA: -1,
			links: map[[2]int]Link{{0, 7}: NV(18), {3, 4}: NV(18)}},
		"07-4xl40s-pcie.tsv": {gpus: 4, cpus0: "0-95,192-287", numa: []int{1}, gpuNUMA: -1,
			links: map[[2]int]Link{{0, 1}: NODE, {1, 2}: SYS, {2, 3}: NODE}},
		"08-8x4090-all-sys.tsv": {gpus: 8, cpus0: "0-55,112-167", numa: []int{1}, gpuNUMA: -1,
			links: map[[2]int]Link{{0, 1}: SYS, {6, 7}: SYS}},
	}
	seen := map[string]bool{}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || name == "README.md" {
			continue
		}
		seen[name] = true
		t.Run(name, func(t *testing.T) {
			f, err := os.Open(filepath.Join(fixturesDir, name))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			top, err := Parse(f)
			if strings.Contains(name, "PARTIAL") || !strings.HasSuffix(name, ".tsv") {
				if err == nil {
					t.Fatalf("Parse succeeded on %s, want an error", name)
				}
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("error %v does not wrap ErrMalformed", err)
				}
				t.Logf("error, as wanted: %v", err)
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if err := top.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			again, err := Parse(strings.NewReader(top.String()))
			if err != nil {
				t.Fatalf("Parse(String()): %v\n%s", err, top)
			}
			if !reflect.DeepEqual(top, again) {
				t.Fatalf("round trip differs:\n%s\n%s", top, again)
			}
			w, ok := known[name]
			if !ok {
				return // a new fixture: parsing and round-tripping is all we know to check
			}
			if len(top.GPUs) != w.gpus {
				t.Fatalf("%d GPUs, want %d", len(top.GPUs), w.gpus)
			}
			for ij, l := range w.links {
				if got := top.Link(ij[0], ij[1]); got != l {
					t.Errorf("Link(%d,%d) = %s, want %s", ij[0], ij[1], got, l)
				}
			}
			if got := formatOptionalList(top.GPUs[0].CPUs); got != w.cpus0 {
				t.Errorf("GPU0 CPUs = %s, want %s", got, w.cpus0)
			}
			if got := top.GPUs[w.gpus-1].NUMA; !reflect.DeepEqual(got, w.numa) {
				t.Errorf("GPU%d NUMA = %v, want %v", w.gpus-1, got, w.numa)
			}
			if got := top.GPUs[0].GPUNUMA; got != w.gpuNUMA {
				t.Errorf("GPU0 GPUNUMA = %d, want %d", got, w.gpuNUMA)
			}
		})
	}
	for name := range known {
		if !seen[name] {
			t.Errorf("fixture %s is missing from %s", name, fixturesDir)
		}
	}
}

// TestParsePartialFixture pins down what the truncated GB200 tray gives: ErrTruncated naming
// the line and the row.
func TestParsePartialFixture(t *testing.T) {
	f, err := os.Open(filepath.Join(fixturesDir, "10-gb200-tray-PARTIAL.tsv"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, err = Parse(f)
	var pe *ParseError
	if !errors.As(err, &pe) || !errors.Is(err, ErrTruncated) {
		t.Fatalf("err = %v, want a *ParseError wrapping ErrTruncated", err)
	}
	if pe.Line != 7 || pe.Row != "GPU3" {
		t.Fatalf("error at line %d row %q, want line 7 row GPU3: %v", pe.Line, pe.Row, err)
	}
}

func TestParseTestdata(t *testing.T) {
	top := mustParse(t, "testdata/one-socket-pcie-switches.tsv")
	want := &Topology{
		GPUs: []GPU{
			{Index: 0, CPUs: cpuRange(0, 15, 32, 47), NUMA: []int{0}, GPUNUMA: -1},
			{Index: 1, CPUs: cpuRange(0, 15, 32, 47), NUMA: []int{0}, GPUNUMA: -1},
			{Index: 2, CPUs: cpuRange(0, 15, 32, 47), NUMA: []int{0}, GPUNUMA: -1},
			{Index: 3, CPUs: cpuRange(0, 15, 32, 47), NUMA: []int{0}, GPUNUMA: -1},
		},
		Links: [][]Link{
			{Self, PIX, PXB, PXB},
			{PIX, Self, PXB, PXB},
			{PXB, PXB, Self, PIX},
			{PXB, PXB, PIX, Self},
		},
	}
	if !reflect.DeepEqual(top, want) {
		t.Fatalf("got\n%s\nwant\n%s", top, want)
	}

	top = mustParse(t, "testdata/two-socket-interleaved.tsv")
	want = &Topology{
		GPUs: []GPU{
			{Index: 0, CPUs: []int{0, 2, 4, 6}, NUMA: []int{0}, GPUNUMA: -1},
			{Index: 1, CPUs: []int{8, 10, 12, 14}, NUMA: []int{1}, GPUNUMA: -1},
			{Index: 2, CPUs: []int{1, 3, 5, 7}, NUMA: []int{0, 1}, GPUNUMA: -1},
			{Index: 3, CPUs: cpuRange(16, 23), NUMA: nil, GPUNUMA: -1},
		},
		Links: [][]Link{
			{Self, NV(4), NODE, SYS},
			{NV(4), Self, NODE, SYS},
			{NODE, NODE, Self, SYS},
			{SYS, SYS, SYS, Self},
		},
	}
	if !reflect.DeepEqual(top, want) {
		t.Fatalf("got\n%s\nwant\n%s", top, want)
	}
}

func cpuRange(bounds ...int) []int {
	var ids []int
	for i := 0; i < len(bounds); i += 2 {
		for c := bounds[i]; c <= bounds[i+1]; c++ {
			ids = append(ids, c)
		}
	}
	return ids
}

// good is a small valid table; the bad inputs below are edits of it.
const good = "\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n" +
	"GPU0\t X \tNV2\tSYS\tPIX\t0-3\t0\t\tN/A\n" +
	"GPU1\tNV2\t X \tSYS\tPIX\t0-3\t0\t\tN/A\n" +
	"GPU2\tSYS\tSYS\t X \tSYS\t4-7\t1\t\t5\n" +
	"NIC0\tPIX\tPIX\tSYS\t X \n"

func TestParseInputs(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		wantErr error  // nil: must parse
		line    int    // ParseError.Line, checked when wantErr != nil
		inMsg   string // substring of the error message
		check   func(t *testing.T, top *Topology)
	}{
		{name: "good", in: good, check: func(t *testing.T, top *Topology) {
			if top.Link(0, 1) != NV(2) || top.Link(2, 0) != SYS || top.GPUs[2].GPUNUMA != 5 || top.GPUs[0].GPUNUMA != -1 {
				t.Fatalf("wrong model:\n%s", top)
			}
		}},
		{name: "header without leading tab, no affinity columns, SOC alias", in: "GPU0\tGPU1\nGPU0\tX\tSOC\nGPU1\tSOC\tX\n",
			check: func(t *testing.T, top *Topology) {
				if top.Link(0, 1) != SYS || top.GPUs[0].CPUs != nil || top.GPUs[1].NUMA != nil {
					t.Fatalf("wrong model:\n%s", top)
				}
			}},
		{name: "ANSI underline in header, rows in any order, trailing tab", in: "\x1b[4m\tGPU0\tGPU1\tCPU Affinity\x1b[0m\nGPU1\tNV1\t X \t2\t\nGPU0\t X \tNV1\t1\n",
			check: func(t *testing.T, top *Topology) {
				if top.Link(1, 0) != NV(1) || !reflect.DeepEqual(top.GPUs[1].CPUs, []int{2}) {
					t.Fatalf("wrong model:\n%s", top)
				}
			}},
		{name: "single GPU", in: "\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tN/A\tN/A\n",
			check: func(t *testing.T, top *Topology) {
				if len(top.GPUs) != 1 || top.GPUs[0].CPUs != nil {
					t.Fatalf("wrong model:\n%s", top)
				}
			}},

		{name: "empty input", in: "", wantErr: ErrEmpty},
		{name: "only comments and blanks", in: "# nothing\n\n   \n", wantErr: ErrEmpty},
		{name: "no GPU columns", in: "root0: GPU0-3 bus 04 (NUMA 0)\n", wantErr: ErrMalformed, line: 1, inMsg: "no GPU columns"},
		{name: "GPU columns out of order", in: "\tGPU1\tGPU0\n", wantErr: ErrMalformed, line: 1, inMsg: `want "GPU0"`},
		{name: "duplicate header column", in: "\tGPU0\tNIC0\tNIC0\n", wantErr: ErrMalformed, line: 1, inMsg: "appears twice"},
		{name: "truncated row", in: strings.Replace(good, "SYS\tPIX\t0-3\t0\t\tN/A\nGPU1", "SYS\nGPU1", 1),
			wantErr: ErrTruncated, line: 2, inMsg: `first missing one is "NIC0"`},
		{name: "missing GPU row", in: strings.Replace(good, "GPU2\tSYS\tSYS\t X \tSYS\t4-7\t1\t\t5\n", "", 1),
			wantErr: ErrTruncated, inMsg: "no row for GPU2"},
		{name: "too many cells", in: strings.Replace(good, "4-7\t1\t\t5", "4-7\t1\t\t5\textra", 1),
			wantErr: ErrMalformed, line: 4, inMsg: "header (line 1) has 8"},
		{name: "asymmetric", in: strings.Replace(good, "GPU1\tNV2", "GPU1\tNV1", 1),
			wantErr: ErrAsymmetric, line: 3, inMsg: "row GPU0 column GPU1 (line 2) is NV2, but row GPU1 column GPU0 (line 3) is NV1"},
		{name: "unknown link code", in: strings.Replace(good, "GPU2\tSYS", "GPU2\tQPI", 1),
			wantErr: ErrMalformed, line: 4, inMsg: `unknown link code "QPI"`},
		{name: "NVLink count zero", in: strings.Replace(strings.Replace(good, "NV2", "NV0", 2), "x", "x", 1),
			wantErr: ErrMalformed, line: 2, inMsg: "NVLink count"},
		{name: "diagonal not X", in: strings.Replace(good, "GPU0\t X ", "GPU0\tNV2", 1),
			wantErr: ErrMalformed, line: 2, inMsg: "diagonal must be X"},
		{name: "X off the diagonal", in: strings.Replace(strings.Replace(good, "GPU0\t X \tNV2", "GPU0\t X \tX", 1), "GPU1\tNV2", "GPU1\tX", 1),
			wantErr: ErrMalformed, line: 2, inMsg: "only valid on the diagonal"},
		{name: "bad CPU list", in: strings.Replace(good, "4-7", "7-4", 1),
			wantErr: ErrMalformed, line: 4, inMsg: `"7-4" runs backwards`},
		{name: "CPU list not numbers", in: strings.Replace(good, "4-7", "4-x", 1),
			wantErr: ErrMalformed, line: 4, inMsg: `CPU Affinity`},
		{name: "CPU listed twice", in: strings.Replace(good, "4-7", "4-7,6", 1),
			wantErr: ErrMalformed, line: 4, inMsg: "id 6 appears twice"},
		{name: "bad NUMA list", in: strings.Replace(good, "4-7\t1", "4-7\t-1", 1),
			wantErr: ErrMalformed, line: 4, inMsg: "NUMA Affinity"},
		{name: "bad GPU NUMA ID", in: strings.Replace(good, "\t\t5", "\t\tfive", 1),
			wantErr: ErrMalformed, line: 4, inMsg: "GPU NUMA ID"},
		{name: "duplicate GPU row", in: good + "GPU1\tNV2\t X \tSYS\tPIX\t0-3\t0\t\tN/A\n",
			wantErr: ErrMalformed, line: 6, inMsg: "duplicate row GPU1 (first on line 3)"},
		{name: "unknown row label", in: good + "GPU9\tSYS\n", wantErr: ErrMalformed, line: 6, inMsg: `"GPU9" is not a column`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			top, err := Parse(strings.NewReader(tc.in))
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("Parse: %v", err)
				}
				tc.check(t, top)
				return
			}
			if err == nil {
				t.Fatalf("Parse succeeded, want %v:\n%s", tc.wantErr, top)
			}
			if top != nil {
				t.Fatalf("Parse returned a topology with its error")
			}
			if !errors.Is(err, tc.wantErr) || !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want it to wrap %v", err, tc.wantErr)
			}
			var pe *ParseError
			if !errors.As(err, &pe) {
				t.Fatalf("err %T is not a *ParseError", err)
			}
			if tc.line != 0 && pe.Line != tc.line {
				t.Errorf("line %d, want %d: %v", pe.Line, tc.line, err)
			}
			if !strings.Contains(err.Error(), tc.inMsg) {
				t.Errorf("error %q does not contain %q", err, tc.inMsg)
			}
		})
	}
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("disk on fire") }

func TestParseReaderError(t *testing.T) {
	_, err := Parse(errReader{})
	if err == nil || !strings.Contains(err.Error(), "disk on fire") {
		t.Fatalf("err = %v, want the reader's error", err)
	}
}

func TestValidate(t *testing.T) {
	ok := func() *Topology {
		return &Topology{
			GPUs:  []GPU{{Index: 0, GPUNUMA: -1}, {Index: 1, GPUNUMA: -1}},
			Links: [][]Link{{Self, NV(1)}, {NV(1), Self}},
		}
	}
	tests := []struct {
		name  string
		edit  func(*Topology)
		want  error
		inMsg string
	}{
		{"valid", func(*Topology) {}, nil, ""},
		{"no GPUs", func(t *Topology) { t.GPUs, t.Links = nil, nil }, ErrMalformed, "no GPUs"},
		{"index mismatch", func(t *Topology) { t.GPUs[1].Index = 7 }, ErrMalformed, "has index 7"},
		{"ragged", func(t *Topology) { t.Links[1] = t.Links[1][:1] }, ErrMalformed, "GPU1 has 1 links"},
		{"asymmetric", func(t *Topology) { t.Links[1][0] = NV(2) }, ErrAsymmetric, "GPU0-GPU1 is NV1 but GPU1-GPU0 is NV2"},
		{"zero link", func(t *Topology) { t.Links[0][1] = Link{} }, ErrMalformed, "invalid link"},
		{"diagonal", func(t *Topology) { t.Links[0][0] = SYS }, ErrMalformed, "diagonal is SYS"},
		{"bad GPU NUMA", func(t *Topology) { t.GPUs[0].GPUNUMA = -2 }, ErrMalformed, "GPU NUMA id -2"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			top := ok()
			tc.edit(top)
			err := top.Validate()
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tc.want) || !strings.Contains(fmtErr(err), tc.inMsg) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.want, tc.inMsg)
			}
		})
	}
	var nilTop *Topology
	if err := nilTop.Validate(); !errors.Is(err, ErrMalformed) {
		t.Fatalf("nil topology: %v", err)
	}
}

func fmtErr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
