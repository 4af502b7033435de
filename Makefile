# gozt: one gate (`make check`), one main job (`make run`), one test command (`make test`).
GO        ?= go
BIN       := bin
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X main.version=$(VERSION)
GOBIN     := $(shell $(GO) env GOPATH)/bin
STATICCHECK_VERSION := v0.8.2
RUN_DIR   ?= .tmp/run

.PHONY: all build image helm kube-apiserver kubectl istio-tools spire-tools hbone-control xdscontrol otelcol bench-victim coredns cluster-tools cluster-tools-extra cluster-images cluster-up cluster-check cluster-migrate cluster-migrate-run cluster-drills cluster-bench cluster-down cluster-load cluster-rss manifests chart-check k8s-check run demo demo-inpod test test-norace alloc-names check fmt-check vet staticcheck tidy-check bench bench-go bench-smoke proto proto-check clean soak soak-slice fuzz test-ktls ktls-check interop-rs bench-scale bench-pods bench-conns

all: build

# CGO_ENABLED=0: a static pure-Go binary (no libc mapped: 1.7 MB less RSS per node, and it
# runs in a distroless image). grpcnotrace: gRPC leaves out golang.org/x/net/trace, whose
# html/template calls reflect's MethodByName, which makes the linker keep every exported
# method of every type in the binary (2.9 MB of code, 2.1 MiB RSS per node).
TAGS      := grpcnotrace

# FIPS=1: the FIPS 140-3 build (docs/CONFIGURATION.md, "FIPS 140-3"). GOFIPS140 links the
# frozen Go Cryptographic Module FIPS_MODULE (v1.0.0: CMVP certificate #5247) and makes
# fips140=on the binary's default GODEBUG, which the binary refuses to run without; kernel
# TLS is off. The binary is bin/ztunnel-fips, the image's tag ends in -fips (mkimage checks
# it) and its label gozt.fips140 names the module.
FIPS_MODULE ?= v1.0.0
ifeq ($(FIPS),1)
FIPS_ENV    := GOFIPS140=$(FIPS_MODULE)
FIPS_SUFFIX := -fips
endif

build:
	CGO_ENABLED=0 $(FIPS_ENV) $(GO) build -tags $(TAGS) -ldflags "$(LDFLAGS)" -o $(BIN)/ztunnel$(FIPS_SUFFIX) ./cmd/ztunnel
	$(GO) build -o $(BIN)/zbench ./cmd/zbench

# The container image, without a Docker daemon: the static binary alone, uid 0 gid 1337 as
# Istio's ztunnel chart runs it. Reproducible: the same commit gives the same digest
# (-trimpath, fixed timestamps). Writes $(IMAGE_DIR)/oci (OCI layout: umoci, skopeo, crane)
# and $(IMAGE_DIR)/ztunnel.tar (docker load / podman load). FIPS=1: the FIPS 140-3 image,
# gozt/ztunnel:$(VERSION)-fips in .tmp/image-fips.
IMAGE     ?= gozt/ztunnel:$(VERSION)$(FIPS_SUFFIX)
IMAGE_DIR ?= .tmp/image$(FIPS_SUFFIX)
image:
	CGO_ENABLED=0 $(FIPS_ENV) $(GO) build -trimpath -tags $(TAGS) -ldflags "$(LDFLAGS)" -o $(BIN)/image$(FIPS_SUFFIX)/ztunnel ./cmd/ztunnel
	$(GO) run ./cmd/mkimage -bin $(BIN)/image$(FIPS_SUFFIX)/ztunnel -tag $(IMAGE) -arch $$($(GO) env GOARCH) -out $(IMAGE_DIR)

# The Helm chart (deploy/charts/ztunnel, Istio's ztunnel chart's values): helm lint, a render
# checked against Istio's DaemonSet, and deploy/manifests/ztunnel.yaml compared with the
# chart's output. tools/helm is a module of its own, so helm's Kubernetes dependencies stay
# out of go.mod; the first build takes about 3 minutes, the Go build cache makes later runs
# take seconds.
chart-check:
	cd tools/helm && $(GO) test ./...

