package privilege

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// ErrExceedsSpec is wrapped by every error of CheckProcesses and CheckContainer: a restore would
// give a process more than the destination spec grants.
var ErrExceedsSpec = errors.New("exceeds what the destination spec grants")

// Violation is one field where a process or the source container holds more than the
// destination spec grants.
type Violation struct {
	// Subject names who holds it: "process 12 (nginx)", "process 12 thread 15 (worker)",
	// "source container".
	Subject string
	// Field is the field, in CRIU's or the spec's words: uid, euid, suid, fsuid, gid, egid,
	// sgid, fsgid, groups, cap_eff, cap_prm, cap_inh, cap_bnd, cap_amb, no_new_privs, seccomp,
	// apparmor, privileged, namespace.<type> (namespace.pid, namespace.network, ...).
	Field string
	// Have is the subject's value, Grant the destination's; capability sets by name.
	Have, Grant string
	// Excess is, for sets (capabilities, groups), what Have holds beyond Grant.
	Excess string
}

// String is the violation as one clause: subject, field, the excess (when a set has one), and
// what the process has against what the destination grants.
func (v Violation) String() string {
	if v.Excess != "" {
		return fmt.Sprintf("%s: %s: %s beyond the destination (has %s; destination %s)",
			v.Subject, v.Field, v.Excess, v.Have, v.Grant)
	}
	return fmt.Sprintf("%s: %s: %s, destination %s", v.Subject, v.Field, v.Have, v.Grant)
}

// maxListed bounds how many violations Error's message lists (a container of many threads
// with the same credentials repeats itself); Violations holds them all.
const maxListed = 8

// Error lists every violation a check found. It wraps ErrExceedsSpec.
type Error struct {
	Violations []Violation
}

// Error lists the first maxListed violations (Violation.String) and how many more there are.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("privilege: ")
	b.WriteString(ErrExceedsSpec.Error())
	for i, v := range e.Violations {
		if i == maxListed {
			fmt.Fprintf(&b, "; and %d more", len(e.Violations)-maxListed)
			break
		}
		if i == 0 {
			b.WriteString(": ")
		} else {
			b.WriteString("; ")
		}
		b.WriteString(v.String())
	}
	return b.String()
}

// Unwrap returns ErrExceedsSpec.
func (e *Error) Unwrap() error { return ErrExceedsSpec }

// result returns nil for no violations, else an *Error.
func result(vs []Violation) error {
	if len(vs) == 0 {
		return nil
	}
	return &Error{Violations: vs}
}

// CheckProcesses compares each thread's credentials with what dst grants (the rules are in the
// package doc) and returns nil when none holds more, else an *Error listing every violation.
// A nil dst or one without a process grants nothing.
func CheckProcesses(procs []Process, dst *specs.Spec) error {
	if dst == nil || dst.Process == nil {
		return fmt.Errorf("privilege: destination spec has no process: %w", ErrExceedsSpec)
	}
	g := FromSpec(dst)
	var vs []Violation
	for _, p := range procs {
		vs = append(vs, checkProcess(p, g)...)
	}
	return result(vs)
}

// CheckContainer compares the source container's security context with what dst grants (the
// rules are in the package doc) and returns nil when the source held no more, else an *Error
// listing every violation. A nil dst or one without a process grants nothing.
func CheckContainer(src Container, dst *specs.Spec) error {
	if dst == nil || dst.Process == nil {
		return fmt.Errorf("privilege: destination spec has no process: %w", ErrExceedsSpec)
	}
	g := FromSpec(dst)
	const subj = "source container"
	var vs []Violation
	if src.Privileged && !g.Privileged {
		vs = append(vs, Violation{Subject: subj, Field: "privileged", Have: "true", Grant: "false"})
	}
	vs = append(vs, checkIDs(subj, []id{{"uid", src.User.UID}}, []id{{"gid", src.User.GID}}, src.User.AdditionalGids, g)...)
	vs = append(vs, checkCaps(subj, src.Capabilities, g.Capabilities)...)
	if g.NoNewPrivileges && !src.NoNewPrivileges {
		vs = append(vs, Violation{Subject: subj, Field: "no_new_privs", Have: "false", Grant: "true"})
	}
	if g.Seccomp != nil && (src.Seccomp == nil || src.Seccomp.Digest != g.Seccomp.Digest) {
		vs = append(vs, Violation{Subject: subj, Field: "seccomp", Have: describeSeccomp(src.Seccomp), Grant: describeSeccomp(g.Seccomp)})
	}
	if confined(g.AppArmorProfile) && src.AppArmorProfile != g.AppArmorProfile {
		vs = append(vs, Violation{Subject: subj, Field: "apparmor", Have: describeAppArmor(src.AppArmorProfile), Grant: g.AppArmorProfile})
	}
	for _, t := range NamespaceTypes {
		have, ok := src.Namespaces[t]
		if !ok {
			have = NamespaceHost
		}
		if grant := g.Namespaces[t]; have.Shared() && !grant.Shared() {
			vs = append(vs, Violation{Subject: subj, Field: "namespace." + string(t), Have: string(have), Grant: string(grant)})
		}
	}
	return result(vs)
}

