#!/usr/bin/env bash
# install.sh: installs the real stack berth is tested against into a per-user cache keyed by the
# versions below, and links it at $REPO/_output/stack. Idempotent: a part already built is kept.
#
#   containerd, ctr, containerd-shim-runc-v2   Go module proxy
#   runc (cgo, seccomp)                        Go module proxy + libseccomp-dev
#   crictl, checkpointctl, CNI plugins         Go module proxy
#   nerdctl (its module, one file removed)     Go module proxy
#   cosign (verifies pushed checkpoints)       Go module proxy
#   CRIU (newest >= 4.2 in Debian's source archive; suites sid and experimental)
#
# The Debian mirror is read from this machine's apt sources; no host name is written here.
# Environment: BERTH_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/berth).
set -euo pipefail

CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3
CRICTL_VERSION=v1.37.0
CNI_VERSION=v1.10.0
CHECKPOINTCTL_VERSION=v1.6.0
CRIU_MIN=4.2

REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${BERTH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth}
KEY="ctrd-$CONTAINERD_VERSION.runc-$RUNC_VERSION.crictl-$CRICTL_VERSION.cni-$CNI_VERSION.cpctl-$CHECKPOINTCTL_VERSION"
PREFIX=$CACHE/stack-$KEY
mkdir -p "$PREFIX/bin" "$PREFIX/cni/bin" "$REPO/_output"
ln -sfn "$PREFIX" "$REPO/_output/stack"
export GOBIN=$PREFIX/bin GOFLAGS=-mod=mod
log() { printf '[deps] %s\n' "$*" >&2; }

# --- Debian packages: CRIU build deps, iptables (CRIU's network lock), busybox-static and
# redis-server (test images), libseccomp-dev (runc), bc/curl for scripts.
APT_PKGS="build-essential pkg-config libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev
 libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev
 python3-protobuf libaio-dev iptables busybox-static libseccomp-dev redis-server redis-tools
 xz-utils curl iproute2 dpkg-dev"
missing=""
for p in $APT_PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"; done
if [ -n "$missing" ]; then
  log "apt-get install$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
  # a system redis-server must not hold port 6379 or disk: the tests start their own in containers
  if command -v systemctl >/dev/null && systemctl is-active -q redis-server 2>/dev/null; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
fi

# --- Go-built parts
gobuild() { # name pkg@version
  if [ -x "$PREFIX/bin/$1" ]; then return; fi
  log "go install $2"; go install "$2"
}
gobuild containerd github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION &
gobuild ctr github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION &
wait
gobuild containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION
# runc with seccomp (cgo, libseccomp-dev): the kubelet asks for the RuntimeDefault seccomp profile for
# every sandbox, and a runc without it fails every such container ("seccomp not supported"). A runc
# built earlier without the tag (it prints no libseccomp line) is rebuilt.
if [ -x "$PREFIX/bin/runc" ] && ! "$PREFIX/bin/runc" --version 2>/dev/null | grep -q '^libseccomp:'; then
  log "runc was built without seccomp: rebuilding"; rm -f "$PREFIX/bin/runc"
