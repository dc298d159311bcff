package oci

// Annotations berth reads from an OCI runtime spec (config.json) or a CRI request.
const (
	// AnnotationRestoreFrom names the checkpoint a container is restored from instead of being
	// started fresh: a checkpoint directory (or archive) path, relative to the shim's configured
	// checkpoint root or absolute inside it, or a registry reference
	// oci://HOST[:PORT]/REPOSITORY:TAG (or ...@sha256:HEX) of a registry in the shim's
	// allowed_registries (registry.ParseRestoreFrom). The shim's Create validates it (pulling a
	// reference first); its Start runs CRIU.
	AnnotationRestoreFrom = "berth.dev/restore-from"
)
