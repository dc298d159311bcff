// Package node starts and stops local containerd "nodes" for berth's integration tests, benchmarks
// and demo: each node is a real containerd v2.4 with its own root, state, gRPC/ttrpc sockets,
// XDG_RUNTIME_DIR, NRI socket, CNI configuration and berth shim configuration (checkpoint root,
// a signing key of its own, the cluster's keys trusted), on this one machine. It finds the stack that test/stack/install.sh built (containerd, runc, CRIU,
// crictl, CNI plugins) and ends only the processes it started.
//
// StartKube (kube*.go) runs a Kubernetes cluster over such nodes: etcd, kube-apiserver,
// kube-controller-manager and kube-scheduler on loopback, one kubelet per node in the node's own
// mount namespace, cgroup root and CNI bridge, with contrib/kubernetes applied (RuntimeClass
// berth, the berth-nri DaemonSet) and the nodes labelled by Node Feature Discovery from the feature
// file `berthctl labels` writes. Its binaries come from test/stack/k8s.sh (make deps-k8s).
//
// What belongs here: node lifecycle and the paths and clients a test needs to reach a node. What
// does not: images (package image), workloads (test/workload) or berth's own logic.
package node
