package fingerprint

import (
	"bufio"
	"bytes"
	"maps"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// labelValueRE is the Kubernetes label value syntax (apimachinery's validation.IsValidLabelValue),
// restated so this package does not import apimachinery.
var labelValueRE = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)

// labelKeyRE is a qualified name with the berth.dev prefix.
var labelKeyRE = regexp.MustCompile(`^berth\.dev/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$`)

func checkValue(t *testing.T, what, v string) {
	t.Helper()
	if len(v) > MaxLabelValueLength || !labelValueRE.MatchString(v) {
		t.Errorf("%s: %q (%d chars) is not a valid label value", what, v, len(v))
	}
}

func TestLabelValue(t *testing.T) {
	long := "5.15.0-1057-azure-fips-" + strings.Repeat("x", 60)
	longOther := "5.15.0-1057-azure-fips-" + strings.Repeat("x", 59) + "y"
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"6.18.44-fc-v669", "6.18.44-fc-v669"},
		{"6.8.0-45-generic", "6.8.0-45-generic"},
		{"4.18.0-513.el8.x86_64", "4.18.0-513.el8.x86_64"},
		{"amd64", "amd64"},
		{"GenuineIntel", "GenuineIntel"},
		{"NVIDIA H200", "NVIDIA-H200"},
		{"NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"},
		{"NVIDIA GeForce RTX 4090 (rev a1)", "NVIDIA-GeForce-RTX-4090-rev-a1"},
		{"Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"},
		{"  padded  ", "padded"},
		{"6.1.0-rc1+", "6.1.0-rc1"},
		{"6.1.0+git#1 SMP", "6.1.0-git-1-SMP"},
		{"_under_", "under"},
		{"Grafikkarte für Ökonomen", "Grafikkarte-f-r-konomen"},
		{"580.65.06", "580.65.06"},
		{"13.0", "13.0"},
		{strings.Repeat("a", 63), strings.Repeat("a", 63)},
		{"???", shortHash("???")},
		{"---", shortHash("---")},
	} {
		got := LabelValue(tc.in)
		if got != tc.want {
			t.Errorf("LabelValue(%q) = %q, want %q", tc.in, got, tc.want)
		}
		checkValue(t, "LabelValue("+tc.in+")", got)
		if again := LabelValue(got); again != got {
			t.Errorf("LabelValue not idempotent on %q: %q", got, again)
		}
	}

	// Too long: cut to 54, then '-' and 8 hex digits of the whole value's hash.
	for _, in := range []string{long, longOther, strings.Repeat("a", 64), strings.Repeat("a b ", 40), "6.18.44-" + strings.Repeat("-.", 40) + "end"} {
		got := LabelValue(in)
		checkValue(t, "long", got)
		if !strings.HasSuffix(got, "-"+shortHash(in)) {
			t.Errorf("LabelValue(%q) = %q: no hash suffix %s", in, got, shortHash(in))
		}
		if LabelValue(in) != got {
			t.Errorf("LabelValue(%q) not deterministic", in)
		}
	}
	if a, b := LabelValue(long), LabelValue(longOther); a == b || a[:40] != b[:40] {
		t.Errorf("long values sharing a beginning: %q and %q, want the same beginning and different suffixes", a, b)
	}
	if got := LabelValue(strings.Repeat("a", 64)); len(got) != MaxLabelValueLength {
		t.Errorf("64 a's: %q has %d chars, want %d", got, len(got), MaxLabelValueLength)
	}
}

func TestLabelValueFuzzLike(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("aZ09._- /+#()\x00\xff")
	for range 5000 {
		b := make([]byte, r.IntN(100))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		s := string(b)
		v := LabelValue(s)
		checkValue(t, "random", v)
		if s != "" && v == "" {
			t.Fatalf("LabelValue(%q) is empty", s)
		}
	}
}

