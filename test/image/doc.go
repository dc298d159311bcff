// Package image builds the container images berth's tests and demo run, without a registry.
//
// No container registry is reachable where berth is tested, so every test image is assembled
// here from files on the build machine and written as a single-layer OCI image-layout tarball
// that `ctr images import` (and containerd's Go importer) accept.
//
// What belongs here:
//   - WriteArchive / WriteArchiveFile / ManifestDigest: turn a root filesystem directory and a
//     Config into a deterministic OCI image-layout tar (oci-layout, index.json, one uncompressed
//     layer, config and manifest blobs under blobs/sha256/);
//   - Rootfs: helpers that assemble such a directory (base directories and /etc files, a static
//     busybox with its applet links, single files, dynamically linked ELF binaries together with
//     every shared library and the dynamic loader they need);
//   - BuildGoImage, BuildWorkload, BuildRedis, BuildPause: the concrete images the tests use,
//     cached beside their output path so that a rebuild with unchanged inputs writes nothing.
//
// What does not belong here: importing images into containerd, starting containerd, or running
// containers; other test packages do that with the tarballs written here.
//
// All image references are fully qualified and use the "localhost/berth/" prefix (for example
// "localhost/berth/pause:3.10"), so that nothing ever resolves them against a real registry.
// Digests are written "sha256:<64 lowercase hex digits>".
package image
