#!/usr/bin/env bash
# make demo: two ztunnel nodes on one machine, an echo server, traffic through the mesh, and a
# summary of what happened.
#
#   node A  127.0.0.2  dedicated proxy of default/client (SOCKS5 on 127.0.0.2:15080)
#   node B  127.0.0.3  dedicated proxy of default/server (HBONE on 127.0.0.3:15008)
#   echo    127.0.0.3:8080, also the service echo.default.svc.cluster.local:80
#
# Workloads come from examples/two-nodes.yaml; both nodes use the built-in CA with one shared
# CA directory, so they trust each other. curl talks SOCKS5 to node A, which opens an mTLS
# HBONE tunnel to node B, which delivers the bytes to the echo server.
#
# Needs bash, curl, python3 (the echo server) and go (unless ZTUNNEL_BIN names a built
# binary). Everything started here is stopped on exit; the exit status is non-zero unless
# the traffic got through.
set -euo pipefail
cd "$(dirname "$0")/.."

A=127.0.0.2
B=127.0.0.3
ECHO_PORT=8080
SERVICE=echo.default.svc.cluster.local
BIN=${ZTUNNEL_BIN:-}

for tool in curl python3; do
  command -v "$tool" >/dev/null || { echo "demo: $tool is not installed (apt-get install -y $tool)" >&2; exit 2; }
done

# Every address the demo binds must be free: say which is taken instead of failing later.
for addr in $A:15000 $A:15001 $A:15006 $A:15008 $A:15020 $A:15021 $A:15053 $A:15080 \
  $B:15000 $B:15001 $B:15006 $B:15008 $B:15020 $B:15021 $B:15053 $B:$ECHO_PORT; do
  if (exec 3<>"/dev/tcp/${addr%:*}/${addr#*:}") 2>/dev/null; then
    echo "demo: $addr is already in use (another demo, make run, or the bench's two-node topology?)" >&2
    exit 1
  fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/gozt-demo.XXXXXX")
pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "$status" -ne 0 ] && [ -d "$work" ]; then
    for f in "$work"/*.log; do [ -f "$f" ] && { echo "--- $(basename "$f") (last lines)"; tail -n 20 "$f"; }; done >&2
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -z "$BIN" ]; then
  BIN=bin/ztunnel
  echo "building $BIN"
  mkdir -p bin
  "${GO:-go}" build -ldflags "-X main.version=$(git describe --always --dirty 2>/dev/null || echo dev)" -o "$BIN" ./cmd/ztunnel
fi

# start_node IP WORKLOAD_INFO LOG [extra env...]: every listener on the node's own IP.
start_node() {
  local ip=$1 info=$2 log=$3
  shift 3
  env PROXY_MODE=dedicated PROXY_WORKLOAD_INFO="$info" \
    LOCAL_XDS_PATH=examples/two-nodes.yaml XDS_ADDRESS= \
    CA_PROVIDER=builtin CA_DIR="$work/ca" \
    ADMIN_ADDR="$ip:15000" STATS_ADDR="$ip:15020" READINESS_ADDR="$ip:15021" \
    OUTBOUND_ADDR="$ip:15001" INBOUND_PLAINTEXT_ADDR="$ip:15006" INBOUND_ADDR="$ip:15008" \
    DNS_PROXY_ADDR="$ip:15053" CONNECTION_TERMINATION_DEADLINE=2s \
    "$@" "$BIN" >"$log" 2>&1 &
  pids+=($!)
}

# Both nodes share one CA directory; the built-in CA locks it, so they may start together.
start_node "$B" default/server/server "$work/node-b.log"
start_node "$A" default/client/client "$work/node-a.log" UNSTABLE_ENABLE_SOCKS5=true SOCKS5_ADDR="$A:15080"

cat >"$work/echo.py" <<'EOF'
# A small HTTP echo server: answers every request with what it received and who sent it.
import http.server, sys

class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self):
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        peer = "%s:%d" % self.client_address[:2]
        body = ("echo: %s %s host=%s peer=%s\n" % (self.command, self.path, self.headers.get("Host"), peer)).encode() + data
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = reply

    def log_message(self, fmt, *args):
        sys.stderr.write("echo: %s %s\n" % (self.client_address[0], fmt % args))
        sys.stderr.flush()

http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()
EOF
python3 "$work/echo.py" "$B" "$ECHO_PORT" >"$work/echo.log" 2>&1 &
pids+=($!)

# Readiness: both nodes report ready (workloads loaded, certificates issued), echo answers.
wait_for() {
  local what=$1 url=$2
  for _ in $(seq 1 100); do
    if curl -fsS -m 1 -o /dev/null "$url" 2>/dev/null; then return 0; fi
    for p in "${pids[@]}"; do
      kill -0 "$p" 2>/dev/null || { echo "demo: a process exited while waiting for $what" >&2; return 1; }
    done
    sleep 0.2
  done
  echo "demo: $what not ready after 20s ($url)" >&2
  return 1
}
wait_for "node A" "http://$A:15021/healthz/ready"
wait_for "node B" "http://$B:15021/healthz/ready"
wait_for "echo server" "http://$B:$ECHO_PORT/ready"

ok=1
msg="hello from default/client through the mesh"
by_ip=$(curl -sS -m 10 --socks5-hostname "$A:15080" --data-binary "$msg" "http://$B:$ECHO_PORT/by-ip" 2>&1) || ok=0
by_name=$(curl -sS -m 10 --socks5-hostname "$A:15080" "http://$SERVICE/by-name" 2>&1) || ok=0
case "$by_ip" in *"$msg"*) ;; *) ok=0 ;; esac
case "$by_name" in *"echo: GET /by-name host=$SERVICE"*) ;; *) ok=0 ;; esac

# identities prints each certificate's identity, state and validity from /config_dump.
identities() {
  curl -fsS -m 5 "http://$1:15000/config_dump" |
    grep -E '"(identity|state|validFrom|expirationTime)"' |
    sed -E 's/^ *"([a-zA-Z]+)": "?([^"]*)"?,?$/\1 \2/' |
    awk '$1 == "identity" { if (id != "") print line; id = $2; line = "    " id; next }
         $1 == "state" { line = line "  [" $2 "]"; next }
         $1 == "validFrom" && !seen[id "from"]++ { line = line "  valid " $2; next }
         $1 == "expirationTime" && !seen[id "to"]++ { line = line " .. " $2; next }
         END { if (id != "") print line }'
}

# counters prints the istio_tcp_* samples of a node, one line each, with the labels that
# tell the story.
counters() {
  curl -fsS -m 5 "http://$1:15020/metrics" |
    awk 'function lab(k) { if (match($0, k "=\"[^\"]*\"")) return substr($0, RSTART + length(k) + 2, RLENGTH - length(k) - 3); return "-" }
         /^istio_tcp_sockets_open/ { printf "    %-38s %-11s = %s\n", "istio_tcp_sockets_open", lab("reporter"), $NF; next }
         /^istio_tcp_/ {
           name = $0; sub(/[{ ].*/, "", name)
           printf "    %-38s %-11s %s -> %s (service %s)  %s  flags=%s  = %s\n", name, lab("reporter"),
             lab("source_workload"), lab("destination_workload"), lab("destination_service"),
             lab("connection_security_policy"), lab("response_flags"), $NF
         }'
}

# Let both sides record the closed connections before reading counters.
sleep 0.3

echo
echo "== gozt demo: two nodes, one mTLS HBONE tunnel =="
echo
echo "The tunnel:"
echo "  curl --socks5-hostname $A:15080  ->  node A (default/client, $A)"
echo "    ->  HBONE: mTLS + HTTP/2 CONNECT to $B:15008"
echo "    ->  node B (default/server, $B)  ->  echo $B:$ECHO_PORT"
echo
echo "Traffic:"
echo "  by IP      curl --socks5-hostname $A:15080 --data-binary '$msg' http://$B:$ECHO_PORT/by-ip"
echo "$by_ip" | sed 's/^/      | /'
echo "  by name    curl --socks5-hostname $A:15080 http://$SERVICE/by-name   (service port 80 -> 8080)"
echo "$by_name" | sed 's/^/      | /'
echo
echo "Identities (certificates from each node's /config_dump):"
echo "  node A:"
identities "$A" || true
echo "  node B:"
identities "$B" || true
echo
echo "Access log (connection complete):"
grep -h 'connection complete' "$work/node-a.log" | sed 's/^/  A: /' || true
grep -h 'connection complete' "$work/node-b.log" | sed 's/^/  B: /' || true
echo
echo "Counters (istio_tcp_* from each node's /metrics):"
echo "  node A (reporter=source):"
counters "$A" || true
echo "  node B (reporter=destination):"
counters "$B" || true
echo

if [ "$ok" = 1 ]; then
  echo "RESULT: ok: traffic went from default/client through node A and node B to the echo server over mTLS HBONE"
else
  echo "RESULT: FAILED: traffic did not get through (see the responses above)"
  exit 1
fi
