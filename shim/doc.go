// Package shim is berth's containerd task service (runtime type io.containerd.berth.v2). It wraps
// containerd's runc task service, so every task API call behaves as with io.containerd.runc.v2
// except that Pause and Resume wait for a checkpoint of the task in progress to end, and Kill
// and Resume for a lazy dump's page transfer (runc's shim holds them only for runc's own dump),
// and adds:
//
//   - Checkpoint: after runc/CRIU dumped the container, it writes its own rootfs diff (the
//     overlay's upper directory) beside the CRIU images and the berth manifest (berth.json): the
//     node's fingerprint, CRIU's dump statistics (from CRIU's stats-dump file), the container's
//     Kubernetes namespace, pod, name and image, its security context, the image size and the
//     digest of every file; it makes every file 0600 and every directory 0700 and signs the
//     manifest with the node's key (berth.sig, package oci/signature). In copy mode CRIU sends
//     the memory to a page server instead (pageserver.go); in lazy mode the request returns
//     once everything but the memory is written and signed, while CRIU serves the pages from
//     the frozen task (lazy.go), and a checkpoint marked postCopy is restored lazily.
//   - Restore on create: a container whose OCI spec carries the annotation berth.dev/restore-from
//     is admitted in Create, before anything is created (inside the configured checkpoint root, no
//     "..", no symlink escape; signed by a key the trust policy trusts for the pod's namespace, the
//     manifest taken from the signed bytes; digests match; fingerprint compatible; the namespace
//     the signed manifest records; no process's credentials and not the source's security context
//     beyond what the pod's spec grants, package oci/privilege; only a signed rootfs diff, within
//     its limits) and restored by CRIU in Start instead of being started fresh, from the directory
//     Create verified, held open. A checkpoint handed over by containerd itself (ctr containers
//     restore) is admitted the same way; one without a berth manifest only under allow_unsigned.
//   - Pause leases (lease.go): a mover that pauses a task grants it a lease through Update
//     annotations; a task still paused when its lease ends (the mover died) is resumed, or
//     killed once the move committed, and a lazy dump whose move is gone is abandoned (CRIU hung
//     up on, or killed if a client holds it: abandonLazyDump; a Resume abandons it too).
//   - A per-container CRIU configuration file (runc's org.criu.config annotation) so that open TCP
//     connections are closed, not dumped: a container moved to another node cannot keep them.
//   - GPU steps, for a container with GPUs and a GPU backend (gpu.Backend): before the dump a GPU
//     session locks the CUDA processes and checkpoints their device memory into host memory,
//     moving through explicit steps (found, thawed, locked, checkpointed, refrozen); after the
//     dump, or on any failure, it is undone from the step it reached. On restore, Create checks
//     and maps the destination GPUs and Start brings the device memory back and unlocks it.
//
// A task created from a checkpoint has one record in the Service from Create to Delete (created,
// then started). The phases the shim times (GPU steps, criu-dump, fingerprint at checkpoint;
// criu-restore and the GPU steps at restore) are written into the manifest, or by Start into
// the bundle's berth-restore.json, and logged. The exported methods answer with wire errors
// whose errdefs class comes from one table over berth's sentinel errors (errorClass); the steps
// below them return native errors.
//
// What does not belong here: talking to containerd's API (the client side of a move is
// cmd/berthctl/move), placement (package nri), and GPU drivers (package gpu).
package shim
