#!/usr/bin/env bash
# k8s.sh: builds the Kubernetes control plane and node binaries the cluster tests run (test/node
# kube*.go) from Go modules into a per-user cache keyed by the versions below, and links it at
# $REPO/_output/kube. Idempotent: a binary already built (and reporting the right version) is kept,
# so a warm run costs nothing. `make demo` does not need any of it.
#
#   etcd, etcdctl                           go.etcd.io/etcd/{server,etcdctl}/v3
#   kube-apiserver, kube-controller-manager,
#   kube-scheduler, kubelet, kubectl        k8s.io/kubernetes/cmd/...
#   nfd-master, nfd-worker (and NFD's CRDs) sigs.k8s.io/node-feature-discovery/cmd/...
#
# `go install pkg@version` refuses both: their go.mod files carry replace directives (etcd's point
# at ../api and friends, Kubernetes' at ./staging/src/k8s.io/*). So each is built from a wrapper
# module generated under the cache (never in the repository's go.mod): etcd's requires the server
# and etcdctl modules; Kubernetes' requires k8s.io/kubernetes and replaces every staging module it
# requires with the published k8s.io/<name> v0.<minor>.<patch>; Node Feature Discovery's takes
# NFD's own replacements (it pins an older Kubernetes) and the published api/nfd module.
#
# Cold build: about 10-15 minutes on 2 cores (the kubelet pays for most shared dependencies);
# run at a low priority (nice) so that it shares the machine. Environment: BERTH_CACHE as for
# install.sh; BERTH_NICE (default 10).
set -euo pipefail

KUBE_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
NFD_VERSION=v0.18.3

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${BERTH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth}
PREFIX=$CACHE/kube-$KUBE_VERSION.etcd-$ETCD_VERSION
BUILD=$PREFIX/build
NICE=(nice -n "${BERTH_NICE:-10}")
log() { printf '[deps-k8s] %s\n' "$*" >&2; }
mkdir -p "$PREFIX/bin" "$REPO/_output"
ln -sfn "$PREFIX" "$REPO/_output/kube"
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOWORK=off GOTOOLCHAIN=local

