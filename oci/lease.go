package oci

// AnnotationPauseLease, in the annotations of a task update (containerd's Task.Update with
// WithAnnotations, no resources), gives the task a pause lease: a Go duration ("30s") from now
// after which berth's shim resumes the task if it is still paused, unless the lease was renewed
// (the same update again) or released ("0"). berthctl migrate holds one on its source from
// before the pause until the move is decided, renewing it while it runs, so a move that is
// killed (SIGKILL included) never leaves its source paused for longer than the lease. A
// checkpoint the shim writes while the lease is held (its image path, or the work path around
// it when the images lie inside it) belongs to the lease's holder: the lease's end removes it
// (its holder died: it holds the task's memory), its release leaves it to the holder.
const AnnotationPauseLease = "berth.dev/pause-lease"

// AnnotationPauseLeaseExpiry, beside AnnotationPauseLease in the same update, says what berth's
// shim does to a task still paused when its lease ends: "resume" (the default: the move that
// paused it died before its destination ran) or "kill" (the move is committed: its destination
// runs the container, so the source must not run too). berthctl migrate switches the lease to
// "kill" the moment the destination's restore succeeded, before it stops the source.
const AnnotationPauseLeaseExpiry = "berth.dev/pause-lease-expiry"

// The values of AnnotationPauseLeaseExpiry.
const (
	PauseLeaseResume = "resume"
	PauseLeaseKill   = "kill"
)
