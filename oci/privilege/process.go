package privilege

import (
	"fmt"
	"strconv"
	"strings"
)

// SeccompMode is a thread's seccomp mode, numbered as the kernel's SECCOMP_MODE_* and CRIU's
// seccomp_mode enum.
type SeccompMode uint32

// The seccomp modes.
const (
	SeccompDisabled SeccompMode = 0
	SeccompStrict   SeccompMode = 1
	SeccompFilter   SeccompMode = 2
)

// String is the mode's name: "disabled", "strict", "filter", or "mode N" for another value.
func (m SeccompMode) String() string {
	switch m {
	case SeccompDisabled:
		return "disabled"
	case SeccompStrict:
		return "strict"
	case SeccompFilter:
		return "filter"
	}
	return "mode " + strconv.FormatUint(uint64(m), 10)
}

// MarshalText writes m as String does.
func (m SeccompMode) MarshalText() ([]byte, error) { return []byte(m.String()), nil }

// UnmarshalText reads what MarshalText writes.
func (m *SeccompMode) UnmarshalText(b []byte) error {
	for _, v := range []SeccompMode{SeccompDisabled, SeccompStrict, SeccompFilter} {
		if string(b) == v.String() {
			*m = v
			return nil
		}
	}
	n, err := strconv.ParseUint(strings.TrimPrefix(string(b), "mode "), 10, 32)
	if err != nil || !strings.HasPrefix(string(b), "mode ") {
		return fmt.Errorf("unknown seccomp mode %q", b)
	}
	*m = SeccompMode(n)
	return nil
}

// Process is the credentials of one thread of a checkpointed process, as CRIU recorded them
// (one per thread: the kernel keeps credentials per thread and CRIU restores them so). IDs are
// those of the container's user namespace, PID and TID those of its pid namespace.
type Process struct {
	// PID is the process (thread group) id, TID the thread's id (TID == PID for the main thread).
	PID int `json:"pid"`
	TID int `json:"tid"`
	// Comm is the thread's name (comm), as the kernel reports it.
	Comm string `json:"comm"`

	// Real, effective, saved and filesystem user and group ids.
	UID   uint32 `json:"uid"`
	EUID  uint32 `json:"euid"`
	SUID  uint32 `json:"suid"`
	FSUID uint32 `json:"fsuid"`
	GID   uint32 `json:"gid"`
	EGID  uint32 `json:"egid"`
	SGID  uint32 `json:"sgid"`
	FSGID uint32 `json:"fsgid"`
	// Groups are the supplementary groups.
	Groups []uint32 `json:"groups,omitempty"`

	// The five capability sets.
	CapEff CapSet `json:"capEff"`
	CapPrm CapSet `json:"capPrm"`
	CapInh CapSet `json:"capInh"`
	CapBnd CapSet `json:"capBnd"`
	CapAmb CapSet `json:"capAmb"`

	// NoNewPrivs is prctl(PR_GET_NO_NEW_PRIVS).
	NoNewPrivs bool `json:"noNewPrivs"`
	// Seccomp is the thread's seccomp mode; in filter mode the filters are the image's.
	Seccomp SeccompMode `json:"seccomp"`
	// Securebits are the SECBIT_* flags (prctl(PR_GET_SECUREBITS)).
	Securebits uint32 `json:"securebits"`
	// LSMProfile is the LSM label CRIU recorded and restores: for AppArmor the profile name
	// without its mode, empty when unconfined.
	LSMProfile string `json:"lsmProfile,omitempty"`
}

// String names the thread for messages: "process 12 (nginx)", or
// "process 12 thread 15 (worker)" for a thread other than the main one.
func (p Process) String() string {
	if p.TID == 0 || p.TID == p.PID {
		return fmt.Sprintf("process %d (%s)", p.PID, p.Comm)
	}
	return fmt.Sprintf("process %d thread %d (%s)", p.PID, p.TID, p.Comm)
}