# have NAME VERSION [ARGS...]: the binary is there and reports VERSION when run with ARGS
# (default --version); the output is read whole (grep -q on a pipe would end it early: SIGPIPE)
have() {
  local b=$PREFIX/bin/$1 v=${2#v} out; shift 2
  [ -x "$b" ] || return 1
  out=$("$b" "${@:---version}" 2>/dev/null) || return 1
  [[ $out == *"$v"* ]]
}

KUBE_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
need_kube=()
for b in "${KUBE_BINS[@]}"; do
  args=(--version)
  [ "$b" = kubectl ] && args=(version --client)
  have "$b" "$KUBE_VERSION" "${args[@]}" || need_kube+=("$b")
done

# --- etcd
if ! have etcd "$ETCD_VERSION" || ! have etcdctl "$ETCD_VERSION" version; then
  W=$BUILD/etcd; mkdir -p "$W"
  cat > "$W/go.mod" <<EOT
module berth.local/kubebuild/etcd

go 1.26.0

require (
	go.etcd.io/etcd/etcdctl/v3 $ETCD_VERSION
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
)
EOT
  cat > "$W/tools.go" <<'EOT'
//go:build tools

// Package tools pins the etcd commands this wrapper module builds.
package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
EOT
  log "etcd $ETCD_VERSION: wrapper module in $W"
  (cd "$W" && go mod tidy)
  for p in server/v3:etcd etcdctl/v3:etcdctl; do
    s=$SECONDS
    (cd "$W" && "${NICE[@]}" go build -trimpath -ldflags "-s -w" -o "$PREFIX/bin/${p#*:}.new" "go.etcd.io/etcd/${p%:*}")
    mv "$PREFIX/bin/${p#*:}.new" "$PREFIX/bin/${p#*:}"
    log "built ${p#*:} in $((SECONDS - s)) s"
  done
fi

# --- Kubernetes
if [ ${#need_kube[@]} -gt 0 ]; then
  W=$BUILD/kubernetes; mkdir -p "$W"
  STAGING=v0.${KUBE_VERSION#v1.}   # v1.37.2 -> v0.37.2
  (cd / && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" >/dev/null)
  MOD=$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/$KUBE_VERSION.mod
  # replace the staging modules that k8s.io/kubernetes requires (at v0.0.0) with their published
  # versions; staging modules it does not require need no replacement
  required=$(awk '/^require \(/{r=1; next} r && /^\)/{r=0} r && $1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$MOD" | sort -u)
  repl=""
  for m in $(awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print $1}' "$MOD" | sort -u); do
    grep -qx "$m" <<<"$required" && repl+="	$m => $m $STAGING"$'\n'
  done
  [ -n "$repl" ] || { echo "k8s.sh: no staging modules found in $MOD" >&2; exit 1; }
  cat > "$W/go.mod" <<EOT
module berth.local/kubebuild/kubernetes

go $(awk '/^go /{print $2; exit}' "$MOD")

require k8s.io/kubernetes $KUBE_VERSION

replace (
$repl)
EOT
  {
    printf '//go:build tools\n\n// Package tools pins the Kubernetes commands this wrapper module builds.\npackage tools\n\nimport (\n'
    for b in "${KUBE_BINS[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$b"; done
    printf ')\n'
  } > "$W/tools.go"
  log "Kubernetes $KUBE_VERSION: wrapper module in $W ($(grep -c '=>' "$W/go.mod") staging modules replaced)"
  (cd "$W" && go mod tidy)
  V=${KUBE_VERSION#v}; MAJ=${V%%.*}; MIN=${V#*.}; MIN=${MIN%%.*}
  LD="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=$MAJ"
  LD+=" -X k8s.io/component-base/version.gitMinor=$MIN -X k8s.io/component-base/version.gitTreeState=clean"
  LD+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  # the kubelet first: it builds most of what the others share
  for b in kubelet kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    printf '%s\n' "${need_kube[@]}" | grep -qx "$b" || continue
    s=$SECONDS
    (cd "$W" && "${NICE[@]}" go build -trimpath -ldflags "$LD" -o "$PREFIX/bin/$b.new" "k8s.io/kubernetes/cmd/$b")
    mv "$PREFIX/bin/$b.new" "$PREFIX/bin/$b"
    log "built $b in $((SECONDS - s)) s"
  done
fi
# --- Node Feature Discovery (labels nodes from berthctl labels' feature file in the cluster tests);
# not in the prefix's name: added beside the binaries above, rebuilt when its version changes
if ! have nfd-master "$NFD_VERSION" -version || ! have nfd-worker "$NFD_VERSION" -version || [ ! -s "$PREFIX/share/nfd-api-crds.yaml" ]; then
  W=$BUILD/nfd; mkdir -p "$W" "$PREFIX/share"
  (cd / && go mod download -json "sigs.k8s.io/node-feature-discovery@$NFD_VERSION" >/dev/null)
  MODDIR=$(go env GOMODCACHE)/sigs.k8s.io/node-feature-discovery@$NFD_VERSION
  # NFD's own replacements of the Kubernetes staging modules; its ./api/nfd by the published module
  repl=$(awk '/^replace \(/{r=1; next} r && /^\)/{r=0} r && $1 ~ /^k8s\.io\// && $2 == "=>" {print "\t" $0}' "$MODDIR/go.mod")
  [ -n "$repl" ] || { echo "k8s.sh: no replacements found in $MODDIR/go.mod" >&2; exit 1; }
  cat > "$W/go.mod" <<EOT
module berth.local/kubebuild/nfd

go $(awk '/^go /{print $2; exit}' "$MODDIR/go.mod")

require sigs.k8s.io/node-feature-discovery $NFD_VERSION

replace (
$repl
	sigs.k8s.io/node-feature-discovery/api/nfd => sigs.k8s.io/node-feature-discovery/api/nfd $NFD_VERSION
)
EOT
  printf '//go:build tools\n\n// Package tools pins the NFD commands this wrapper module builds.\npackage tools\n\nimport (\n\t_ "sigs.k8s.io/node-feature-discovery/cmd/nfd-master"\n\t_ "sigs.k8s.io/node-feature-discovery/cmd/nfd-worker"\n)\n' > "$W/tools.go"
  log "Node Feature Discovery $NFD_VERSION: wrapper module in $W"
  (cd "$W" && go mod tidy)
  for b in nfd-master nfd-worker; do
    s=$SECONDS
    (cd "$W" && "${NICE[@]}" go build -trimpath -ldflags "-s -w -X sigs.k8s.io/node-feature-discovery/pkg/version.version=$NFD_VERSION" \
      -o "$PREFIX/bin/$b.new" "sigs.k8s.io/node-feature-discovery/cmd/$b")
    mv "$PREFIX/bin/$b.new" "$PREFIX/bin/$b"
    log "built $b in $((SECONDS - s)) s"
  done
  install -m 0644 "$MODDIR/deployment/base/nfd-crds/nfd-api-crds.yaml" "$PREFIX/share/nfd-api-crds.yaml"
fi
log "Kubernetes $KUBE_VERSION, etcd $ETCD_VERSION and NFD $NFD_VERSION ready in $PREFIX (linked at _output/kube)"
