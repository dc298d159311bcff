package fingerprint

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

func base() Fingerprint {
	return Fingerprint{
		Version:    Version,
		Kernel:     "6.18.0-1",
		Arch:       "amd64",
		CRIU:       "4.2.0",
		Runc:       "1.5.3",
		Containerd: "2.4.2",
		CPU: CPU{
			Vendor: "GenuineIntel", Family: "6", Model: "143", ModelName: "Xeon",
			Flags: []string{"avx", "avx2", "avx512f", "sse4_2"},
		},
		ImageDigest: "sha256:aaaa",
		GPUs: []GPU{
			{Index: 0, UUID: "GPU-0", Name: "NVIDIA H200", MemoryBytes: 141 << 30, Driver: "580.1", CUDA: "13.0"},
			{Index: 1, UUID: "GPU-1", Name: "NVIDIA H200", MemoryBytes: 141 << 30, Driver: "580.1", CUDA: "13.0"},
		},
	}
}

// clone deep-copies f so tests can edit slices.
func clone(f Fingerprint) Fingerprint {
	b, _ := json.Marshal(f)
	var out Fingerprint
	_ = json.Unmarshal(b, &out)
	return out
}

func TestCompare(t *testing.T) {
	for _, tc := range []struct {
		name  string
		edit  func(c, n *Fingerprint)
		field string // "" means compatible
		rule  Rule
	}{
		{"identical", func(c, n *Fingerprint) {}, "", ""},

		{"arch differs", func(c, n *Fingerprint) { n.Arch = "arm64" }, "arch", RuleExact},

		{"kernel differs", func(c, n *Fingerprint) { n.Kernel = "6.1.0-9" }, "kernel", RuleExact},

		{"criu newer sublevel", func(c, n *Fingerprint) { n.CRIU = "4.2.1" }, "", ""},
		{"criu older sublevel", func(c, n *Fingerprint) { c.CRIU = "4.2.3"; n.CRIU = "4.2.0" }, "", ""},
		{"criu newer minor", func(c, n *Fingerprint) { n.CRIU = "4.3.0" }, "", ""},
		{"criu newer major", func(c, n *Fingerprint) { n.CRIU = "5.0.0" }, "", ""},
		{"criu older minor", func(c, n *Fingerprint) { n.CRIU = "4.1.1" }, "criu", RuleAtLeast},
		{"criu older major", func(c, n *Fingerprint) { c.CRIU = "5.0.0" }, "criu", RuleAtLeast},
		{"criu unknown on node", func(c, n *Fingerprint) { n.CRIU = "" }, "criu", RuleAtLeast},
		{"criu unparsable on node", func(c, n *Fingerprint) { n.CRIU = "dev" }, "criu", RuleAtLeast},
		{"criu unknown in checkpoint", func(c, n *Fingerprint) { c.CRIU = "" }, "", ""},

		{"vendor differs", func(c, n *Fingerprint) { n.CPU.Vendor = "AuthenticAMD" }, "cpu.vendor", RuleExact},
		{"family/model/name informational", func(c, n *Fingerprint) {
			n.CPU.Family, n.CPU.Model, n.CPU.ModelName = "25", "1", "other"
		}, "", ""},

		{"node has more flags", func(c, n *Fingerprint) { n.CPU.Flags = append(n.CPU.Flags, "amx_tile") }, "", ""},
		{"node lacks a flag", func(c, n *Fingerprint) { n.CPU.Flags = []string{"avx", "sse4_2"} }, "cpu.flags", RuleSuperset},
		{"checkpoint has no flags", func(c, n *Fingerprint) { c.CPU.Flags = nil }, "", ""},

		{"runc patch differs", func(c, n *Fingerprint) { n.Runc = "1.5.9" }, "", ""},
		{"runc v-prefix", func(c, n *Fingerprint) { n.Runc = "v1.5.0" }, "", ""},
		{"runc minor differs", func(c, n *Fingerprint) { n.Runc = "1.6.0" }, "runc", RuleSameMajorMinor},
		{"runc older minor", func(c, n *Fingerprint) { n.Runc = "1.4.3" }, "runc", RuleSameMajorMinor},

		{"containerd minor differs", func(c, n *Fingerprint) { n.Containerd = "2.1.0" }, "", ""},
		{"containerd build metadata", func(c, n *Fingerprint) { n.Containerd = "2.4.2+unknown" }, "", ""},
		{"containerd major differs", func(c, n *Fingerprint) { n.Containerd = "1.7.27" }, "containerd", RuleSameMajor},

		{"image digest differs", func(c, n *Fingerprint) { n.ImageDigest = "sha256:bbbb" }, "imageDigest", RuleExactIfBothSet},
		{"image digest empty on node", func(c, n *Fingerprint) { n.ImageDigest = "" }, "", ""},
		{"image digest empty in checkpoint", func(c, n *Fingerprint) { c.ImageDigest = "" }, "", ""},

		{"gpu count differs", func(c, n *Fingerprint) { n.GPUs = n.GPUs[:1] }, "gpus", RuleExact},
		{"no gpus on node", func(c, n *Fingerprint) { n.GPUs = nil }, "gpus", RuleExact},
		{"gpu name differs", func(c, n *Fingerprint) { n.GPUs[1].Name = "NVIDIA H100" }, "gpus[1].name", RuleExact},
		{"gpu driver differs", func(c, n *Fingerprint) { n.GPUs[0].Driver = "575.0" }, "gpus[0].driver", RuleExact},
		{"gpu cuda differs", func(c, n *Fingerprint) { n.GPUs[0].CUDA = "12.9" }, "gpus[0].cuda", RuleExact},
		{"gpu memory larger", func(c, n *Fingerprint) { n.GPUs[0].MemoryBytes++ }, "", ""},
		{"gpu memory smaller", func(c, n *Fingerprint) { n.GPUs[1].MemoryBytes = 80 << 30 }, "gpus[1].memoryBytes", RuleAtLeast},
		{"gpu uuid informational", func(c, n *Fingerprint) { n.GPUs[0].UUID = "GPU-x" }, "", ""},
		{"gpus paired by index", func(c, n *Fingerprint) {
			n.GPUs[0], n.GPUs[1] = n.GPUs[1], n.GPUs[0]
			n.GPUs[0].Name = "other" // index 1 on the node
		}, "gpus[1].name", RuleExact},

		{"order: arch before kernel", func(c, n *Fingerprint) { n.Arch = "arm64"; n.Kernel = "x" }, "arch", RuleExact},
		{"order: kernel before gpus", func(c, n *Fingerprint) { n.GPUs = nil; n.Kernel = "x" }, "kernel", RuleExact},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, n := clone(base()), clone(base())
			tc.edit(&c, &n)
			err := Compare(c, n)
			if tc.field == "" {
				if err != nil {
					t.Fatalf("want compatible, got %v", err)
				}
				if all := CompareAll(c, n); all != nil {
					t.Fatalf("CompareAll: want nil, got %v", all)
				}
				return
			}
			var me *MismatchError
			if !errors.As(err, &me) {
				t.Fatalf("want *MismatchError, got %v", err)
			}
			if me.Field != tc.field || me.Rule != tc.rule {
				t.Errorf("got field %q rule %q (%v); want %q %q", me.Field, me.Rule, err, tc.field, tc.rule)
			}
			all := CompareAll(c, n)
			if len(all) == 0 || !reflect.DeepEqual(all[0], me) {
				t.Errorf("CompareAll()[0] = %v, want %v", all, me)
			}
		})
	}
}

