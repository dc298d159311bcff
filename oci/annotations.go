package oci

// Annotations berth reads from an OCI runtime spec (config.json) or a CRI request.
const (
	// AnnotationRestoreFrom names the checkpoint a container is restored from instead of being
	// started fresh: a checkpoint directory (or archive) path, relative to the shim's configured
	// checkpoint root or absolute inside it. The shim's Create validates it; its Start runs CRIU.
	AnnotationRestoreFrom = "berth.dev/restore-from"
)