fi
[ -x "$PREFIX/bin/runc" ] || { log "go install -tags seccomp runc@$RUNC_VERSION"; CGO_ENABLED=1 go install -tags seccomp github.com/opencontainers/runc@$RUNC_VERSION; }
gobuild crictl sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION
gobuild checkpointctl github.com/checkpoint-restore/checkpointctl@$CHECKPOINTCTL_VERSION
# the CNCF distribution registry: the loopback registry of the oci/registry tests (not in KEY: kept if present)
REGISTRY_VERSION=v3.1.2; gobuild registry github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION
for p in main/bridge ipam/host-local main/loopback meta/portmap; do
  b=${p##*/}
  [ -x "$PREFIX/cni/bin/$b" ] || { log "go install CNI $b"; GOBIN=$PREFIX/cni/bin go install github.com/containernetworking/plugins/plugins/$p@$CNI_VERSION; }
done

# --- nerdctl (users name it beside ctr; the e2e test of its checkpoint commands on berth). `go install
# nerdctl@v` is refused (the proxy does not serve its version list), and as a module it does not build:
# its non-test file cmd/nerdctl/helpers/testing_linux.go imports tigron, a nested module reachable only
# through a `replace ./mod/tigron` that the module zip lacks. So: fetch the module, copy it, drop that one
# file and the replace, build. Not in KEY: kept if present (a different version is rebuilt).
NERDCTL_VERSION=v2.2.2
if ! { [ -x "$PREFIX/bin/nerdctl" ] && [ "$(cat "$PREFIX/bin/.nerdctl-version" 2>/dev/null)" = "$NERDCTL_VERSION" ]; }; then
  log "nerdctl $NERDCTL_VERSION from its module (patched: one non-test file removed)"
  NB=$CACHE/nerdctl-build; rm -rf "$NB/src"; mkdir -p "$NB/mod"
  ( cd "$NB/mod" && { [ -f go.mod ] || go mod init berth.local/nerdctlbuild >/dev/null 2>&1; } &&
    GONOSUMDB=github.com/containerd GOFLAGS=-mod=mod go get "github.com/containerd/nerdctl/v2@$NERDCTL_VERSION" >/dev/null 2>&1 ) ||
    { echo "install.sh: go get nerdctl $NERDCTL_VERSION failed" >&2; exit 1; }
  cp -r "$(go env GOMODCACHE)/github.com/containerd/nerdctl/v2@$NERDCTL_VERSION" "$NB/src" && chmod -R u+w "$NB/src"
  rm -f "$NB/src/cmd/nerdctl/helpers/testing_linux.go" && sed -i '/mod\/tigron/d' "$NB/src/go.mod"
  ( cd "$NB/src" && GONOSUMDB=github.com/containerd GOFLAGS=-mod=mod GOBIN= go build -o "$PREFIX/bin/nerdctl" ./cmd/nerdctl ) ||
    { echo "install.sh: nerdctl build failed" >&2; exit 1; }
  echo "$NERDCTL_VERSION" > "$PREFIX/bin/.nerdctl-version"; rm -rf "$NB/src"
fi

# --- cosign: the e2e tests verify a pushed checkpoint's signature with it. Built outside the module
# (cosign's own go.mod decides its dependencies) into a directory per version, linked into the stack.
COSIGN_VERSION=v3.1.3
COSIGN_DIR=$CACHE/tools/cosign-$COSIGN_VERSION
if [ ! -x "$COSIGN_DIR/cosign" ]; then
  log "go install cosign $COSIGN_VERSION (a few minutes, once)"
  ( cd /tmp && GOBIN=$COSIGN_DIR CGO_ENABLED=0 go install "github.com/sigstore/cosign/v3/cmd/cosign@$COSIGN_VERSION" ) ||
    { echo "install.sh: go install cosign $COSIGN_VERSION failed" >&2; exit 1; }
fi
ln -sfn "$COSIGN_DIR/cosign" "$PREFIX/bin/cosign"

# --- CRIU from Debian's source archive
if ! { [ -x "$PREFIX/bin/criu" ] && "$PREFIX/bin/criu" --version >/dev/null 2>&1; }; then
  mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || { echo "install.sh: no Debian mirror found in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list" >&2; exit 1; }
  A=$CACHE/apt; mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$CACHE/criu-src"
  printf 'deb-src %s sid main\ndeb-src %s experimental main\n' "$mirror" "$mirror" > "$A/sources.list"
  APTS=(-o Dir::Etc::sourcelist="$A/sources.list" -o Dir::Etc::sourceparts=- -o Dir::State::Lists="$A/lists"
        -o Dir::Cache="$A/cache" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)
  apt-get "${APTS[@]}" update -qq 2>&1 | grep -v "^W: Download is performed unsandboxed" >&2 || true
  # newest first; a version whose tarball the mirror does not serve (404) is skipped
  versions=$(apt-cache "${APTS[@]}" showsrc criu 2>/dev/null | awk '/^Version:/{print $2}' | sort -Vr | uniq)
  [ -n "$versions" ] || { echo "install.sh: Debian's source archive offers no criu" >&2; exit 1; }
  cd "$CACHE/criu-src"
  tarball=""
  for ver in $versions; do
    upstream=${ver%%-*}; upstream=${upstream#*:}
    if [ "$(printf '%s\n%s\n' "$CRIU_MIN" "$upstream" | sort -V | head -1)" != "$CRIU_MIN" ]; then continue; fi
    # apt verifies what it downloads against the signed Sources index; only the upstream tarball is needed
    apt-get "${APTS[@]}" source --download-only "criu=$ver" >/dev/null 2>&1 || true
    tarball=$(ls criu_"$upstream".orig.tar.* 2>/dev/null | head -1 || true)
    if [ -n "$tarball" ]; then log "CRIU $ver from Debian's source archive"; break; fi
    log "CRIU $ver: the mirror does not serve its tarball, trying an older one"
  done
  [ -n "$tarball" ] || { echo "install.sh: no criu >= $CRIU_MIN could be downloaded from Debian's source archive (offered: $(echo $versions))" >&2; exit 1; }
  rm -rf "criu-$upstream" && tar xf "$tarball"
  make -s -C "criu-$upstream" -j"$(nproc)" criu >"$CACHE/criu-build.log" 2>&1 || { tail -30 "$CACHE/criu-build.log" >&2; exit 1; }
  install -m 0755 "criu-$upstream/criu/criu" "$PREFIX/bin/criu"
fi
"$PREFIX/bin/criu" --version | head -1 >&2
log "stack ready in $PREFIX (linked at _output/stack)"
