# --- proto: generated Go for xds/xdspb (istio.workload, istio.security, delta ADS),
# identity/ca/capb (Istio's CA API) and inpod/zdspb (istio.workload.zds, the in-pod ZDS API) ---
# Needs protoc from Debian's protobuf-compiler (apt-get install -y protobuf-compiler) and the
# plugins pinned below (go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION),
# go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)).
# xds/xdspb/include holds google/rpc/status.proto, which Debian's /usr/include lacks; its Go
# type comes from genproto, so it is an include only and is never generated.
PROTOC ?= protoc
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.5.1
PROTOC_GEN_GO ?= $(shell go env GOPATH)/bin/protoc-gen-go
PROTOC_GEN_GO_GRPC ?= $(shell go env GOPATH)/bin/protoc-gen-go-grpc
PROTO_DIR := xds/xdspb
PROTO_FILES := $(PROTO_DIR)/workload.proto $(PROTO_DIR)/authorization.proto \
	$(PROTO_DIR)/node.proto $(PROTO_DIR)/discovery.proto identity/ca/capb/ca.proto \
	inpod/zdspb/zds.proto
PROTO_GRPC_FILES := $(PROTO_DIR)/discovery.proto identity/ca/capb/ca.proto
PROTO_OUT := $(PROTO_DIR)/workloadpb/workload.pb.go $(PROTO_DIR)/securitypb/authorization.pb.go \
	$(PROTO_DIR)/discoverypb/node.pb.go $(PROTO_DIR)/discoverypb/discovery.pb.go \
	$(PROTO_DIR)/discoverypb/discovery_grpc.pb.go \
	identity/ca/capb/ca.pb.go identity/ca/capb/ca_grpc.pb.go inpod/zdspb/zds.pb.go
PROTO_GEN = $(PROTOC) -I . -I $(PROTO_DIR)/include -I /usr/include \
	--plugin=protoc-gen-go=$(PROTOC_GEN_GO) --plugin=protoc-gen-go-grpc=$(PROTOC_GEN_GO_GRPC) \
	--go_opt=module=github.com/gozt/gozt --go-grpc_opt=module=github.com/gozt/gozt

.PHONY: proto proto-check proto-tools
proto-tools:
	@$(PROTOC_GEN_GO) --version 2>/dev/null | grep -q 'protoc-gen-go $(PROTOC_GEN_GO_VERSION)$$' || \
		go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	@$(PROTOC_GEN_GO_GRPC) --version 2>/dev/null | grep -q 'protoc-gen-go-grpc $(PROTOC_GEN_GO_GRPC_VERSION:v%=%)$$' || \
		go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

proto: proto-tools
	$(PROTO_GEN) --go_out=. $(PROTO_FILES)
	$(PROTO_GEN) --go-grpc_out=. $(PROTO_GRPC_FILES)

# proto-check regenerates into a temp dir and fails if the checked-in code differs.
proto-check: proto-tools
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	$(PROTO_GEN) --go_out=$$tmp $(PROTO_FILES) && \
	$(PROTO_GEN) --go-grpc_out=$$tmp $(PROTO_GRPC_FILES) && \
	for f in $(PROTO_OUT); do \
		diff -u $$f $$tmp/$$f || { echo "proto-check: $$f is stale; run make proto" >&2; exit 1; }; \
	done
