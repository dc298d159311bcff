package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// Moving a pod that a ReplicaSet owns (a Deployment's too) without the ReplicaSet scaling up or
// deleting the wrong pod:
//
//  1. the restore pod is created with none of the source's labels (only LabelMoving), so the
//     ReplicaSet, whose selector it does not match, ignores it while it restores: adopted while
//     Pending it would be the first pod deleted as one replica too many;
//  2. once it is Ready, the source pod gets the lowest pod deletion cost
//     (AnnotationDeletionCost), so that of the two the ReplicaSet deletes the source;
//  3. the restore pod gets the source's labels: it matches the selector and has no controller,
//     so the ReplicaSet adopts it (ownerReferences), one replica over, and deletes the source;
//  4. Move deletes the source itself as well (UID precondition), and waits until the
//     ReplicaSet owns the restored pod.
//
// The ReplicaSet never sees fewer pods than it wants, so it never creates one; a move that fails
// before step 3 leaves the source as it was (step 2 is undone).

// LabelMoving marks a restore pod while it is out of its ReplicaSet's sight: the source pod's
// UID.
const LabelMoving = "berth.dev/moving"

// AnnotationDeletionCost is Kubernetes' pod deletion cost, which a ReplicaSet reads when it
// chooses which of its ready pods to delete (the lowest first).
const AnnotationDeletionCost = "controller.kubernetes.io/pod-deletion-cost"

// adoptTimeout bounds the wait for the ReplicaSet to adopt the restored pod.
const adoptTimeout = time.Minute

// adoption is a ReplicaSet that is to adopt a restored pod.
type adoption struct {
	rs *appsv1.ReplicaSet
}

// prepareAdoption checks that the ReplicaSet c that owns src can adopt its restored pod: it
// exists and is not being deleted, and its selector selects src.
func prepareAdoption(ctx context.Context, cs kubernetes.Interface, src *corev1.Pod, c *metav1.OwnerReference) (*adoption, error) {
	rs, err := cs.AppsV1().ReplicaSets(src.Namespace).Get(ctx, c.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("%w: %s/%s: its ReplicaSet %s: %w", ErrOwned, src.Namespace, src.Name, c.Name, err)
	}
	if rs.UID != c.UID || rs.DeletionTimestamp != nil {
		return nil, fmt.Errorf("%w: %s/%s: its ReplicaSet %s is being deleted or replaced", ErrOwned, src.Namespace, src.Name, c.Name)
	}
	sel, err := metav1.LabelSelectorAsSelector(rs.Spec.Selector)
	if err != nil || !sel.Matches(labels.Set(src.Labels)) {
		return nil, fmt.Errorf("%w: %s/%s: the selector of its ReplicaSet %s does not select it (%v)", ErrOwned, src.Namespace, src.Name, c.Name, err)
	}
	if sel.Matches(labels.Set{LabelMoving: string(src.UID)}) {
		return nil, fmt.Errorf("%w: %s/%s: the selector of its ReplicaSet %s selects every pod", ErrOwned, src.Namespace, src.Name, c.Name)
	}
	return &adoption{rs: rs}, nil
}

// handOver gives the Ready restored pod to the ReplicaSet in place of src (steps 2 to 4 above)
// and waits until the ReplicaSet owns it. committed reports whether the restored pod got the
// source's labels: from then on the ReplicaSet may delete the source, so the restored pod must
// stay whatever the error. On an error before, src's deletion cost is put back.
func (a *adoption) handOver(ctx context.Context, cs kubernetes.Interface, src, restored *corev1.Pod) (committed bool, retErr error) {
	pods := cs.CoreV1().Pods(src.Namespace)
	old, hadCost := src.Annotations[AnnotationDeletionCost]
	if err := patchMeta(ctx, cs, src, nil, map[string]*string{AnnotationDeletionCost: ptr(strconv.Itoa(math.MinInt32))}); err != nil {
		return false, fmt.Errorf("mark source pod %s/%s to be deleted first: %w", src.Namespace, src.Name, err)
	}
	defer func() {
		if retErr != nil && !committed {
			var back *string
			if hadCost {
				back = &old
			}
			_ = patchMeta(context.WithoutCancel(ctx), cs, src, nil, map[string]*string{AnnotationDeletionCost: back})
		}
	}()
	want := map[string]*string{LabelMoving: nil}
	for k, v := range src.Labels {
		want[k] = ptr(v)
	}
	var cost map[string]*string
	if hadCost {
		cost = map[string]*string{AnnotationDeletionCost: &old}
	}
	if err := patchMeta(ctx, cs, restored, want, cost); err != nil {
		return false, fmt.Errorf("give restore pod %s/%s the labels of %s: %w", restored.Namespace, restored.Name, src.Name, err)
	}
	committed = true
	uid := src.UID
	if err := pods.Delete(ctx, src.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}}); err != nil && !apierrors.IsNotFound(err) {
		return true, fmt.Errorf("restored as %s/%s, but deleting the source pod failed (delete it): %w", restored.Namespace, restored.Name, err)
	}
	deadline := time.Now().Add(adoptTimeout)
	for {
		p, err := pods.Get(ctx, restored.Name, metav1.GetOptions{})
		if err == nil {
			if c := metav1.GetControllerOf(p); c != nil && c.UID == a.rs.UID {
				return true, nil
			}
		}
		if time.Now().After(deadline) {
			return true, fmt.Errorf("restored as %s/%s, but ReplicaSet %s did not adopt it within %s (%v)", restored.Namespace, restored.Name, a.rs.Name, adoptTimeout, err)
		}
		select {
		case <-ctx.Done():
			return true, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// patchMeta merge-patches p's labels and annotations (a nil value removes the key), with p's
// resourceVersion unchecked.
func patchMeta(ctx context.Context, cs kubernetes.Interface, p *corev1.Pod, lbls, anns map[string]*string) error {
	meta := map[string]any{}
	if lbls != nil {
		meta["labels"] = lbls
	}
	if anns != nil {
		meta["annotations"] = anns
	}
	b, err := json.Marshal(map[string]any{"metadata": meta})
	if err != nil {
		return err
	}
	_, err = cs.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, b, metav1.PatchOptions{})
	return err
}

func ptr(s string) *string { return &s }