# Regenerates deploy/manifests/ztunnel.yaml from the chart.
manifests:
	cd tools/helm && $(GO) test -run TestManifests . -update

# The helm command, into .tools/ (git-ignored), rebuilt when tools/helm's module changes.
helm: .tools/helm
.tools/helm: tools/helm/go.mod tools/helm/go.sum
	cd tools/helm && $(GO) build -o ../../$@ helm.sh/helm/v3/cmd/helm

# kube-apiserver and kubectl of one Kubernetes release, into .tools/, rebuilt when tools/k8s's
# module changes: a module of its own (k8s.io/kubernetes with its staging replace block) so
# Kubernetes stays out of go.mod. The first build takes about 6 minutes on 2 idle cores;
# with the Go build cache warm, linking both takes under a minute.
K8S_VERSION = $(shell cd tools/k8s && $(GO) list -m -f '{{.Version}}' k8s.io/kubernetes)
K8S_LDFLAGS = -s -w -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) -X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION)
kube-apiserver: .tools/kube-apiserver
kubectl: .tools/kubectl
.tools/kube-apiserver .tools/kubectl: tools/k8s/go.mod tools/k8s/go.sum
	cd tools/k8s && $(GO) build -trimpath -ldflags "$(K8S_LDFLAGS)" -o ../../$@ k8s.io/kubernetes/cmd/$(notdir $@)

# The rest of one Kubernetes release for make cluster-up (same module, same version): the
# controller manager, the scheduler, the kubelet and kube-proxy.
K8S_NODE_TOOLS := .tools/kube-controller-manager .tools/kube-scheduler .tools/kubelet .tools/kube-proxy
$(K8S_NODE_TOOLS): tools/k8s/go.mod tools/k8s/go.sum
	cd tools/k8s && $(GO) build -trimpath -ldflags "$(K8S_LDFLAGS)" -o ../../$@ k8s.io/kubernetes/cmd/$(notdir $@)

# Istio's binaries from the istio.io/istio module pinned in tools/istio (the one place its
# version is set): istiod's pilot-discovery, istio-cni's install-cni and CNI plugin, istioctl.
# Istio's Helm charts are that module's manifests/charts, read from the module cache.
ISTIO_MOD     = $(shell cd tools/istio && $(GO) list -m -f '{{.Version}}' istio.io/istio)
ISTIO_DIR     = $(shell cd tools/istio && $(GO) list -m -f '{{.Dir}}' istio.io/istio)
ISTIO_VERSION = $(shell cat $(ISTIO_DIR)/VERSION)-dev
ISTIO_LDFLAGS = -s -w -X istio.io/istio/pkg/version.buildVersion=$(ISTIO_VERSION) -X istio.io/istio/pkg/version.buildGitRevision=$(ISTIO_MOD) -X istio.io/istio/pkg/version.buildStatus=Clean -X istio.io/istio/pkg/version.buildTag=$(ISTIO_VERSION) -X istio.io/istio/pkg/version.buildHub=localhost/istio
ISTIO_TOOLS := .tools/pilot-discovery .tools/install-cni .tools/istio-cni .tools/istioctl
.tools/pilot-discovery: PKG = pilot/cmd/pilot-discovery
.tools/install-cni: PKG = cni/cmd/install-cni
.tools/istio-cni: PKG = cni/cmd/istio-cni
.tools/istioctl: PKG = istioctl/cmd/istioctl
$(ISTIO_TOOLS): tools/istio/go.mod tools/istio/go.sum
	cd tools/istio && CGO_ENABLED=0 $(GO) build -trimpath -tags vtprotobuf,disable_pgv -ldflags "$(ISTIO_LDFLAGS)" -o ../../$@ istio.io/istio/$(PKG)
istio-tools: $(ISTIO_TOOLS)

