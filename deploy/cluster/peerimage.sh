#!/usr/bin/env bash
# Wraps a Rust ztunnel binary someone built (ZTUNNEL_RS; never built or kept by this repo)
# into an image for make cluster-migrate, as images.sh wraps iptables: the binary at
# /usr/local/bin/ztunnel (the entrypoint of Istio's ztunnel image; its chart passes
# `proxy ztunnel`) with every shared library ldd names. Usage: peerimage.sh BINARY TAG OUT
# [TAG...] (more tags for the same image: make cluster-drills upgrades between two).
set -euo pipefail
BIN=$1 TAG=$2 OUT=$3
shift 3
tags=(-tag "$TAG")
for t in "$@"; do tags+=(-tag "$t"); done
files=("$BIN=/usr/local/bin/ztunnel")
for lib in $(ldd "$BIN" 2>/dev/null | awk '/=>/ {print $3} /^\t\/lib/ {print $1}' | sort -u); do
	files+=("$lib=$lib")
done
mkdir -p "$(dirname "$OUT")"
go run ./deploy/cluster/mkimg "${tags[@]}" -out "$OUT" -entrypoint /usr/local/bin/ztunnel \
	/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt tmp/ "${files[@]}"
