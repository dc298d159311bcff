// Package reference parses registry references as berth takes them: berth.dev/restore-from
// values (ParseRestoreFrom: a path, or oci://HOST[:PORT]/REPOSITORY:TAG|@sha256:HEX) and plain
// "host[:port]/repository[:tag|@digest]" references (Parse, oras-go's grammar plus berth's
// refusals: no credentials, at most MaxReferenceBytes). It also declares the errors of package
// registry.
//
// It is apart from package registry so that the shim, which parses every restore-from value
// and classifies registry errors but never talks to a registry itself (berth-shim-helper pulls
// for it), does not link oras-go's registry client, net/http's client and TLS: every container
// would pay their memory.
//
// What does not belong here: talking to a registry (package registry).
package reference
