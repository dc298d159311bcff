// Package move is the client side of berth's checkpoint and restore: it drives containerd (its Go
// client) to checkpoint a running container into a berth checkpoint directory, and to create a
// container on a destination node that berth's shim restores from such a directory. The
// transfer between the two is package oci/transfer; berthctl wires them into a migration.
//
// What belongs here: containerd API calls and their rollback. What does not: the CRIU and GPU
// steps (the shim does those inside containerd) and the checkpoint format (package oci/checkpoint).
package move