# The open-streams flood's control (issue 50): Istio's own Go HBONE server over mTLS, which
# proxy's BenchmarkVictimOpenStreams aims the same attack at. bench-victim runs that
# benchmark with it, VICTIM_COUNT times.
VICTIM_COUNT ?= 3
.tools/hbonecontrol: tools/istio/go.mod tools/istio/go.sum tools/istio/hbonecontrol/main.go
	cd tools/istio && CGO_ENABLED=0 $(GO) build -trimpath -o ../../$@ ./hbonecontrol
hbone-control: .tools/hbonecontrol
bench-victim: .tools/hbonecontrol
	HBONE_CONTROL=$(CURDIR)/.tools/hbonecontrol $(GO) test -run '^$$' -bench '^BenchmarkVictimOpenStreams$$' -benchtime 3000x -count $(VICTIM_COUNT) ./proxy/

# The OpenTelemetry Collector for the OTLP export's tests (metrics/otlp, cmd/ztunnel): its own
# OTLP receiver, bearer-token auth and file exporter, from the modules pinned in tools/otelcol
# (a module of its own, so the collector stays out of go.mod). About 5 minutes cold on 2
# busy cores, seconds with the Go build cache; the tests skip, saying so, without it.
otelcol: .tools/otelcol
.tools/otelcol: tools/otelcol/go.mod tools/otelcol/go.sum tools/otelcol/main.go
	cd tools/otelcol && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o ../../$@ .

# CoreDNS, the cluster DNS, from its Go module pinned in tools/coredns.
coredns: .tools/coredns
.tools/coredns: tools/coredns/go.mod tools/coredns/go.sum
	cd tools/coredns && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o ../../$@ github.com/coredns/coredns

# SPIRE's server and agent from their Go module, pinned in tools/spire (so SPIRE's server
# code stays out of gozt's go.mod), for the tests against a real SPIRE (identity/ca's
# TestDelegatedSPIRE, cmd/ztunnel's TestSpire*), which skip without them (fail under CI=true,
# where make check builds them first). The server's SQLite datastore needs cgo (gcc).
SPIRE_TOOLS := .tools/spire-server .tools/spire-agent
$(SPIRE_TOOLS): tools/spire/go.mod tools/spire/go.sum
	cd tools/spire && $(GO) build -trimpath -o ../../$@ github.com/spiffe/spire/cmd/$(notdir $@)
spire-tools: $(SPIRE_TOOLS)

# Everything make cluster-up runs, built once per version (the Go build cache makes a rebuild
# after a version change cheap for what did not change).
CLUSTER_TOOLS := .tools/kube-apiserver .tools/kubectl .tools/helm $(K8S_NODE_TOOLS) $(ISTIO_TOOLS) .tools/coredns
cluster-tools: $(CLUSTER_TOOLS)
# What cluster-tools builds that make check's k8s-check does not: .ci/run builds it beside
# the gate, so that two makes never write one tool at once.
cluster-tools-extra: $(K8S_NODE_TOOLS) $(ISTIO_TOOLS) .tools/coredns

# Ambient in a box (docs/CLUSTER.md; root): a two-node Kubernetes cluster on this machine,
# each node its own network and mount namespace with its own containerd, kubelet and
# kube-proxy; Istio ambient installed with its own Helm charts and gozt as the ztunnel.
# cluster-images builds every image locally (nothing is pulled); cluster-up starts the
# cluster and installs Istio (kubeconfig: .tmp/cluster/kubeconfig); cluster-check runs the
# scenarios of deploy/clustertest against it; cluster-down removes what cluster-up recorded.
# Cold, the tools take about 40 minutes to build on 2 busy cores; then cluster-up takes about
# 1.5 minutes and cluster-check about 100 s (docs/CLUSTER.md).
CLUSTER_IMAGES ?= .tmp/cluster-images
ISTIO_HUB      := localhost/istio
cluster-images: $(CLUSTER_TOOLS)
	deploy/cluster/images.sh $(CLUSTER_IMAGES) $(ISTIO_HUB) $(ISTIO_VERSION)
	$(MAKE) --no-print-directory image IMAGE=localhost/gozt/ztunnel:v1 IMAGE_DIR=$(CLUSTER_IMAGES)/ztunnel-v1
	$(MAKE) --no-print-directory image IMAGE=localhost/gozt/ztunnel:v2 IMAGE_DIR=$(CLUSTER_IMAGES)/ztunnel-v2

