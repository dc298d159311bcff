// Package oci holds berth's contract with the outside world that is not code: the OCI annotations
// berth reads and writes (the only contract between the shim and the NRI plugin), and the on-disk
// format of a berth checkpoint: its layout, the berth manifest (berth.json) and the digests that
// make a checkpoint verifiable.
//
// The functions over that format: DigestDir, WriteManifest, ReadManifest (and ReadManifestBytes,
// ParseManifest) and Verify for manifests and digests; ResolveRestoreFrom for turning the
// AnnotationRestoreFrom annotation into a checkpoint path safely. Sub-packages: oci/archive (a
// checkpoint as a tar stream, and its safe extraction), oci/transfer (moving a checkpoint to
// another node), oci/fingerprint (what a checkpoint was taken against).
//
// What belongs here: names, formats, and pure functions over them (digesting, verifying, path
// validation). What does not: anything that talks to containerd, runc, CRIU or a GPU.
package oci
