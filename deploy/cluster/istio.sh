#!/usr/bin/env bash
# Installs Istio ambient on the cluster of deploy/cluster/up.sh the way Istio's docs install it
# with Helm (base; istiod and cni with profile=ambient; ztunnel), from Istio's own charts in
# the istio.io/istio module tools/istio pins, images from deploy/cluster/images.sh. The only
# values set are where the images are: global.hub/global.tag for Istio's, and hub/tag for the
# ztunnel chart, which point at gozt's image (the drop-in). Usage:
#   istio.sh CHARTS_DIR ISTIO_HUB ISTIO_TAG ZTUNNEL_HUB ZTUNNEL_TAG
set -euo pipefail
CH=$1 HUB=$2 TAG=$3 ZHUB=$4 ZTAG=$5
C=$(pwd)/.tmp/cluster
export KUBECONFIG=$C/kubeconfig
H=.tools/helm
t0=$(date +%s.%N)
phase() { printf 'cluster-istio: %-30s %5.1fs\n' "$1" "$(echo "$(date +%s.%N) - $t0" | bc)"; }
run() { # NAME CMD...: one line naming it and its log when it fails
	local name=$1; shift
	"$@" > "$C/logs/$name.log" 2>&1 || { echo "cluster-istio: $name failed; log: $C/logs/$name.log" >&2; exit 1; }
	phase "$name"
}
run helm-istio-base $H install istio-base "$CH/base" -n istio-system --create-namespace --wait \
	--set global.hub="$HUB" --set global.tag="$TAG"
run helm-istiod $H install istiod "$CH/istio-control/istio-discovery" -n istio-system --set profile=ambient --wait --timeout 5m \
	--set global.hub="$HUB" --set global.tag="$TAG"
run helm-istio-cni $H install istio-cni "$CH/istio-cni" -n istio-system --set profile=ambient --wait --timeout 5m \
	--set global.hub="$HUB" --set global.tag="$TAG"
run helm-ztunnel $H install ztunnel "$CH/ztunnel" -n istio-system --wait --timeout 5m --set hub="$ZHUB" --set tag="$ZTAG"
