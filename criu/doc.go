// Package criu is berth's access to CRIU through go-criu/v7: finding the criu binary, checking
// its version (berth needs CRIU >= MinVersion) and the kernel-dependent features CRIU reports,
// and reading CRIU's statistics files in an images directory (stats-dump, stats-restore). Every
// thread's credentials, from pstree.img and core-<tid>.img, are read by package criu/images.
//
// What belongs here: anything that asks the criu binary something over its RPC (criu swrk) or
// reads CRIU's image files. What does not: containerd, runc, the shim, or the berth manifest
// format (package oci/checkpoint owns that; this package only fills checkpoint.CRIUStats).
//
// Every call that talks to CRIU starts its own "criu swrk" process, reaps it, and is bounded by
// a context. Version goes through go-criu, whose calls cannot be cancelled: when ctx ends first,
// it returns ctx.Err() at once and the swrk process is reaped in the background when CRIU
// answers or exits. Features speaks the same RPC itself and kills its swrk process when ctx
// ends.
//
// Errors: ErrNotFound when the binary is missing, ErrTooOld when it is older than MinVersion,
// ErrFeatureMissing when a required feature is unavailable, ErrBadStats for an unreadable
// statistics file; all wrapped with the path and values involved, and matched with errors.Is.
package criu
