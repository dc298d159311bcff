# berth: see README.md. `make demo` runs the main job; `make test` passes the tests.
SHELL := /bin/bash
GO ?= go
OUT := _output
# runc's seccomp code (libcontainer/seccomp, cgo over libseccomp, which make deps installs) is
# compiled only with this tag: berth-shim-helper compiles a pod's seccomp profile with it to
# compare a checkpoint's filters (oci/privilege/seccompload). Every go command of this file, and
# the tests' own builds (test/node), inherit it.
export GOFLAGS := -tags=seccomp
GOTEST_FLAGS ?= -count=1 -timeout 40m
# staticcheck (honnef.co/go/tools): built from the Go module proxy into the per-user cache the
# stack uses (BERTH_CACHE), one directory per version, so a version change installs the new one
# and every clone shares an unchanged one.
BERTH_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/berth
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(BERTH_CACHE)/tools/staticcheck-$(STATICCHECK_VERSION)/staticcheck

.PHONY: all deps deps-k8s build demo demo-k8s test bench vet lint clean gpu-check-bundle

all: build

## deps: install the real stack (containerd, runc, CRIU, crictl, CNI, nerdctl) into a cached prefix
deps:
	bash test/stack/install.sh

## deps-k8s: etcd and the Kubernetes binaries (kube-apiserver, kube-controller-manager,
## kube-scheduler, kubelet, kubectl) built from Go modules into a cached prefix, linked at
## _output/kube, for the cluster tests; a cold build takes 10-15 minutes on 2 cores, a warm one
## nothing. make demo does not need it.
deps-k8s:
	bash test/stack/k8s.sh

## build: containerd-shim-berth-v2, berth-shim-helper, berthctl, berth-nri into _output/bin, and kubectl-berth
## (berthctl as a kubectl plugin: `kubectl berth move`)
build:
	$(GO) build -o $(OUT)/bin/ ./cmd/...
	ln -sf berthctl $(OUT)/bin/kubectl-berth

## demo: two local containerd nodes, an inference workload streaming sessions, moved mid-stream
demo: deps build
	PATH="$(CURDIR)/$(OUT)/stack/bin:$$PATH" $(GO) run ./test/cmd/berth-demo $(DEMO_ARGS)

## demo-k8s: the same move on a real two-node Kubernetes cluster: a RuntimeClass berth pod
## streaming sessions, `kubectl berth move` mid-stream to the other node
demo-k8s: deps deps-k8s build
	PATH="$(CURDIR)/$(OUT)/stack/bin:$$PATH" $(GO) run ./test/cmd/berth-demo-k8s

## test: go vet, staticcheck and every test, integration tests on the real stack included (needs root)
test: deps deps-k8s build vet lint
	PATH="$(CURDIR)/$(OUT)/stack/bin:$$PATH" $(GO) test $(GOTEST_FLAGS) ./...

## bench: benchmarks printing ratios measured in one run
bench: deps deps-k8s build
	$(GO) test -run '^$$' -bench . -benchtime 1x -timeout 60m ./test/e2e/

## gpu-check-bundle: binaries and script for a real NVIDIA machine (test/gpu-check/README.md)
gpu-check-bundle:
	mkdir -p $(OUT)/gpu-check
	CGO_ENABLED=1 $(GO) build -trimpath -o $(OUT)/gpu-check/ ./test/gpu-check/cmd/gpucheck ./cmd/berthctl ./cmd/berth-shim-helper
	cp test/gpu-check/run.sh test/gpu-check/workload.py $(OUT)/gpu-check/
	tar -C $(OUT) -czf $(OUT)/gpu-check.tar.gz gpu-check

vet:
	$(GO) vet ./...

## lint: staticcheck over every package, tests included (a staticcheck.conf may turn a check off
## only with the reason written beside it)
lint: $(STATICCHECK)
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(STATICCHECK) ./...

$(STATICCHECK):
	GOBIN=$(dir $@) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

clean:
	rm -rf $(OUT)/bin
