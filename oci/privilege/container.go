package privilege

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"

	"github.com/moby/sys/capability"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// NamespaceMode is how a container has one kind of namespace.
type NamespaceMode string

// The namespace modes. Host and Joined are both "shared": the container is not alone in it.
const (
	// NamespacePrivate: the spec lists the namespace without a path; the runtime creates it.
	NamespacePrivate NamespaceMode = "private"
	// NamespaceJoined: the spec joins an existing namespace by path (a pod's sandbox, or the
	// host's through /proc/1/ns/...; a spec does not say which).
	NamespaceJoined NamespaceMode = "path"
	// NamespaceHost: the spec does not list the namespace; the container shares the host's.
	NamespaceHost NamespaceMode = "host"
)

// Shared reports whether m is not private.
func (m NamespaceMode) Shared() bool { return m != NamespacePrivate }

// NamespaceTypes are the namespaces Container records and CheckContainer compares.
var NamespaceTypes = []specs.LinuxNamespaceType{
	specs.PIDNamespace, specs.NetworkNamespace, specs.IPCNamespace, specs.UTSNamespace,
	specs.MountNamespace, specs.UserNamespace, specs.CgroupNamespace,
}

// User is a container process's user, as in the OCI spec's process.user.
type User struct {
	UID            uint32   `json:"uid"`
	GID            uint32   `json:"gid"`
	AdditionalGids []uint32 `json:"additionalGids,omitempty"`
}

// Capabilities are the five capability sets a spec gives the container's process.
type Capabilities struct {
	Effective   CapSet `json:"effective"`
	Permitted   CapSet `json:"permitted"`
	Inheritable CapSet `json:"inheritable"`
	Bounding    CapSet `json:"bounding"`
	Ambient     CapSet `json:"ambient"`
}

// Seccomp identifies a spec's seccomp profile.
type Seccomp struct {
	// DefaultAction is the profile's defaultAction (SCMP_ACT_ERRNO, ...).
	DefaultAction specs.LinuxSeccompAction `json:"defaultAction"`
	// Digest is "sha256:<hex>" of the profile's JSON encoding (linux.seccomp as
	// runtime-spec's Go types write it), equal for equal profiles.
	Digest string `json:"digest"`
}

// Container is the security context of a container as its OCI spec gives it. The manifest
// records the source's (FromSpec of the source spec) and CheckContainer compares it with the
// destination spec.
type Container struct {
	User            User         `json:"user"`
	Capabilities    Capabilities `json:"capabilities"`
	NoNewPrivileges bool         `json:"noNewPrivileges"`
	// Seccomp is nil when the spec has no seccomp profile.
	Seccomp *Seccomp `json:"seccomp,omitempty"`
	// AppArmorProfile is process.apparmorProfile; "" and "unconfined" are unconfined.
	AppArmorProfile string `json:"apparmorProfile,omitempty"`
	// Privileged is true when the spec shows what a privileged container is: every
	// capability up to CAP_AUDIT_READ in the bounding set, no seccomp profile, unconfined
	// AppArmor, and no masked or read-only paths.
	Privileged bool `json:"privileged"`
	// Namespaces has the mode of each of NamespaceTypes; a type missing from the map counts as
	// shared with the host.
	Namespaces map[specs.LinuxNamespaceType]NamespaceMode `json:"namespaces"`
	// Hooks are the OCI hooks the spec runs (HooksOf). CheckContainer does not compare them:
	// a destination's own runtime adds its hooks (CDI's, NRI plugins'); CheckHooks does, for a
	// restore whose spec may come from the checkpoint.
	Hooks []Hook `json:"hooks,omitempty"`
}

// privilegedCaps are the capabilities every kernel berth supports has (through
// CAP_AUDIT_READ, Linux 3.16): a bounding set holding all of them is a privileged container's.
var privilegedCaps = func() CapSet {
	var s CapSet
	for n := 0; n <= int(capability.CAP_AUDIT_READ); n++ {
		s |= 1 << n
	}
	return s
}()

// FromSpec returns the security context spec s gives its container. A nil s or a nil
// s.Process gives no user (uid 0), no capabilities, and (nil s.Linux) every namespace shared
// with the host, as a runtime would read it. Capability names the table does not know are
// left out.
func FromSpec(s *specs.Spec) Container {
	c := Container{Namespaces: map[specs.LinuxNamespaceType]NamespaceMode{}}
	for _, t := range NamespaceTypes {
		c.Namespaces[t] = NamespaceHost
	}
	if s == nil {
		return c
	}
	if p := s.Process; p != nil {
		c.User = User{UID: p.User.UID, GID: p.User.GID, AdditionalGids: slices.Clone(p.User.AdditionalGids)}
		if pc := p.Capabilities; pc != nil {
			c.Capabilities.Effective, _ = ParseCapSet(pc.Effective)
			c.Capabilities.Permitted, _ = ParseCapSet(pc.Permitted)
			c.Capabilities.Inheritable, _ = ParseCapSet(pc.Inheritable)
			c.Capabilities.Bounding, _ = ParseCapSet(pc.Bounding)
			c.Capabilities.Ambient, _ = ParseCapSet(pc.Ambient)
		}
		c.NoNewPrivileges = p.NoNewPrivileges
		c.AppArmorProfile = p.ApparmorProfile
	}
	c.Hooks = HooksOf(s)
	var masked, readonly int
	if l := s.Linux; l != nil {
		if l.Seccomp != nil {
			c.Seccomp = &Seccomp{DefaultAction: l.Seccomp.DefaultAction, Digest: seccompDigest(l.Seccomp)}
		}
		for _, ns := range l.Namespaces {
			if _, ok := c.Namespaces[ns.Type]; !ok {
				continue // time namespaces and types this package does not compare
			}
			if ns.Path != "" {
				c.Namespaces[ns.Type] = NamespaceJoined
			} else {
				c.Namespaces[ns.Type] = NamespacePrivate
			}
		}
		masked, readonly = len(l.MaskedPaths), len(l.ReadonlyPaths)
	}
	c.Privileged = c.Capabilities.Bounding&privilegedCaps == privilegedCaps && c.Seccomp == nil &&
		!confined(c.AppArmorProfile) && masked == 0 && readonly == 0
	return c
}

// seccompDigest is "sha256:<hex>" of profile's JSON encoding.
func seccompDigest(profile *specs.LinuxSeccomp) string {
	b, err := json.Marshal(profile)
	if err != nil { // runtime-spec's types always encode
		return "unencodable"
	}
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// confined reports whether an AppArmor profile name confines (is not "" or "unconfined").
func confined(profile string) bool { return profile != "" && profile != "unconfined" }
