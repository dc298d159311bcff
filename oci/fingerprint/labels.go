package fingerprint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"sort"
	"strconv"
	"strings"
)

// Node labels: a node publishes its fingerprint as Kubernetes node labels (through a Node
// Feature Discovery feature file, NFDFeatureFile), and a restore pod selects a matching node with
// Selector. Every label is under LabelPrefix; every value is a valid label value (LabelValue).
//
//	Label                  Value (example)         Kind    Fingerprint field and rule
//	berth.dev/fingerprint  Hash() ("3f0c...")      exact   arch, kernel, cpu.vendor, GPU count and each
//	                                                       GPU's name, driver and CUDA (the exact rules)
//	berth.dev/arch         "amd64"                 exact   arch
//	berth.dev/kernel       "6.18.44-fc-v669"       exact   kernel
//	berth.dev/cpu-vendor   "GenuineIntel"          exact   cpu.vendor
//	berth.dev/runc         "1.5" (major.minor)     exact   runc, same-major-minor
//	berth.dev/containerd   "2" (major)             exact   containerd, same-major
//	berth.dev/gpu-count    "8"                     exact   gpus (in a selector only when the
//	                                                       checkpoint has GPUs)
//	berth.dev/gpu-model    "NVIDIA-H200"           exact   gpus[i].name
//	berth.dev/gpu-driver   "580.65.06"             exact   gpus[i].driver
//	berth.dev/cuda         "13.0"                  exact   gpus[i].cuda
//	berth.dev/criu         "4.2.1"                 info    criu (at-least: a label selector
//	                                                       cannot say >=)
//
// Exact labels go into Selector: a node whose fingerprint Compare accepts for a checkpoint
// carries every label of that checkpoint's Selector (sanitizing is deterministic, and runc and
// containerd are reduced to the part their rule compares). The reverse does not hold: CPU flags
// (superset), CRIU (at-least) and GPU memory (at-least) have no label, and readable values may
// coincide after sanitizing ("NVIDIA H200" and "NVIDIA_H200" both read "NVIDIA-H200"); the
// fingerprint label, a hash of the raw exact fields, tells those apart. The shim's Compare at
// restore remains the check; the labels only steer the scheduler to nodes that can pass it.
//
// Labels are left out when their field is empty (a node whose runc version could not be read has
// no berth.dev/runc label, so selectors that need one do not match it), and runc and containerd
// also when their version does not parse (Compare then wants identical strings; the shim checks). The GPU labels read
// "mixed" when a node's GPUs differ in that field; the fingerprint label pairs them by index.
const (
	// LabelPrefix is the namespace of every berth node label.
	LabelPrefix = "berth.dev/"

	LabelFingerprint = LabelPrefix + "fingerprint"
	LabelArch        = LabelPrefix + "arch"
	LabelKernel      = LabelPrefix + "kernel"
	LabelCPUVendor   = LabelPrefix + "cpu-vendor"
	LabelRunc        = LabelPrefix + "runc"
	LabelContainerd  = LabelPrefix + "containerd"
	LabelGPUCount    = LabelPrefix + "gpu-count"
	LabelGPUModel    = LabelPrefix + "gpu-model"
	LabelGPUDriver   = LabelPrefix + "gpu-driver"
	LabelCUDA        = LabelPrefix + "cuda"
	LabelCRIU        = LabelPrefix + "criu"
)

// mixedValue is the value of a GPU label when a node's GPUs differ in that field.
const mixedValue = "mixed"

// MaxLabelValueLength is the longest Kubernetes label value.
const MaxLabelValueLength = 63

// labelHashLength is the number of hex digits of the hash suffix LabelValue appends to a value
// it has to shorten.
const labelHashLength = 8

// ExactLabel reports whether key is a label Selector may use (an exact-match label in the table
// above); informational labels (berth.dev/criu) and keys outside berth.dev/ are not.
func ExactLabel(key string) bool {
	switch key {
	case LabelFingerprint, LabelArch, LabelKernel, LabelCPUVendor, LabelRunc, LabelContainerd,
		LabelGPUCount, LabelGPUModel, LabelGPUDriver, LabelCUDA:
		return true
	}
	return false
}

