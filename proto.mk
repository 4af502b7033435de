# --- proto: generated Go for xds/xdspb (istio.workload, istio.security) ---
# Needs protoc from Debian's protobuf-compiler (apt-get install -y protobuf-compiler) and
# protoc-gen-go pinned below (go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)).
PROTOC ?= protoc
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO ?= $(shell go env GOPATH)/bin/protoc-gen-go
PROTO_DIR := xds/xdspb
PROTO_FILES := $(PROTO_DIR)/workload.proto $(PROTO_DIR)/authorization.proto
PROTO_GEN = $(PROTOC) -I . -I /usr/include --plugin=protoc-gen-go=$(PROTOC_GEN_GO) \
	--go_opt=module=github.com/gozt/gozt

.PHONY: proto proto-check proto-tools
proto-tools:
	@$(PROTOC_GEN_GO) --version 2>/dev/null | grep -q 'protoc-gen-go $(PROTOC_GEN_GO_VERSION)$$' || \
		go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)

proto: proto-tools
	$(PROTO_GEN) --go_out=. $(PROTO_FILES)

# proto-check regenerates into a temp dir and fails if the checked-in code differs.
proto-check: proto-tools
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	$(PROTO_GEN) --go_out=$$tmp $(PROTO_FILES) && \
	for f in $(PROTO_DIR)/workloadpb/workload.pb.go $(PROTO_DIR)/securitypb/authorization.pb.go; do \
		diff -u $$f $$tmp/$$f || { echo "proto-check: $$f is stale; run make proto" >&2; exit 1; }; \
	done
