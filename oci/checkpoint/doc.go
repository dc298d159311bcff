// Package checkpoint is the on-disk format of a berth checkpoint: its layout (the kubelet's and
// checkpointctl's, with berth.json added), the berth manifest (Manifest: fingerprint, CRIU
// statistics, GPU state, phases, the size and sha256 of every file, and for a copy-mode move the
// page stream's length and digest, "blake3:" or "sha256:" (PageStream, pagedigest.go)), and pure
// functions over it:
// DigestDir and DigestDirKnown, WriteManifest, ReadManifest and ParseManifest, Verify and
// VerifyDigests, the receiver's verification stamp (WriteStamp, VerifyStamped), safe resolution of
// a berth.dev/restore-from path inside a checkpoint root (ResolveRestoreFrom), and the manifest
// of a CRI checkpoint archive (SignCRICheckpoint).
//
// What belongs here: the format and functions that read, write and check it on a local file
// system. What does not: tar streams (oci/archive), moving checkpoints between nodes
// (oci/transfer, oci/registry), and anything that talks to containerd, runc, CRIU or a GPU.
package checkpoint
