package checkpoint

import (
	"io/fs"
	"os"
	"path/filepath"
)

// The layout of a berth checkpoint directory. It follows the layout the kubelet and checkpointctl
// use for CRI checkpoint archives, so the same tools can read it:
//
//	berth.json        the berth manifest (Manifest): fingerprint, CRIU statistics, digest of every other file
//	berth.sig         the signature of berth.json by the node that wrote it (package oci/signature)
//	checkpoint/       the CRIU image directory (written by runc/CRIU through the shim); it holds its own
//	                  berth.json and berth.sig written by the shim, covering the CRIU images and
//	                  berth-rootfs-diff.tar, the shim's own copy of the rootfs diff
//	spec.dump         the source container's OCI runtime spec (JSON)
//	config.dump       the source container's metadata (ContainerInfo as JSON)
//	rootfs-diff.tar   the changes in the container's writable layer (absent when there are none)
//	stats-dump        CRIU's dump statistics (protobuf, CRIU's own format)
//	dump.log          CRIU's dump log
//
// A CRIU image directory written by the shim alone (for example by `ctr tasks checkpoint`) carries
// berth.json at its top and no subdirectories; it is also a valid checkpoint for restore.
const (
	// ManifestFile is the file name of the berth manifest, at the top of a checkpoint.
	ManifestFile = "berth.json"
	// SignatureFile is the signature of ManifestFile beside it (a DSSE envelope, package
	// oci/signature). Like ManifestFile it is not listed in the manifest's Files.
	SignatureFile = "berth.sig"
	// ImagesDir is the CRIU image directory inside a berth checkpoint directory.
	ImagesDir = "checkpoint"
	// SpecFile holds the source container's OCI runtime spec.
	SpecFile = "spec.dump"
	// ConfigFile holds the source container's metadata.
	ConfigFile = "config.dump"
	// RootfsDiffFile is a tar of the changes in the container's writable layer.
	RootfsDiffFile = "rootfs-diff.tar"
	// ImagesRootfsDiffFile is the shim's own tar of the changes in the container's writable
	// layer (uncompressed, overlay whiteouts as OCI whiteouts), written into the CRIU image
	// directory at checkpoint so that the image directory's signed berth.json covers it. A CRI
	// checkpoint archive's rootfs-diff.tar is written by containerd after the shim signed the
	// images, so no signature covers it; a restore of such an archive applies this copy instead.
	ImagesRootfsDiffFile = "berth-rootfs-diff.tar"
	// StatsDumpFile is CRIU's dump statistics file name (in the CRIU work directory).
	StatsDumpFile = "stats-dump"
	// DumpLogFile is CRIU's dump log file name (in the CRIU work directory).
	DumpLogFile = "dump.log"
)

// DefaultRoot is the default checkpoint root of a node: the shim's checkpoint_root (the only
// place restores read from), and where berthctl receive, restore and migrate put checkpoints.
const DefaultRoot = "/var/lib/berth/checkpoints"

// RestrictModes makes every file below dir readable by its owner only: regular files 0600,
// directories (dir included) 0700, because CRIU's images hold process memory. Symbolic links and
// special files are left alone (a checkpoint has none: its digests refuse them). It returns the
// first walk or chmod error.
func RestrictModes(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.Chmod(p, 0o700)
		case d.Type().IsRegular():
			return os.Chmod(p, 0o600)
		}
		return nil
	})
}
