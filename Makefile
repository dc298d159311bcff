# berth: see README.md. `make demo` runs the main job; `make test` passes the tests.
SHELL := /bin/bash
GO ?= go
OUT := _output
GOTEST_FLAGS ?= -count=1 -timeout 40m

.PHONY: all deps build demo test unit bench vet clean

all: build

## deps: install the real stack (containerd, runc, CRIU, crictl, CNI) into a cached prefix
deps:
	bash test/stack/install.sh

## build: the three binaries into _output/bin
build:
	$(GO) build -o $(OUT)/bin/ ./cmd/...

## demo: two local containerd nodes, an inference workload streaming sessions, moved mid-stream
demo: deps build
	$(GO) run ./test/cmd/berth-demo

## test: every test, integration tests on the real stack included (needs root)
test: deps build vet
	$(GO) test $(GOTEST_FLAGS) ./...

## unit: the tests that need neither root nor the stack
unit:
	BERTH_UNIT_ONLY=1 $(GO) test -count=1 ./...

## bench: benchmarks printing ratios measured in one run
bench: deps build
	$(GO) test -run '^$$' -bench . -benchtime 1x -timeout 60m ./test/e2e/

vet:
	$(GO) vet ./...

clean:
	rm -rf $(OUT)/bin
