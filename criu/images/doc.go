// Package images reads the credentials of every thread in a CRIU images directory
// (ReadProcesses: pstree.img and core-<tid>.img through go-criu's crit bindings, as
// privilege.Process values for the restore check in oci/privilege), and each filtered thread's
// seccomp filter chain (ReadSeccompChains: seccomp.img, for oci/privilege/seccompbpf).
//
// It is apart from package criu because go-criu's crit bindings register the protobuf
// descriptors of every CRIU image type (and every architecture's core) at init: the shim, which
// every container runs, keeps package criu but leaves this reading of untrusted image files to
// berth-shim-helper (package shim/helper), a short-lived process per restore.
//
// What does not belong here: talking to the criu binary and its statistics files (package
// criu), comparing credentials with a spec (package oci/privilege).
//
// Errors: ErrBadImage for a malformed (or oversized) image file, fs.ErrNotExist for a missing
// one; wrapped with the file's name.
package images