func TestLabels(t *testing.T) {
	fp := base()
	got := Labels(fp)
	want := map[string]string{
		LabelFingerprint: fp.Hash(),
		LabelArch:        "amd64",
		LabelKernel:      "6.18.0-1",
		LabelCPUVendor:   "GenuineIntel",
		LabelRunc:        "1.5",
		LabelContainerd:  "2",
		LabelCRIU:        "4.2.0",
		LabelGPUCount:    "2",
		LabelGPUModel:    "NVIDIA-H200",
		LabelGPUDriver:   "580.1",
		LabelCUDA:        "13.0",
	}
	if !maps.Equal(got, want) {
		t.Errorf("Labels:\n got %v\nwant %v", got, want)
	}
	for k, v := range got {
		if !labelKeyRE.MatchString(k) || len(k) > len(LabelPrefix)+63 {
			t.Errorf("label key %q is not a valid berth.dev/ label key", k)
		}
		checkValue(t, k, v)
	}

	// A node without GPUs, versions unknown, odd strings.
	bare := Fingerprint{Version: Version, Kernel: "6.18.44-fc-v669-" + strings.Repeat("long", 20), Arch: "arm64",
		CPU: CPU{Vendor: "ARM Ltd."}, Runc: "dev", Containerd: ""}
	got = Labels(bare)
	want = map[string]string{
		LabelFingerprint: bare.Hash(),
		LabelArch:        "arm64",
		LabelKernel:      LabelValue(bare.Kernel),
		LabelCPUVendor:   "ARM-Ltd",
		LabelGPUCount:    "0",
	}
	if !maps.Equal(got, want) {
		t.Errorf("Labels(bare):\n got %v\nwant %v", got, want)
	}
	if len(got[LabelKernel]) != MaxLabelValueLength {
		t.Errorf("long kernel label %q: want %d chars", got[LabelKernel], MaxLabelValueLength)
	}

	// Mixed GPUs.
	mixed := base()
	mixed.GPUs[1].Name = "NVIDIA H100 80GB HBM3"
	mixed.GPUs[1].CUDA = "12.8"
	got = Labels(mixed)
	if got[LabelGPUModel] != "mixed" || got[LabelCUDA] != "mixed" || got[LabelGPUDriver] != "580.1" {
		t.Errorf("mixed GPUs: %v", got)
	}
	if got[LabelFingerprint] == Labels(base())[LabelFingerprint] {
		t.Error("mixed GPUs: same fingerprint label as uniform ones")
	}
}

func TestSelector(t *testing.T) {
	fp := base()
	got := Selector(fp)
	want := map[string]string{
		LabelFingerprint: fp.Hash(),
		LabelArch:        "amd64",
		LabelKernel:      "6.18.0-1",
		LabelCPUVendor:   "GenuineIntel",
		LabelRunc:        "1.5",
		LabelContainerd:  "2",
		LabelGPUCount:    "2",
		LabelGPUModel:    "NVIDIA-H200",
		LabelGPUDriver:   "580.1",
		LabelCUDA:        "13.0",
	}
	if !maps.Equal(got, want) {
		t.Errorf("Selector:\n got %v\nwant %v", got, want)
	}
	if _, ok := got[LabelCRIU]; ok {
		t.Error("Selector has the informational criu label")
	}

	cpuOnly := base()
	cpuOnly.GPUs = nil
	got = Selector(cpuOnly)
	for _, k := range []string{LabelGPUCount, LabelGPUModel, LabelGPUDriver, LabelCUDA, LabelCRIU} {
		if _, ok := got[k]; ok {
			t.Errorf("Selector of a checkpoint without GPUs has %s", k)
		}
	}
	if got[LabelFingerprint] != cpuOnly.Hash() || got[LabelFingerprint] == fp.Hash() {
		t.Errorf("Selector without GPUs: fingerprint %q", got[LabelFingerprint])
	}
	for k := range got {
		if !ExactLabel(k) {
			t.Errorf("Selector has non-exact label %s", k)
		}
	}
}