cluster-up: cluster-images
	CLUSTER_IMAGES=$(CLUSTER_IMAGES) deploy/cluster/up.sh
	deploy/cluster/istio.sh $(ISTIO_DIR)/manifests/charts $(ISTIO_HUB) $(ISTIO_VERSION) localhost/gozt v1
	@echo "cluster-up: Istio ambient installed, gozt is the ztunnel: KUBECONFIG=.tmp/cluster/kubeconfig .tools/istioctl ztunnel-config workloads"

# cluster-check brings a cluster up first if none is (and leaves it up: make cluster-down).
cluster-check:
	@[ "$$(id -u)" != 0 ] || [ -s .tmp/cluster/record ] || $(MAKE) --no-print-directory cluster-up
	ISTIO_CHARTS=$(ISTIO_DIR)/manifests/charts CLUSTER_CHECK=1 $(GO) test -count=1 -v -timeout 30m ./deploy/clustertest

cluster-down:
	deploy/cluster/down.sh

# Migration under live traffic (docs/MIGRATING.md, issue 45): Istio ambient with the Rust
# ztunnel on both nodes, switched to gozt node by node and rolled back, under traffic.
# Needs root and the Rust ztunnel's binary, which this repo never builds or keeps: it is
# wrapped into an image at test time (deploy/cluster/peerimage.sh) and imported into both
# nodes. Brings a cluster up first if none is (with the Rust ztunnel as its ztunnel) and leaves
# it up (make cluster-down). Not part of make check or CI (no Rust binary there).
#   make cluster-migrate ZTUNNEL_RS=/path/to/ztunnel
RS_HUB   = localhost/ztunnel-rs
RS_TAG   = peer-$(shell sha256sum $(ZTUNNEL_RS) 2>/dev/null | cut -c1-12)
RS_IMAGE = $(RS_HUB)/ztunnel:$(RS_TAG)
cluster-migrate:
	@if [ -z "$(ZTUNNEL_RS)" ]; then echo "cluster-migrate: SKIPPED: needs the Rust ztunnel's binary: make cluster-migrate ZTUNNEL_RS=/path/to/ztunnel"; \
	elif [ "$$(id -u)" != 0 ]; then echo "cluster-migrate: SKIPPED: needs root"; \
	else $(MAKE) --no-print-directory cluster-migrate-run; fi

