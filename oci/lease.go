package oci

// AnnotationPauseLease, in the annotations of a task update (containerd's Task.Update with
// WithAnnotations, no resources), gives the task a pause lease: a Go duration ("30s") from now
// after which berth's shim resumes the task if it is still paused, unless the lease was renewed
// (the same update again) or released ("0"). berthctl migrate holds one on its source from
// before the pause until the move is decided, renewing it while it runs, so a move that is
// killed (SIGKILL included) never leaves its source paused for longer than the lease.
const AnnotationPauseLease = "berth.dev/pause-lease"