// TestSelectorMatchesCompare checks the promise of the label table: a node that Compare accepts
// for a checkpoint carries every label of the checkpoint's Selector; and a node that carries them
// all differs from the checkpoint, if at all, only in fields that have no exact label.
func TestSelectorMatchesCompare(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	pick := func(vs ...string) string { return vs[r.IntN(len(vs))] }
	gen := func() Fingerprint {
		f := Fingerprint{
			Version:    Version,
			Arch:       pick("amd64", "arm64"),
			Kernel:     pick("6.18.0-1", "6.18.0-1+", "6.18.44-fc-v669", ""),
			CRIU:       pick("4.2.0", "4.1.0", "4.2.1", ""),
			Runc:       pick("1.5.3", "1.5.0", "v1.5.1", "1.6.0", "", "dev"),
			Containerd: pick("2.4.2", "2.0.0", "1.7.3", "", "dev"),
			CPU: CPU{Vendor: pick("GenuineIntel", "AuthenticAMD", "Genuine Intel"),
				Flags: []string{pick("avx", "avx2")}},
			ImageDigest: pick("", "sha256:aa", "sha256:bb"),
		}
		for i := range r.IntN(3) {
			f.GPUs = append(f.GPUs, GPU{Index: i,
				Name:        pick("NVIDIA H200", "NVIDIA/H200", "NVIDIA H100"),
				Driver:      pick("580.1", "580.2"),
				CUDA:        pick("13.0", "12.8"),
				MemoryBytes: uint64(r.IntN(3)) << 30})
		}
		return f
	}
	unlabelled := func(field string) bool {
		return field == "criu" || field == "cpu.flags" || field == "imageDigest" || strings.HasSuffix(field, ".memoryBytes")
	}
	matched, refused := 0, 0
	for range 50000 {
		c, n := gen(), gen()
		if r.IntN(3) == 0 { // make close pairs common
			n = clone(c)
			n.CRIU = pick("4.2.0", "4.3.0", "4.1.9")
		}
		sel, labels := Selector(c), Labels(n)
		subset := true
		for k, v := range sel {
			if labels[k] != v {
				subset = false
			}
		}
		ms := CompareAll(c, n)
		if len(ms) == 0 {
			matched++
			if !subset {
				t.Fatalf("Compare accepts but selector does not match:\ncheckpoint %+v\nnode %+v\nselector %v\nlabels %v", c, n, sel, labels)
			}
			continue
		}
		refused++
		if !subset {
			continue
		}
		for _, m := range ms {
			ok := unlabelled(m.Field)
			// An unparsable runc/containerd version in the checkpoint has no label.
			if m.Field == "runc" {
				_, parses := parseVersion(c.Runc)
				ok = !parses
			}
			if m.Field == "containerd" {
				_, parses := parseVersion(c.Containerd)
				ok = !parses
			}
			if !ok {
				t.Fatalf("selector matches but Compare refuses on %s (%v):\ncheckpoint %+v\nnode %+v", m.Field, m, c, n)
			}
		}
	}
	if matched < 100 || refused < 100 {
		t.Fatalf("generator too one-sided: %d matched, %d refused", matched, refused)
	}
}

// parseFeatureFile reads a feature file the way NFD's local source does: trimmed lines, '#'
// lines are comments (directives when they begin with "# +"), "name=value" or "name" (true).
func parseFeatureFile(t *testing.T, data []byte) map[string]string {
	t.Helper()
	out := make(map[string]string)
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if strings.HasPrefix(line, "#") {
			if strings.HasPrefix(line, "# +") {
				t.Errorf("feature file comment %q would be read as an NFD directive", line)
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			v = "true"
		}
		if _, dup := out[k]; dup {
			t.Errorf("feature file repeats %s", k)
		}
		out[k] = v
	}
	return out
}

func TestNFDFeatureFile(t *testing.T) {
	for _, fp := range []Fingerprint{base(), {Version: Version, Arch: "arm64", Kernel: "6.18.44-fc-v669"}} {
		data := NFDFeatureFile(fp)
		if !bytes.HasSuffix(data, []byte("\n")) {
			t.Error("feature file does not end in a newline")
		}
		if len(data) > 65536 {
			t.Errorf("feature file is %d bytes, over NFD's 64 KiB limit", len(data))
		}
		if got := parseFeatureFile(t, data); !maps.Equal(got, Labels(fp)) {
			t.Errorf("round trip:\n got %v\nwant %v", got, Labels(fp))
		}
		if !bytes.Equal(data, NFDFeatureFile(clone(fp))) {
			t.Error("feature file not deterministic")
		}
		// Sorted name=value lines after the comments.
		var names []string
		for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			if !strings.HasPrefix(line, "#") {
				k, _, _ := strings.Cut(line, "=")
				names = append(names, k)
			}
		}
		for i := 1; i < len(names); i++ {
			if names[i-1] >= names[i] {
				t.Errorf("feature file lines not sorted: %s before %s", names[i-1], names[i])
			}
		}
	}
	want := "berth.dev/arch=amd64\n"
	if !strings.Contains(string(NFDFeatureFile(base())), want) {
		t.Errorf("feature file lacks %q:\n%s", want, NFDFeatureFile(base()))
	}
}