cluster-migrate-run: cluster-images
	deploy/cluster/peerimage.sh $(ZTUNNEL_RS) $(RS_IMAGE) $(CLUSTER_IMAGES)/peer/ztunnel-rs.tar
	@if [ -s .tmp/cluster/record ]; then for i in peer/ztunnel-rs app ztunnel-v1/ztunnel; do $(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/$$i.tar || exit 1; done; else \
		CLUSTER_IMAGES=$(CLUSTER_IMAGES) deploy/cluster/up.sh && \
		$(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/peer/ztunnel-rs.tar && \
		deploy/cluster/istio.sh $(ISTIO_DIR)/manifests/charts $(ISTIO_HUB) $(ISTIO_VERSION) $(RS_HUB) $(RS_TAG); fi
	ISTIO_CHARTS=$(ISTIO_DIR)/manifests/charts CLUSTER_MIGRATE=1 RS_HUB=$(RS_HUB) RS_TAG=$(RS_TAG) $(GO) test -count=1 -v -timeout 40m -run '^TestMigrate$$' ./deploy/clustertest

# Failure drills (docs/CLUSTER.md "Failure drills", issue 55): app rollouts, a pod IP reused, a
# node cut off, a ztunnel killed, the control plane away, restarts and noisy neighbours, under
# one load, against gozt and, with ZTUNNEL_RS, against the Rust ztunnel on the same cluster
# (its image wrapped at test time as for cluster-migrate, under two tags for the helm-upgrade
# drill); one table of what each lost. DRILLS=long repeats each drill (DRILL_REPS, 10) for
# the published figures; DRILL_ONLY=name,... picks drills. make cluster-check runs the short
# slice (one drill of each kind against gozt). Brings a cluster up first if none is.
#   make cluster-drills [ZTUNNEL_RS=/path/to/ztunnel] [DRILLS=long]
cluster-drills: cluster-images
	@[ -s .tmp/cluster/record ] || $(MAKE) --no-print-directory cluster-up
	$(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/app.tar
	@if [ -n "$(ZTUNNEL_RS)" ]; then deploy/cluster/peerimage.sh $(ZTUNNEL_RS) $(RS_IMAGE) $(CLUSTER_IMAGES)/peer/ztunnel-rs.tar $(RS_IMAGE)-b && \
		$(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/peer/ztunnel-rs.tar; fi
	ISTIO_CHARTS=$(ISTIO_DIR)/manifests/charts CLUSTER_DRILLS=1 DRILLS=$(DRILLS) DRILL_REPS=$(DRILL_REPS) DRILL_ONLY=$(DRILL_ONLY) \
		$(if $(ZTUNNEL_RS),RS_HUB=$(RS_HUB) RS_TAG=$(RS_TAG)) $(GO) test -count=1 -v -timeout 600m -run '^TestDrills$$' ./deploy/clustertest

# Pod to pod across the nodes, as users compare data planes (docs/PERFORMANCE.md, issue 57):
# zbench's rows from a client pod on node1 to a server pod on node2 with gozt in the ztunnel
# DaemonSet, with the Rust ztunnel (ZTUNNEL_RS, wrapped at test time as for cluster-migrate)
# and with no mesh, alternating in one sitting; each node's ztunnel's CPU and memory from its
# cgroup. BENCH_REPS (3) repetitions of BENCH_DURATION (5s) runs. Brings a cluster up first.
#   make cluster-bench [ZTUNNEL_RS=/path/to/ztunnel]
cluster-bench: cluster-images
	@[ -s .tmp/cluster/record ] || $(MAKE) --no-print-directory cluster-up
	$(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/zbench.tar
	@if [ -n "$(ZTUNNEL_RS)" ]; then deploy/cluster/peerimage.sh $(ZTUNNEL_RS) $(RS_IMAGE) $(CLUSTER_IMAGES)/peer/ztunnel-rs.tar $(RS_IMAGE)-b && \
		$(MAKE) --no-print-directory cluster-load IMAGE=$(CLUSTER_IMAGES)/peer/ztunnel-rs.tar; fi
	ISTIO_CHARTS=$(ISTIO_DIR)/manifests/charts CLUSTER_BENCH=1 BENCH_REPS=$(BENCH_REPS) BENCH_DURATION=$(BENCH_DURATION) BENCH_ONLY=$(BENCH_ONLY) \
		$(if $(ZTUNNEL_RS),RS_HUB=$(RS_HUB) RS_TAG=$(RS_TAG)) $(GO) test -count=1 -v -timeout 300m -run '^TestClusterBench$$' ./deploy/clustertest

# Resident memory of every process and container of the cluster.
cluster-rss:
	@deploy/cluster/rss.sh

# Imports an image archive (docker-archive or OCI) into every node, as kind load image-archive.
cluster-load:
	@[ -f "$(IMAGE)" ] || { echo "usage: make cluster-load IMAGE=file.tar (a docker-archive or OCI archive)"; exit 1; }
	@for s in .tmp/cluster/node*/root/run/containerd/containerd.sock; do ctr -a $$s -n k8s.io images import $(IMAGE) || exit 1; done

# deploy/kubetest against a real kube-apiserver and etcd (Debian's etcd-server) on loopback:
# helm lint/install/upgrade/uninstall of the chart, Pod Security levels, kubectl apply
# --dry-run=server of the manifests, and the CA client's token checked by a TokenReview.
# make test leaves the package out; its tests skip without the tools, except under CI=true.
k8s-check: .tools/kube-apiserver .tools/kubectl .tools/helm
	$(GO) test -count=1 -timeout 10m ./deploy/kubetest

# The standalone node: workloads from examples/localhost.yaml, the built-in CA (its root is
# kept in $(RUN_DIR)/ca), SOCKS5 on 127.0.0.1:15080. Reach a local server through the tunnel:
#   curl --socks5-hostname 127.0.0.1:15080 http://127.0.0.1:8080/
run: build
	@mkdir -p $(RUN_DIR)
	PROXY_MODE=dedicated PROXY_WORKLOAD_INFO=default/local/default \
	LOCAL_XDS_PATH=examples/localhost.yaml XDS_ADDRESS= CA_PROVIDER=builtin CA_DIR=$(RUN_DIR)/ca \
	UNSTABLE_ENABLE_SOCKS5=true ADMIN_ADDR=localhost:15000 \
	$(BIN)/ztunnel

# Two nodes on 127.0.0.2 and 127.0.0.3 from examples/two-nodes.yaml, an echo server, traffic
# through SOCKS5 -> HBONE mTLS -> echo, and a summary (tunnel, identities, counters).
demo: build
	ZTUNNEL_BIN=$(BIN)/ztunnel scripts/demo.sh

# In-pod mode on one node (root only): two pods as network namespaces with istio-cni's
# in-pod rules, one ztunnel in PROXY_MODE=shared handed both over ZDS by cmd/zdsagent (a
# stand-in for istio-cni's node agent), curl from pod A to pod B over HBONE, a summary.
demo-inpod: build
	$(GO) build -o $(BIN)/zdsagent ./cmd/zdsagent
	ZTUNNEL_BIN=$(BIN)/ztunnel ZDSAGENT_BIN=$(BIN)/zdsagent scripts/demo-inpod.sh

# test-norace runs again, without the race detector, the tests that only mean something
# there: allocation budgets (sync.Pool drops items at random under -race, and the hot-path
# ones skip), stack sizes (-race makes every frame larger) and the order goroutines run in
# (-race randomizes it; those tests end in Yields and skip under it). By convention every
# test that asserts an allocation count has "Allocs" in its name; alloc-names fails on one
# that does not (a function calling testing.AllocsPerRun must be named *Allocs*).
NORACE_TESTS := Allocs|Yields$$|^TestIdleConnectionStacks$$|^TestInPodIdlePodCost$$
test: alloc-names
	$(GO) test -race -timeout 15m $$($(GO) list ./... | grep -v '/deploy/kubetest$$')
	$(MAKE) --no-print-directory test-norace

# The kernel TLS tests (internal/ktls's, and hbone's and proxy's Test*KernelTLS*) in a VM
# with kernel TLS (hosts here lack CONFIG_TLS): qemu without KVM boots the Debian cloud
# kernel on an initramfs of busybox, tls.ko and the test binaries. About 90 s on 2 cores,
# boot included, plus building the binaries. Needs: apt-get install -y qemu-system-x86
# busybox-static linux-image-cloud-amd64 (.ci/run installs them). make check runs it when
# they are there and says so when they are not. test-ktls also runs zbench suite's
# kernel TLS path in the guest, to check that it runs in kernel TLS (emulated: no speed).
test-ktls:
	KTLS_VM_ZBENCH=throughput/1 scripts/ktls-vm.sh

ktls-check:
	@if command -v qemu-system-x86_64 >/dev/null && command -v cpio >/dev/null && [ -x /bin/busybox ] && ls /lib/modules 2>/dev/null | grep -q -- '-cloud-amd64$$'; then \
	  scripts/ktls-vm.sh; \
	else echo "ktls-check: SKIPPED: no qemu-system-x86 or Debian cloud kernel (apt-get install -y qemu-system-x86 busybox-static linux-image-cloud-amd64)"; fi

# gozt beside the Rust ztunnel (package interop): both directions over HBONE in dedicated
# and in-pod mode, policies, DNS, and what an operator reads of each (metrics, access log,
# /config_dump, admin), as real processes in network namespaces (root). It takes the Rust
# ztunnel's binary by path and skips without it:
#   make interop-rs ZTUNNEL_RS=/path/to/ztunnel
interop-rs:
	ZTUNNEL_RS=$(ZTUNNEL_RS) $(GO) test -count=1 -v -timeout 10m ./interop

test-norace:
	$(GO) test -count=1 -run '$(NORACE_TESTS)' ./...

alloc-names:
	@bad=$$(awk '/^func /{f=$$0} /testing\.AllocsPerRun/ && f !~ /^func [A-Za-z0-9_]*[Aa]llocs/ {print FILENAME": "f}' $$(git ls-files '*_test.go')); \
	 if [ -n "$$bad" ]; then echo "allocation tests must have Allocs in their name (make test-norace runs them):"; echo "$$bad"; exit 1; fi

check: fmt-check vet staticcheck tidy-check proto-check otelcol spire-tools xdscontrol test chart-check k8s-check ktls-check bench-smoke soak-slice

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

staticcheck:
	@[ -x $(GOBIN)/staticcheck ] && $(GOBIN)/staticcheck -version | grep -q "$(STATICCHECK_VERSION:v%=%)" \
		|| $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	$(GOBIN)/staticcheck ./...

tidy-check:
	@cp go.mod .tidy.mod.bak; cp go.sum .tidy.sum.bak; $(GO) mod tidy; \
	 if ! cmp -s go.mod .tidy.mod.bak || ! cmp -s go.sum .tidy.sum.bak; then \
	   mv .tidy.mod.bak go.mod; mv .tidy.sum.bak go.sum; echo "go mod tidy changes go.mod/go.sum: run it and commit"; exit 1; fi; \
	 rm -f .tidy.mod.bak .tidy.sum.bak

# Every benchmark runs once so none rots; real measurements: `make bench`.
bench-smoke:
	$(GO) test -run '^$$' -bench . -benchtime 1x ./...

# The load-generator suite: two nodes against a direct baseline (under 2 minutes).
bench:
	$(GO) run ./cmd/zbench suite --short

# go-control-plane's delta ADS server (a LinearCache per type), the control plane nobody here
# wrote that bench-scale feeds a node from beside its own (issue 59): a module of its own, so
# its Envoy protos stay out of gozt's go.mod and out of any binary that links xds/xdspb.
xdscontrol: .tools/xdscontrol
.tools/xdscontrol: tools/xdscontrol/go.mod tools/xdscontrol/go.sum tools/xdscontrol/main.go
	cd tools/xdscontrol && CGO_ENABLED=0 $(GO) build -trimpath -o ../../$@ .

# One real node fed generated meshes by a real delta ADS server (internal/scaletest): time to
# ready, CPU, peak and settled RSS, 100-workload pushes, a full push, a resync, a reconnect
# with resource versions; heap profiles in .tmp/scale (SCALE_PUSHPROFILE=1: a CPU profile and
# an execution trace of the full push too). The 1M mesh takes a few GB across both processes and minutes
# on 2 cores. With ZTUNNEL_RS=/path/to/ztunnel the Rust ztunnel runs on the same meshes, with
# ZTUNNEL_BASE=/path/to/ztunnel a gozt binary of the code before a change (same-run baseline).
SCALE_SIZES ?= 100000,1000000
SCALE_SERVERS ?= gozt,istiod,gcp
SCALE_ROUNDS ?= 1
SCALE_FULLPUSHES ?= 1
bench-scale: .tools/xdscontrol
	SCALE_SIZES=$(SCALE_SIZES) SCALE_SERVERS=$(SCALE_SERVERS) SCALE_ROUNDS=$(SCALE_ROUNDS) SCALE_FULLPUSHES=$(SCALE_FULLPUSHES) SCALE_PUSHPROFILE=$(SCALE_PUSHPROFILE) ZTUNNEL_RS=$(ZTUNNEL_RS) ZTUNNEL_BASE=$(ZTUNNEL_BASE) $(GO) test -count=1 -v -timeout 60m -run '^TestScaleBench$$' ./internal/scaletest

# In-pod mode at scale (root): 250 idle pods on one in-process node, each in its own network
# namespace (KiB and goroutines per pod, Add-to-ACK latency), then 10,000 add/delete cycles
# of one more pod beside them (time per cycle; fds, goroutines and memory before and after).
# PODS_BASE=/abs/path/to/ztunnel.test runs the same harness in a test binary of the code before a
# change (go test -c ./cmd/ztunnel there, with this tree's cmd/ztunnel/inpod_bench_test.go).
INPOD_SCALE_PODS ?= 250
INPOD_SCALE_CYCLES ?= 10000
bench-pods:
	INPOD_SCALE=1 INPOD_SCALE_PODS=$(INPOD_SCALE_PODS) INPOD_SCALE_CYCLES=$(INPOD_SCALE_CYCLES) $(GO) test -count=1 -v -timeout 30m -run '^TestInPodScaleBench$$' ./cmd/ztunnel
	@if [ -n "$(PODS_BASE)" ]; then echo "== base: $(PODS_BASE)"; \
	  cd cmd/ztunnel && INPOD_SCALE=1 INPOD_SCALE_PODS=$(INPOD_SCALE_PODS) INPOD_SCALE_CYCLES=$(INPOD_SCALE_CYCLES) $(PODS_BASE) -test.count=1 -test.v -test.timeout 30m -test.run '^TestInPodScaleBench$$'; fi

# Idle connections through one node pair (internal/scaletest, TestIdleConns): KiB, goroutines,
# stacks and heap per connection at each node, and the time to open and close them all. The
# test process holds two fds per connection, so SCALE_CONNS past about 9,900 needs a hard
# RLIMIT_NOFILE above 20,000 (root with CAP_SYS_RESOURCE raises it). ZTUNNEL_BASE as above.
SCALE_CONNS ?= 100000
bench-conns:
	SCALE_CONNS=$(SCALE_CONNS) ZTUNNEL_BASE=$(ZTUNNEL_BASE) $(GO) test -count=1 -v -timeout 60m -run '^TestIdleConns$$' ./internal/scaletest

# The packages' Go benchmarks (several minutes).
bench-go:
	$(GO) test -run '^$$' -bench . -benchmem ./hbone/ ./xds/... ./proxy/... ./identity/... ./dns/

proto proto-check:
	@if [ -f proto.mk ]; then $(MAKE) --no-print-directory -f proto.mk $@; else echo "no protos yet"; fi

clean:
	rm -rf $(BIN) .tmp

# The soak: connections of every kind through two nodes fed by a real ADS server and Istio CA
# while faults are injected on a 60 s cycle (xDS down 30 s, CA down past certificate expiry,
# node B killed mid-stream, backends that reset, stall or vanish). soak-slice runs one 60 s
# cycle (about 70 s; make check runs it); soak runs SOAK_DURATION or SOAK_CONNS connections;
# both without the race detector.
SOAK_DURATION ?= 30m
SOAK_CONNS    ?= 1000000
soak-slice:
	SOAK=1 $(GO) test -count=1 -run '^TestSoak$$' -v ./proxy/ -soak.duration 60s

soak:
	SOAK=1 $(GO) test -count=1 -timeout 0 -run '^TestSoak$$' -v ./proxy/ \
		-soak.duration $(SOAK_DURATION) -soak.conns $(SOAK_CONNS) -soak.sample 10s -soak.csv $(CURDIR)/.tmp/soak.csv

# Every native fuzz target, FUZZTIME each (one at a time: go test -fuzz takes one target).
# Inputs that found bugs are kept in the packages' testdata/fuzz as regression cases, which
# plain `go test` (make test) runs every time.
FUZZTIME ?= 10s
fuzz:
	@for dir in $$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do \
	  for t in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go | sed 's/^func //'); do \
	    echo "== $$dir $$t"; $(GO) test -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$dir || exit 1; \
	  done; \
	done
