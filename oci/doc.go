// Package oci holds the names that berth's binaries share with each other and with the outside
// world: every berth.dev/* annotation key, the CRI annotations berth reads, runc's CRIU
// configuration annotation, and the runtime type name of berth's shim. The shim, berth-nri and
// berthctl import these constants from here and never from each other.
//
// Sub-packages, each named for what it holds:
//   - oci/checkpoint: the on-disk format of a berth checkpoint (layout, the berth.json manifest,
//     digests, verification and receiver stamps, restore-from path resolution, CRI archives);
//   - oci/archive: a checkpoint as a tar stream, and its bounded, safe extraction;
//   - oci/transfer: the node-to-node protocol that moves a checkpoint over a socket;
//   - oci/registry: checkpoints as OCI artifacts in a registry (oras-go), and oci:// references;
//   - oci/fingerprint: what a checkpoint was taken against, probed from /proc and version
//     commands, compared on restore and published as Node Feature Discovery labels.
//
// It also holds the few runtime-spec readers more than one binary needs (MemoryLimit,
// IsBindMount).
//
// What belongs here: names and those readers. What does not: formats and functions over them (the
// sub-packages), and anything that talks to containerd, runc, CRIU or a GPU.
package oci
