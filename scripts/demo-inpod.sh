#!/usr/bin/env bash
# make demo-inpod: in-pod mode on one node. Two pods as network namespaces behind veth pairs
# from a node namespace, each with istio-cni's in-pod iptables rules; one ztunnel
# (PROXY_MODE=shared) in the node namespace, handed both pods' namespaces over ZDS by
# zdsagent, a stand-in for istio-cni's node agent; curl in pod A reaching pod B's HTTP server
# over HBONE mTLS; and a summary of what happened.
#
#   node   gozt-demo-node-PID  runs ztunnel (admin on its own 127.0.0.1) and zdsagent
#   pod A  10.31.1.2           default/client: curl
#   pod B  10.31.2.2           default/server: python3 -m http.server 8080
#
# Needs root, ip, iptables, curl, python3 and go (unless ZTUNNEL_BIN and ZDSAGENT_BIN name
# built binaries). Everything it makes is removed on exit; the exit status is non-zero
# unless the request went through the mesh.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "demo-inpod: needs root (it creates network namespaces and iptables rules); try: sudo make demo-inpod" >&2
  exit 2
fi
for tool in ip iptables curl python3; do
  command -v "$tool" >/dev/null || { echo "demo-inpod: $tool is not installed (apt-get install -y iproute2 iptables curl python3)" >&2; exit 2; }
done

POD_A=10.31.1.2
POD_B=10.31.2.2
NODE=gozt-demo-node-$$
NS_A=gozt-demo-pod-a-$$
NS_B=gozt-demo-pod-b-$$
BIN=${ZTUNNEL_BIN:-bin/ztunnel}
AGENT=${ZDSAGENT_BIN:-bin/zdsagent}

work=$(mktemp -d "${TMPDIR:-/tmp}/gozt-demo-inpod.XXXXXX")
pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "$status" -ne 0 ]; then
    for f in "$work"/*.log; do [ -f "$f" ] && { echo "--- $(basename "$f") (last lines)"; tail -n 20 "$f"; }; done >&2
  fi
  for ns in "$NS_A" "$NS_B" "$NODE"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -z "${ZTUNNEL_BIN:-}" ] || [ -z "${ZDSAGENT_BIN:-}" ]; then
  echo "building $BIN and $AGENT"
  mkdir -p bin
  "${GO:-go}" build -o "$BIN" ./cmd/ztunnel
  "${GO:-go}" build -o "$AGENT" ./cmd/zdsagent
fi

echo "== network: pods $NS_A ($POD_A) and $NS_B ($POD_B) behind veth pairs from $NODE"
for ns in "$NODE" "$NS_A" "$NS_B"; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n "$NS_A" link add gzd$$a type veth peer name gzd$$n netns "$NODE"
ip -n "$NS_B" link add gzd$$b type veth peer name gzd$$m netns "$NODE"
ip -n "$NS_A" addr add $POD_A/24 dev gzd$$a
ip -n "$NS_B" addr add $POD_B/24 dev gzd$$b
ip -n "$NODE" addr add 10.31.1.1/24 dev gzd$$n
ip -n "$NODE" addr add 10.31.2.1/24 dev gzd$$m
for l in "$NS_A gzd$$a" "$NS_B gzd$$b" "$NODE gzd$$n" "$NODE gzd$$m"; do set -- $l; ip -n "$1" link set "$2" up; done
ip -n "$NS_A" route add default via 10.31.1.1
ip -n "$NS_B" route add default via 10.31.2.1
ip netns exec "$NODE" sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'

echo "== istio-cni's in-pod rules in both pods (zdsagent -rules: $("$AGENT" -rules | wc -l) iptables rules each)"
for ns in "$NS_A" "$NS_B"; do
  "$AGENT" -rules | while read -r rule; do
    # shellcheck disable=SC2086 # each line is one rule's arguments
    ip netns exec "$ns" iptables -w $rule
  done
done

cat > "$work/workloads.yaml" <<YAML
workloads:
  - {uid: Kubernetes//v1/Pod/default/client, name: client, namespace: default, serviceAccount: client,
     workloadIps: ["$POD_A"], protocol: HBONE, node: node-a}
  - {uid: Kubernetes//v1/Pod/default/server, name: server, namespace: default, serviceAccount: server,
     workloadIps: ["$POD_B"], protocol: HBONE, node: node-a}
YAML

echo "== pod B serves HTTP on $POD_B:8080"
mkdir -p "$work/www" && echo "hello from pod B (default/server)" > "$work/www/index.html"
ip netns exec "$NS_B" python3 -u -m http.server 8080 --bind $POD_B --directory "$work/www" >"$work/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "Serving HTTP" "$work/server.log" && break; sleep 0.1; done

echo "== zdsagent on $work/ztunnel.sock hands ztunnel both pods' namespaces"
"$AGENT" -uds "$work/ztunnel.sock" \
  "uid-a,default/client,client,/var/run/netns/$NS_A" \
  "uid-b,default/server,server,/var/run/netns/$NS_B" >"$work/zdsagent.log" 2>&1 &
pids+=($!)

echo "== ztunnel in $NODE, PROXY_MODE=shared"
PROXY_MODE=shared NODE_NAME=node-a INPOD_UDS="$work/ztunnel.sock" \
  LOCAL_XDS_PATH="$work/workloads.yaml" XDS_ADDRESS= CA_PROVIDER=builtin CA_DIR="$work/ca" \
  ip netns exec "$NODE" "$BIN" >"$work/ztunnel.log" 2>&1 &
pids+=($!)
admin() { ip netns exec "$NODE" curl -fsS -m 2 "http://127.0.0.1:$1"; }
for _ in $(seq 100); do admin 15021/healthz/ready >/dev/null 2>&1 && break; sleep 0.1; done
admin 15021/healthz/ready >/dev/null || { echo "demo-inpod: ztunnel not ready" >&2; exit 1; }
sed 's/^/   /' "$work/zdsagent.log"

echo "== curl in pod A: http://$POD_B:8080/ (plain HTTP; the pod's rules hand it to ztunnel)"
out=$(ip netns exec "$NS_A" curl -fsS -m 10 "http://$POD_B:8080/")
echo "   $out"
grep -q "hello from pod B" <<<"$out"

echo "== what ztunnel saw"
sleep 0.2 # the connection is recorded once both directions have closed
metrics=$(admin 15020/metrics)
opened() { grep "^istio_tcp_connections_opened_total{" <<<"$metrics" | grep "reporter=\"$1\"" | grep 'connection_security_policy="mutual_tls"' | awk '{s+=$NF} END {print s+0}'; }
echo "   outbound mTLS connections (pod A's proxy): $(opened source)"
echo "   inbound mTLS connections (pod B's proxy):  $(opened destination)"
grep 'msg="pod proxy started"' "$work/ztunnel.log" | sed 's/.*uid=/   pod proxy started: uid=/'
grep 'scope=access' "$work/ztunnel.log" | grep -o 'src.identity=[^ ]* .*dst.identity=[^ ]*' | sed 's/ .* dst/ -> dst/; s/^/   /' | sort -u
admin 15000/config_dump | python3 -c 'import json,sys; [print("   workloadState", k, v["state"], v["info"]["namespace"]+"/"+v["info"]["name"]) for k, v in sorted(json.load(sys.stdin)["workloadState"].items())]'
[ "$(opened source)" -ge 1 ] && [ "$(opened destination)" -ge 1 ]
echo "== ok: pod A reached pod B over HBONE mTLS through one in-pod ztunnel; cleaning up"