func TestCompareAll(t *testing.T) {
	c, n := clone(base()), clone(base())
	n.Kernel = "6.1.0-9"
	n.CPU.Flags = []string{"sse4_2"}
	n.Containerd = "1.7.0"
	n.GPUs[0].Driver = "1"
	n.GPUs[1].MemoryBytes = 1
	var fields []string
	for _, m := range CompareAll(c, n) {
		fields = append(fields, m.Field)
	}
	want := []string{"kernel", "cpu.flags", "containerd", "gpus[0].driver", "gpus[1].memoryBytes"}
	if !reflect.DeepEqual(fields, want) {
		t.Errorf("CompareAll fields = %v, want %v", fields, want)
	}
}

func TestMismatchErrorText(t *testing.T) {
	for _, tc := range []struct {
		err  *MismatchError
		want string
	}{
		{&MismatchError{Field: "kernel", Checkpoint: "6.18.0-1", Node: "6.1.0-9", Rule: RuleExact},
			`fingerprint mismatch: kernel: checkpoint has "6.18.0-1" but this node has "6.1.0-9"`},
		{&MismatchError{Field: "criu", Checkpoint: "4.2.0", Node: "4.1.0", Rule: RuleAtLeast},
			`fingerprint mismatch: criu: checkpoint has "4.2.0" but this node has "4.1.0" (node must be at least the checkpoint's)`},
		{&MismatchError{Field: "cpu.flags", Checkpoint: "avx2 avx512f", Rule: RuleSuperset},
			`fingerprint mismatch: cpu.flags: checkpoint needs "avx2 avx512f" but this node lacks them (node must have all of the checkpoint's)`},
		{&MismatchError{Field: "runc", Checkpoint: "1.5.3", Node: "1.6.0", Rule: RuleSameMajorMinor},
			`fingerprint mismatch: runc: checkpoint has "1.5.3" but this node has "1.6.0" (major.minor must be equal)`},
		{&MismatchError{Field: "containerd", Checkpoint: "2.4.2", Node: "1.7.0", Rule: RuleSameMajor},
			`fingerprint mismatch: containerd: checkpoint has "2.4.2" but this node has "1.7.0" (major must be equal)`},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("got  %s\nwant %s", got, tc.want)
		}
	}
	c, n := base(), clone(base())
	n.CPU.Flags = []string{"avx"}
	var me *MismatchError
	if err := Compare(c, n); !errors.As(err, &me) || me.Checkpoint != "avx2 avx512f sse4_2" || me.Node != "" {
		t.Errorf("cpu.flags mismatch = %#v", me)
	}
}

