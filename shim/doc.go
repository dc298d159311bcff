// Package shim is berth's containerd task service (runtime type io.containerd.berth.v2). It wraps
// containerd's runc task service, so every task API call behaves as with io.containerd.runc.v2,
// and adds:
//
//   - Checkpoint: after runc/CRIU dumped the container, it writes the berth manifest (berth.json)
//     beside the CRIU images: the node's fingerprint, CRIU's dump statistics (from CRIU's
//     stats-dump file), the image size and the digest of every file.
//   - Restore on create: a container whose OCI spec carries the annotation berth.dev/restore-from
//     is validated in Create (inside the configured checkpoint root, no "..", no symlink escape,
//     digests match, fingerprint compatible) and restored by CRIU in Start instead of being started
//     fresh. A checkpoint handed over by containerd itself (ctr containers restore) is verified the
//     same way when it carries a berth manifest.
//   - A per-container CRIU configuration file (runc's org.criu.config annotation) so that open TCP
//     connections are closed, not dumped: a container moved to another node cannot keep them.
//
// What does not belong here: talking to containerd's API (the client side of a move is cmd/berthctl/move),
// placement (package nri), and GPU drivers (package gpu).
package shim
