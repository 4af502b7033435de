#!/usr/bin/env bash
# Builds the cluster's images into $OUT (docker-archive tarballs for `ctr images import`),
# from binaries in .tools/ and files of this machine, with deploy/cluster/mkimg (no container
# daemon, nothing pulled): the sandbox (pause) and the test app (deploy/cluster/app), Istio's
# pilot (istiod) and install-cni (install-cni + the istio-cni plugin + iptables and nft with
# the shared libraries ldd names, from this machine's Debian packages), and CoreDNS.
# gozt's own image comes from make image. Usage: images.sh OUT ISTIO_HUB ISTIO_TAG
set -euo pipefail
OUT=$1 HUB=$2 TAG=$3
T=.tools
mkdir -p "$OUT" bin/cluster
mkimg() { go run ./deploy/cluster/mkimg "$@"; }

CGO_ENABLED=0 go build -trimpath -o bin/cluster/app ./deploy/cluster/app
mkimg -tag localhost/gozt/pause:v1 -out "$OUT/pause.tar" -entrypoint /pause bin/cluster/app=/pause
mkimg -tag localhost/gozt/app:v1 -out "$OUT/app.tar" -entrypoint /app bin/cluster/app=/app tmp/
# zbench for make cluster-bench: its servers and scenarios in pods, and the app to pause with.
CGO_ENABLED=0 go build -trimpath -o bin/cluster/zbench ./cmd/zbench
mkimg -tag localhost/gozt/zbench:v1 -out "$OUT/zbench.tar" -entrypoint /zbench bin/cluster/zbench=/zbench bin/cluster/app=/app tmp/

# Istio's ambient profile sets global.variant=distroless, so its images are tagged TAG and
# TAG-distroless. istiod runs as 1337 (the chart's securityContext says so too); its Dockerfile adds nothing
# else it reads but CA certificates.
printf 'root:x:0:0:root:/root:/sbin/nologin\nistio-proxy:x:1337:1337::/home/istio-proxy:/sbin/nologin\n' > bin/cluster/passwd
printf 'root:x:0:\nistio-proxy:x:1337:\n' > bin/cluster/group
mkimg -tag "$HUB/pilot:$TAG" -tag "$HUB/pilot:$TAG-distroless" -out "$OUT/pilot.tar" -user 1337:1337 -entrypoint /usr/local/bin/pilot-discovery \
	$T/pilot-discovery=/usr/local/bin/pilot-discovery bin/cluster/passwd=/etc/passwd bin/cluster/group=/etc/group \
	/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt tmp/ var/lib/istio/

# install-cni: Istio's install-cni image is its iptables base image (iptables, ip6tables, the
# legacy and nft variants, nft) plus the two binaries, with /opt/cni/bin on PATH.
files=() libs=()
add() { files+=("$1=$2"); }
for b in /usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi /usr/sbin/nft /usr/sbin/ip; do
	add "$b" "$b"
	libs+=("$b")
done
for l in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
	files+=("/usr/sbin/$l->xtables-nft-multi" "/usr/sbin/${l/tables/tables-nft}->xtables-nft-multi" "/usr/sbin/${l/tables/tables-legacy}->xtables-legacy-multi")
done
for so in /usr/lib/x86_64-linux-gnu/xtables/*.so; do add "$so" "$so"; libs+=("$so"); done
for lib in $(ldd "${libs[@]}" 2>/dev/null | awk '/=>/ {print $3} /^\t\/lib/ {print $1}' | sort -u); do
	add "$lib" "$lib" # the loader's /lib64 symlink is copied as the file it points to
done
mkimg -tag "$HUB/install-cni:$TAG" -tag "$HUB/install-cni:$TAG-distroless" -out "$OUT/install-cni.tar" -entrypoint /usr/local/bin/install-cni \
	-env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin \
	$T/install-cni=/usr/local/bin/install-cni $T/istio-cni=/opt/cni/bin/istio-cni \
	/etc/ssl/certs/ca-certificates.crt=/etc/ssl/certs/ca-certificates.crt tmp/ var/run/ run/ "${files[@]}"

mkimg -tag localhost/gozt/coredns:v1 -out "$OUT/coredns.tar" -entrypoint /coredns $T/coredns=/coredns