// Labels returns fp as node labels (see the table above): every value a valid label value,
// labels of empty fields left out. A node without GPUs has berth.dev/gpu-count "0" and no other
// GPU label.
func Labels(fp Fingerprint) map[string]string {
	l := make(map[string]string)
	set := func(key, raw string) {
		if v := LabelValue(raw); v != "" {
			l[key] = v
		}
	}
	l[LabelFingerprint] = fp.Hash()
	set(LabelArch, fp.Arch)
	set(LabelKernel, fp.Kernel)
	set(LabelCPUVendor, fp.CPU.Vendor)
	if v, ok := parseVersion(fp.Runc); ok && fp.Runc != "" {
		l[LabelRunc] = strconv.Itoa(v[0]) + "." + strconv.Itoa(v[1])
	}
	if v, ok := parseVersion(fp.Containerd); ok && fp.Containerd != "" {
		l[LabelContainerd] = strconv.Itoa(v[0])
	}
	set(LabelCRIU, fp.CRIU)
	l[LabelGPUCount] = strconv.Itoa(len(fp.GPUs))
	if len(fp.GPUs) > 0 {
		set(LabelGPUModel, uniform(fp.GPUs, func(g GPU) string { return g.Name }))
		set(LabelGPUDriver, uniform(fp.GPUs, func(g GPU) string { return g.Driver }))
		set(LabelCUDA, uniform(fp.GPUs, func(g GPU) string { return g.CUDA }))
	}
	return l
}

// Selector returns the node selector a pod restoring a checkpoint taken with fingerprint
// checkpoint needs: the exact labels of Labels(checkpoint) (see ExactLabel), the fingerprint hash
// among them, and berth.dev/gpu-count only when the checkpoint has GPUs (the hash already tells
// GPU nodes from nodes without). Informational labels are left out.
func Selector(checkpoint Fingerprint) map[string]string {
	sel := make(map[string]string)
	for k, v := range Labels(checkpoint) {
		if ExactLabel(k) {
			sel[k] = v
		}
	}
	if len(checkpoint.GPUs) == 0 {
		delete(sel, LabelGPUCount)
	}
	return sel
}

// NFDFeatureFile renders Labels(fp) as a Node Feature Discovery local feature file: comment
// lines, then one "name=value" line per label, sorted by name. NFD's worker reads such files
// from /etc/kubernetes/node-feature-discovery/features.d/ (skipping names that begin with a dot)
// and turns every line into a node label; comments must not begin with "# +", which NFD reads
// as a directive.
func NFDFeatureFile(fp Fingerprint) []byte {
	var b bytes.Buffer
	b.WriteString("# berth node fingerprint, written by `berthctl labels` (Node Feature Discovery local feature file).\n")
	b.WriteString("# Exact-match labels and the berth.dev/fingerprint hash: see package oci/fingerprint.\n")
	labels := Labels(fp)
	for _, k := range SortedKeys(labels) {
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(labels[k])
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// SortedKeys returns the keys of a label map in byte-wise order.
func SortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// LabelValue turns s into a valid Kubernetes label value (at most 63 characters of
// [A-Za-z0-9._-], beginning and ending with an alphanumeric), deterministically:
//
//   - "" stays "", and a valid value is returned unchanged;
//   - every run of other characters becomes one '-' ("NVIDIA GeForce RTX 4090 (rev a1)" reads
//     "NVIDIA-GeForce-RTX-4090-rev-a1"), and non-alphanumerics are trimmed from both ends;
//   - a result longer than 63 characters is cut to 54, trimmed again, and given '-' and the first
//     8 hex digits of the SHA-256 of s, so that long values that share a beginning still differ;
//   - s without any alphanumeric reads as those 8 hex digits alone.
func LabelValue(s string) string {
	if s == "" || validLabelValue(s) {
		return s
	}
	var b strings.Builder
	replaced := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		if labelChar(c) {
			b.WriteByte(c)
			replaced = false
			continue
		}
		if !replaced {
			b.WriteByte('-')
			replaced = true
		}
	}
	v := strings.TrimFunc(b.String(), func(r rune) bool { return r > 0x7f || !alnum(byte(r)) })
	if v == "" {
		return shortHash(s)
	}
	if len(v) > MaxLabelValueLength {
		cut := MaxLabelValueLength - 1 - labelHashLength
		v = strings.TrimRightFunc(v[:cut], func(r rune) bool { return !alnum(byte(r)) })
		v += "-" + shortHash(s)
	}
	return v
}

// validLabelValue reports whether s is a valid non-empty label value.
func validLabelValue(s string) bool {
	if len(s) == 0 || len(s) > MaxLabelValueLength || !alnum(s[0]) || !alnum(s[len(s)-1]) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !labelChar(s[i]) {
			return false
		}
	}
	return true
}

func alnum(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func labelChar(c byte) bool { return alnum(c) || c == '-' || c == '_' || c == '.' }

func shortHash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])[:labelHashLength]
}

// uniform returns the value field gives every GPU, or "mixed" when they differ.
func uniform(gpus []GPU, field func(GPU) string) string {
	v := field(gpus[0])
	for _, g := range gpus[1:] {
		if field(g) != v {
			return mixedValue
		}
	}
	return v
}