func TestHash(t *testing.T) {
	f := base()
	h := f.Hash()
	if len(h) != 16 {
		t.Fatalf("Hash() = %q, want 16 hex chars", h)
	}
	if h != clone(f).Hash() {
		t.Error("Hash not stable across a JSON round trip")
	}
	// Fields outside the exact set, and GPU slice order, do not change the hash.
	for name, edit := range map[string]func(*Fingerprint){
		"criu":        func(f *Fingerprint) { f.CRIU = "9.9.9" },
		"runc":        func(f *Fingerprint) { f.Runc = "9.9" },
		"containerd":  func(f *Fingerprint) { f.Containerd = "9" },
		"flags":       func(f *Fingerprint) { f.CPU.Flags = nil },
		"model":       func(f *Fingerprint) { f.CPU.Model, f.CPU.Family, f.CPU.ModelName = "x", "y", "z" },
		"imageDigest": func(f *Fingerprint) { f.ImageDigest = "" },
		"gpu memory":  func(f *Fingerprint) { f.GPUs[0].MemoryBytes = 1 },
		"gpu uuid":    func(f *Fingerprint) { f.GPUs[0].UUID = "x" },
		"gpu order":   func(f *Fingerprint) { f.GPUs[0], f.GPUs[1] = f.GPUs[1], f.GPUs[0] },
	} {
		g := clone(f)
		edit(&g)
		if g.Hash() != h {
			t.Errorf("%s changed the hash", name)
		}
	}
	// Exact fields do.
	for name, edit := range map[string]func(*Fingerprint){
		"arch":       func(f *Fingerprint) { f.Arch = "arm64" },
		"kernel":     func(f *Fingerprint) { f.Kernel = "x" },
		"vendor":     func(f *Fingerprint) { f.CPU.Vendor = "x" },
		"gpu count":  func(f *Fingerprint) { f.GPUs = f.GPUs[:1] },
		"gpu name":   func(f *Fingerprint) { f.GPUs[1].Name = "x" },
		"gpu driver": func(f *Fingerprint) { f.GPUs[0].Driver = "x" },
		"gpu cuda":   func(f *Fingerprint) { f.GPUs[0].CUDA = "x" },
	} {
		g := clone(f)
		edit(&g)
		if g.Hash() == h {
			t.Errorf("%s did not change the hash", name)
		}
	}
}

func TestJSONShape(t *testing.T) {
	b, err := json.Marshal(Fingerprint{Version: 1, CPU: CPU{Flags: []string{}}})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"version":1,"kernel":"","arch":"","criu":"","cpu":{"vendor":"","family":"","model":"","modelName":"","flags":[]},"runc":"","containerd":""}`
	if string(b) != want {
		t.Errorf("JSON shape changed:\n got %s\nwant %s", b, want)
	}
}
