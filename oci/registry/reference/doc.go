// Package reference parses registry references as berth takes them: berth.dev/restore-from
// values (ParseRestoreFrom: a path, or oci://HOST[:PORT]/REPOSITORY:TAG|@sha256:HEX) and plain
// "host[:port]/repository[:tag|@digest]" references (Parse, oras-go's grammar plus berth's
// refusals: no credentials, at most MaxReferenceBytes). It also names the errors of package
// registry (declared in package regdef).
//
// It is apart from package registry so that berthctl and berth-shim-helper can parse without
// the registry client. The shim links neither: it sends an oci:// value to berth-shim-helper
// to parse (helper.OpParseRestoreFrom) and names the errors and shapes through package regdef,
// so that oras-go's grammar (regular expressions compiled at init) costs no shim start.
//
// What does not belong here: talking to a registry (package registry).
package reference