// checkProcess applies the process rules to one thread.
func checkProcess(p Process, g Container) []Violation {
	subj := p.String()
	vs := checkIDs(subj,
		[]id{{"uid", p.UID}, {"euid", p.EUID}, {"suid", p.SUID}, {"fsuid", p.FSUID}},
		[]id{{"gid", p.GID}, {"egid", p.EGID}, {"sgid", p.SGID}, {"fsgid", p.FSGID}},
		p.Groups, g)
	vs = append(vs, checkCaps(subj,
		Capabilities{Effective: p.CapEff, Permitted: p.CapPrm, Inheritable: p.CapInh, Bounding: p.CapBnd, Ambient: p.CapAmb},
		g.Capabilities)...)
	if g.NoNewPrivileges && !p.NoNewPrivs {
		vs = append(vs, Violation{Subject: subj, Field: "no_new_privs", Have: "false", Grant: "true"})
	}
	if g.Seccomp != nil && p.Seccomp == SeccompDisabled {
		vs = append(vs, Violation{Subject: subj, Field: "seccomp", Have: p.Seccomp.String(), Grant: describeSeccomp(g.Seccomp)})
	}
	if confined(g.AppArmorProfile) && p.LSMProfile != g.AppArmorProfile {
		vs = append(vs, Violation{Subject: subj, Field: "apparmor", Have: describeAppArmor(p.LSMProfile), Grant: g.AppArmorProfile})
	}
	return vs
}

// id is one named user or group id.
type id struct {
	field string
	v     uint32
}

// The capabilities that let a root process choose its own ids (setuid(2), setgroups(2)).
const (
	capSetgid = 6
	capSetuid = 7
)

// checkIDs applies the uid and gid rules for a destination g: with a user other than uid 0,
// every uid must be its uid and every gid and group its gid or one of its additional gids. With
// uid 0 the same holds for what a root process of g could not have chosen itself: uids other
// than 0 pass only when g's bounding set has CAP_SETUID, gids and groups beyond its gid and
// additional gids only when it has CAP_SETGID.
func checkIDs(subj string, uids, gids []id, groups []uint32, g Container) []Violation {
	u := g.User
	root := u.UID == 0
	if root && g.Capabilities.Bounding.Has(capSetuid) && g.Capabilities.Bounding.Has(capSetgid) {
		return nil
	}
	var vs []Violation
	if !root || !g.Capabilities.Bounding.Has(capSetuid) {
		for _, x := range uids {
			if x.v != u.UID {
				vs = append(vs, Violation{Subject: subj, Field: x.field, Have: fmtID(x.v), Grant: fmtID(u.UID)})
			}
		}
	}
	if root && g.Capabilities.Bounding.Has(capSetgid) {
		return vs
	}
	allowed := []uint32{u.GID}
	for _, g := range u.AdditionalGids {
		if !slices.Contains(allowed, g) {
			allowed = append(allowed, g)
		}
	}
	for _, x := range gids {
		if !slices.Contains(allowed, x.v) {
			vs = append(vs, Violation{Subject: subj, Field: x.field, Have: fmtID(x.v), Grant: fmtIDs(allowed)})
		}
	}
	var extra []uint32
	for _, gr := range groups {
		if !slices.Contains(allowed, gr) {
			extra = append(extra, gr)
		}
	}
	if len(extra) > 0 {
		vs = append(vs, Violation{Subject: subj, Field: "groups", Have: fmtIDs(groups), Grant: fmtIDs(allowed), Excess: fmtIDs(extra)})
	}
	return vs
}

// checkCaps requires each of have's sets to be a subset of grant's.
func checkCaps(subj string, have, grant Capabilities) []Violation {
	var vs []Violation
	for _, s := range []struct {
		field       string
		have, grant CapSet
	}{
		{"cap_eff", have.Effective, grant.Effective},
		{"cap_prm", have.Permitted, grant.Permitted},
		{"cap_inh", have.Inheritable, grant.Inheritable},
		{"cap_bnd", have.Bounding, grant.Bounding},
		{"cap_amb", have.Ambient, grant.Ambient},
	} {
		if ex := s.have.Minus(s.grant); ex != 0 {
			vs = append(vs, Violation{Subject: subj, Field: s.field, Have: s.have.String(), Grant: s.grant.String(), Excess: ex.String()})
		}
	}
	return vs
}

func describeSeccomp(s *Seccomp) string {
	if s == nil {
		return "none"
	}
	return fmt.Sprintf("profile %s (default %s)", s.Digest, s.DefaultAction)
}

func describeAppArmor(profile string) string {
	if !confined(profile) {
		return "unconfined"
	}
	return profile
}

func fmtID(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

func fmtIDs(vs []uint32) string {
	if len(vs) == 0 {
		return "none"
	}
	s := make([]string, len(vs))
	for i, v := range vs {
		s[i] = fmtID(v)
	}
	return strings.Join(s, ",")
}
