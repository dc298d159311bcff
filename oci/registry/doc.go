// Package registry moves a berth checkpoint through an OCI registry: Push uploads a checkpoint
// directory (or a checkpoint archive) as an OCI artifact, Pull downloads one into a new directory
// and verifies it end to end. The registry protocol is oras-go's (oras.land/oras-go/v2); this
// package decides the artifact's layout and what is checked before anything is written.
//
// # Artifact layout
//
// A checkpoint is one OCI image manifest (application/vnd.oci.image.manifest.v1+json, image-spec
// v1.1) with
//
//	artifactType  application/vnd.berth.checkpoint.v1            (ArtifactType)
//	config        berth.json, byte for byte                       (ConfigMediaType,
//	              application/vnd.berth.manifest.v1+json)
//	layers        one per file that berth.json lists, in its      (FileMediaType,
//	              order (sorted by path), raw and uncompressed;    application/vnd.berth.checkpoint.file.v1)
//	              annotation org.opencontainers.image.title = the
//	              file's slash-separated path in the checkpoint;
//	              then, for a signed checkpoint, berth.sig        (SignatureMediaType,
//	              (title berth.sig), the DSSE envelope that        application/vnd.dsse.envelope.v1+json)
//	              signs berth.json (package oci/signature)
//	annotations   org.opencontainers.image.created, and           (Annotation* constants)
//	              dev.berth.checkpoint.{container.id, container.namespace, image, image.digest,
//	              fingerprint.hash} where the manifest has them
//
// Each layer's digest and size are the berth manifest's for that file, so the chain of digests
// is unbroken: the OCI manifest's digest covers berth.json's digest (the config), and berth.json
// covers every file's; berth.sig signs berth.json, so the node's signature covers every byte.
// Pull refuses an artifact whose file layers are not exactly berth.json's files.
//
// # Signatures
//
// Push with Options.Signer signs the pushed OCI manifest the way cosign signs images ("simple
// signing", sigstore's payload and signature packages over the standard library's crypto): an
// image manifest tagged "sha256-<hex>.sig" (CosignSignatureTag) in the same repository, one layer
// per signature holding the payload (the repository and the manifest digest), its base64
// signature in the annotation dev.cosignproject.cosign/signature; a push by another node adds its
// layer beside the others. So `cosign verify --key node.pub --insecure-ignore-tlog REF` verifies
// a pushed checkpoint. berth's own pull does not need that signature: it verifies berth.sig
// (Options.Verify), which covers the content, not just one manifest that names it.
//
// Why one layer per file rather than one tar of the directory: a checkpoint is dominated by a
// few large CRIU pages images (a process's whole memory, up to hundreds of GiB) next to many
// small files. Per-file blobs are uploaded and downloaded in parallel (Options.Concurrency);
// a push interrupted by a failure resumes at file granularity, because blobs the registry
// already has are skipped; identical files (between checkpoints of the same container, or
// empty files) are stored once; and nothing is re-packed: the files go to the registry as they
// are on disk and come back as files, without the tar round trip that makes containerd's own
// export/import slow. Files are not compressed: CRIU pages images of model weights and KV caches
// barely compress, and compression would cost more CPU time than it saves on a fast link.
//
// # What is checked
//
// Push verifies the checkpoint against its berth.json (checkpoint.Verify) and the trust policy
// (Options.Verify) before uploading, and the registry checks each blob's digest on upload. Pull
// checks, before writing anything: the manifest's digest (and the reference's, for a digest
// reference), the artifact and config media types, every layer title (relative, clean, no "..":
// archive.ErrUnsafePath), the file count and sizes against Options.Limits, and that the layers
// are exactly berth.json's files. It writes berth.json and berth.sig into a staging directory
// beside the destination (StagingPrefix) and runs Options.Verify on it before fetching any other
// file; then it writes each file through an os.Root, verifying each blob's size and digest while
// it streams, runs checkpoint.ReadManifest and checkpoint.Verify on the result, and renames it into
// place without replacing anything. A failed Pull removes the staging directory: nothing
// unverified is ever at the destination.
//
// References never carry credentials: one that names a user ("user:pass@host/repo:tag") is
// refused (ErrCredentialsInReference), and errors quote references without their user
// information and cut to a sane length (QuoteRef).
//
// What belongs here: the checkpoint's OCI artifact form and moving it to and from a registry.
// What does not: the berth manifest and digests (package oci/checkpoint), the tar form (oci/archive),
// direct node-to-node transfer (oci/transfer), restoring (shim).
package registry
