package privilege

import (
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// Hook is one OCI hook a spec runs: runc runs it as root on the host, outside every
// namespace of the container, so a hook is more than any process of the container holds.
type Hook struct {
	// Kind is the spec's name for when it runs: prestart, createRuntime, createContainer,
	// startContainer, poststart, poststop.
	Kind string `json:"kind"`
	// Path, Args and Env are the hook's, as the spec gives them.
	Path string   `json:"path"`
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	// Timeout is the hook's timeout in seconds; nil for none.
	Timeout *int `json:"timeout,omitempty"`
}

// String is the hook as one line: its kind, path and arguments (not its environment).
func (h Hook) String() string {
	return strings.TrimSpace(h.Kind + " " + h.Path + " " + strings.Join(h.Args[min(1, len(h.Args)):], " "))
}

// HooksOf returns the hooks spec s runs, in the spec's order by kind; nil for none.
func HooksOf(s *specs.Spec) []Hook {
	if s == nil || s.Hooks == nil {
		return nil
	}
	var hs []Hook
	add := func(kind string, list []specs.Hook) {
		for _, h := range list {
			hs = append(hs, Hook{Kind: kind, Path: h.Path, Args: slices.Clone(h.Args), Env: slices.Clone(h.Env), Timeout: h.Timeout})
		}
	}
	//lint:ignore SA1019 runc still runs prestart hooks: a restore spec may carry them
	add("prestart", s.Hooks.Prestart)
	add("createRuntime", s.Hooks.CreateRuntime)
	add("createContainer", s.Hooks.CreateContainer)
	add("startContainer", s.Hooks.StartContainer)
	add("poststart", s.Hooks.Poststart)
	add("poststop", s.Hooks.Poststop)
	return hs
}

// CheckHooks returns nil when every hook dst runs is one of src (the hooks the source
// container's spec ran, recorded in the signed manifest): same kind, path, arguments,
// environment and timeout, each recorded hook matching at most one of dst's. Otherwise it
// returns an *Error (wrapping ErrExceedsSpec) with a Violation per hook src does not record. It
// is for a restore whose spec may come from the checkpoint itself (containerd's ctr containers
// restore takes the spec from the checkpoint image, which no berth signature covers): a hook
// there would run as root on this node.
func CheckHooks(src []Hook, dst *specs.Spec) error {
	left := slices.Clone(src)
	var vs []Violation
	for _, h := range HooksOf(dst) {
		i := slices.IndexFunc(left, func(s Hook) bool {
			return s.Kind == h.Kind && s.Path == h.Path && slices.Equal(s.Args, h.Args) && slices.Equal(s.Env, h.Env) &&
				(s.Timeout == nil) == (h.Timeout == nil) && (s.Timeout == nil || *s.Timeout == *h.Timeout)
		})
		if i < 0 {
			vs = append(vs, Violation{Subject: "restore spec", Field: "hook", Have: h.String(), Grant: "not in the signed source spec"})
			continue
		}
		left = slices.Delete(left, i, i+1)
	}
	if len(vs) == 0 {
		return nil
	}
	return &Error{Violations: vs}
}
