// Package privilege models what a container's processes hold (credentials read from CRIU
// images) and what an OCI runtime spec grants, and decides whether a restore would give a
// process more than its destination spec grants.
//
// A checkpoint is code: CRIU turns its images into running processes with the credentials
// stored in them (runc restores with CRIU and does not re-apply the spec's user, capabilities,
// no_new_privs or seccomp filter; the AppArmor profile is CRIU's unless runc is told
// --lsm-profile). So before a restore, berth compares
//
//   - every thread's credentials (Process, read from the images by package criu) with the
//     destination spec: CheckProcesses;
//   - the source container's security context (Container, recorded in the signed manifest from
//     the source spec with FromSpec) with the destination spec: CheckContainer.
//
// Both return nil when the destination grants at least as much, and otherwise an *Error that
// wraps ErrExceedsSpec and lists each Violation: who (process pid, tid and comm, or the
// source container), the field (uid, cap_eff, no_new_privs, seccomp, apparmor,
// namespace.pid, ...) and both values, capabilities by name.
//
// The rules, for a process (thread) p and the destination spec d:
//
//   - uid, euid, suid, fsuid: when d's user uid is 0 and d's bounding set has CAP_SETUID any
//     value passes (a root container may drop to any user, and CRIU restores the dropped
//     identity); otherwise each must equal d's uid. A process that became root through a
//     set-user-ID binary is refused.
//   - gid, egid, sgid, fsgid and each supplementary group: when d's uid is 0 and d's bounding
//     set has CAP_SETGID any value passes (its processes could call setgroups(2) themselves);
//     otherwise each must be d's gid or one of its additionalGids (so a root pod without
//     CAP_SETGID restores no process with a group it could not have taken, such as 6, disk).
//   - cap_eff, cap_prm, cap_inh, cap_bnd, cap_amb: each set must be a subset of d's
//     effective, permitted, inheritable, bounding and ambient set. Capabilities gained after
//     start (file capabilities, capset with CAP_SETPCAP) are refused unless d lists them.
//     Capability names the table (github.com/moby/sys/capability) does not know are ignored
//     in a spec, as runc ignores them; a bit without a name reads "CAP_<n>".
//   - no_new_privs: refused when d sets noNewPrivileges and p does not have it.
//   - seccomp: refused when d has a seccomp profile and p's mode is disabled. Strict passes
//     (it allows less than any filter). Filter passes, but the filter is the source's, taken
//     from the image (CRIU restores it; runc does not load d's profile on restore): the
//     container check compares the source profile with d's.
//   - apparmor: when d names an AppArmor profile (not "" or "unconfined"), p's LSM profile
//     as CRIU recorded it must be that profile. CRIU records an unconfined process as no
//     profile, which is refused against a confined d.
//   - securebits are recorded, not checked: the spec cannot express them, runc starts
//     processes with none set, and each bit only restricts (SECBIT_KEEP_CAPS keeps
//     capabilities that the cap_* rules check anyway).
//
// For the source container s (FromSpec of the source spec) and d:
//
//   - privileged: s privileged (every capability up to CAP_AUDIT_READ in the bounding set, no
//     seccomp profile, unconfined AppArmor, no masked or read-only paths) and d not: refused.
//   - uid, gid, groups: the process rules above, for s's user.
//   - cap_*: each of s's sets must be a subset of d's.
//   - no_new_privs: s without noNewPrivileges while d sets it: refused.
//   - seccomp: d has a profile and s has none, or a different one (by digest of the profile):
//     refused, since the restored processes keep the source's filter. d without a profile
//     passes.
//   - apparmor: d unconfined passes; otherwise s's profile must equal d's.
//   - namespace.<type> for pid, network, ipc, uts, mount, user, cgroup: a namespace is
//     shared when the spec does not list it (the host's) or joins it by path; s sharing one
//     that d keeps private is refused.
//
// What belongs here: the two models, FromSpec and the checks; pure functions over values, no
// I/O. What does not: reading CRIU images (package criu fills Process), the manifest that
// records a Container (oci/checkpoint), and deciding when to check (the shim).
package privilege
