#!/usr/bin/env bash
# make cluster-up: a two-node Kubernetes cluster on this machine (root), no container daemon
# and no registry. The control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler) runs on the host and listens on the bridge's address; each node is a network
# namespace with its own address on that bridge and a mount namespace of its own in which the
# node's directories (/etc/cni/net.d, /opt/cni/bin, /var/lib/kubelet, /run/containerd,
# /run/netns, /run/ztunnel, /run/istio-cni, ...) are bind mounts of $C/nodeN/root/..., as kind's
# node containers make them; each node runs its own containerd, kubelet and kube-proxy.
# Pod networking: the CNI bridge + host-local + portmap plugins, a /24 per node, routes
# between the nodes. Everything made is recorded in $C/record for deploy/cluster/down.sh.
# Images come from $CLUSTER_IMAGES (deploy/cluster/images.sh, make image) and are imported
# into every node.
set -euo pipefail
ROOT=$(pwd)
T=$ROOT/.tools
C=$ROOT/.tmp/cluster
REC=$C/record
BR=gozt0 HOSTIP=10.99.0.1 NODES=(node1 node2)
SVC_CIDR=10.96.0.0/16 POD_CIDR=10.244.0.0/16 DNS_IP=10.96.0.10
IMAGES=${CLUSTER_IMAGES:-$ROOT/.tmp/cluster-images}
ETCD_PORT=23790 # not 2379: make k8s-check's etcd may be running on this machine

[ "$(id -u)" = 0 ] || { echo "cluster-up: needs root (network and mount namespaces)"; exit 1; }
if [ -s "$REC" ]; then echo "cluster-up: $REC exists: a cluster is up (make cluster-down first)"; exit 1; fi
mkdir -p "$C/logs" "$C/pki"
: > "$REC"
rec() { echo "$*" >> "$REC"; }
fail() { echo "cluster-up: $1 did not come up; log: $2" >&2; exit 1; }
nodeip() { echo "10.99.0.1${1#node}"; }
nodecidr() { echo "10.244.${1#node}.0/24"; }
# waitfor WHAT LOG SECONDS CMD...: poll CMD until it succeeds.
waitfor() {
	local what=$1 log=$2 n=$3; shift 3
	for ((i = 0; i < n * 5; i++)); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		sleep 0.2
	done
	fail "$what" "$log"
}
# start NAME LOG CMD...: a background process, recorded by pid (in a node: nsenter first).
# (start NAME LOG innode NODE CMD...: in the node's network, mount and PID namespaces.)
start() {
	local name=$1 log=$2; shift 2
	if [ "$1" = innode ]; then
		local n=$2; shift 2
		set -- nsenter --net=/run/netns/gozt-$n --mount="$C/ns/$n.mnt" --pid="$C/ns/$n.pid" "$@"
	fi
	setsid "$@" > "$log" 2>&1 < /dev/null &
	rec pid "$!" "$name"
}

t0=$(date +%s.%N)
phase() { printf 'cluster-up: %-34s %5.1fs\n' "$1" "$(echo "$(date +%s.%N) - $t0" | bc)"; }

# --- PKI: one CA for everything; a client cert per component.
cd "$C/pki"
if [ ! -f ca.crt ]; then
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=gozt-cluster-ca 2>/dev/null
	openssl genrsa -out sa.key 2048 2>/dev/null
	openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
	cert() { # NAME CN O [SAN]
		openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2${3:+/O=$3}" 2>/dev/null
		printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n%s\n' "${4:+subjectAltName=$4}" > "$1.ext"
		openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 3650 -extfile "$1.ext" 2>/dev/null
	}
	cert apiserver kube-apiserver "" "IP:$HOSTIP,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
	cert admin kubernetes-admin system:masters
	cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
	cert controller-manager system:kube-controller-manager
	cert scheduler system:kube-scheduler
	cert kube-proxy system:kube-proxy
	for n in "${NODES[@]}"; do cert "$n" "system:node:$n" system:nodes "IP:$(nodeip "$n"),DNS:$n"; done
fi
kubeconfig() { # FILE USER
	cat > "$1" <<EOK
apiVersion: v1
kind: Config
clusters: [{name: gozt, cluster: {server: "https://$HOSTIP:6443", certificate-authority: $C/pki/ca.crt}}]
users: [{name: $2, user: {client-certificate: $C/pki/$2.crt, client-key: $C/pki/$2.key}}]
contexts: [{name: gozt, context: {cluster: gozt, user: $2}}]
current-context: gozt
EOK
}
kubeconfig "$C/kubeconfig" admin
for u in controller-manager scheduler kube-proxy "${NODES[@]}"; do kubeconfig "$C/pki/$u.kubeconfig" "$u"; done
cd "$ROOT"
phase pki

# --- The bridge the nodes and the control plane share.
ip link add $BR type bridge && rec link $BR
ip addr add $HOSTIP/24 dev $BR
ip link set $BR up
# Bridged frames between the nodes must not be dropped by the host's FORWARD chain.
iptables -w -I FORWARD -i $BR -o $BR -j ACCEPT && rec iptables FORWARD -i $BR -o $BR -j ACCEPT

# --- Control plane.
mkdir -p "$C/etcd"
start etcd "$C/logs/etcd.log" etcd --name gozt --data-dir "$C/etcd" \
	--listen-client-urls http://127.0.0.1:$ETCD_PORT --advertise-client-urls http://127.0.0.1:$ETCD_PORT \
	--listen-peer-urls http://127.0.0.1:$((ETCD_PORT + 10)) --initial-advertise-peer-urls http://127.0.0.1:$((ETCD_PORT + 10)) \
	--initial-cluster gozt=http://127.0.0.1:$((ETCD_PORT + 10)) --quota-backend-bytes 2147483648
waitfor etcd "$C/logs/etcd.log" 30 curl -sf http://127.0.0.1:$ETCD_PORT/health
phase etcd
P=$C/pki
start kube-apiserver "$C/logs/kube-apiserver.log" "$T/kube-apiserver" \
	--etcd-servers http://127.0.0.1:$ETCD_PORT --bind-address $HOSTIP --advertise-address $HOSTIP --secure-port 6443 \
	--service-cluster-ip-range $SVC_CIDR --allow-privileged=true \
	--client-ca-file "$P/ca.crt" --tls-cert-file "$P/apiserver.crt" --tls-private-key-file "$P/apiserver.key" \
	--kubelet-client-certificate "$P/apiserver-kubelet-client.crt" --kubelet-client-key "$P/apiserver-kubelet-client.key" \
	--service-account-issuer https://kubernetes.default.svc.cluster.local --service-account-key-file "$P/sa.pub" \
	--service-account-signing-key-file "$P/sa.key" --authorization-mode Node,RBAC \
	--enable-admission-plugins NodeRestriction --profiling=false --kubelet-preferred-address-types InternalIP
waitfor kube-apiserver "$C/logs/kube-apiserver.log" 90 "$T/kubectl" --kubeconfig "$C/kubeconfig" get --raw /readyz
phase kube-apiserver
start kube-controller-manager "$C/logs/kube-controller-manager.log" "$T/kube-controller-manager" \
	--kubeconfig "$P/controller-manager.kubeconfig" --authentication-kubeconfig "$P/controller-manager.kubeconfig" \
	--authorization-kubeconfig "$P/controller-manager.kubeconfig" --bind-address 127.0.0.1 --secure-port 10357 \
	--leader-elect=false --use-service-account-credentials --service-cluster-ip-range $SVC_CIDR \
	--cluster-signing-cert-file "$P/ca.crt" --cluster-signing-key-file "$P/ca.key" --root-ca-file "$P/ca.crt" \
	--service-account-private-key-file "$P/sa.key"
start kube-scheduler "$C/logs/kube-scheduler.log" "$T/kube-scheduler" \
	--kubeconfig "$P/scheduler.kubeconfig" --authentication-kubeconfig "$P/scheduler.kubeconfig" \
	--authorization-kubeconfig "$P/scheduler.kubeconfig" --bind-address 127.0.0.1 --secure-port 10359 --leader-elect=false
waitfor kube-controller-manager "$C/logs/kube-controller-manager.log" 60 curl -skf https://127.0.0.1:10357/healthz
waitfor kube-scheduler "$C/logs/kube-scheduler.log" 60 curl -skf https://127.0.0.1:10359/healthz
phase "controller-manager, scheduler"

# --- Nodes.
# The node's own directories; every hostPath Istio's charts use is among them.
NODE_DIRS=(/etc/cni/net.d /opt/cni/bin /var/lib/kubelet /var/lib/containerd /var/lib/cni /var/log/pods
	/var/log/containers /run/containerd /run/netns /run/ztunnel /run/istio-cni /etc/kubernetes)
mkdir -p "$C/ns"
mount --bind "$C/ns" "$C/ns" && rec mount "$C/ns"
mount --make-private "$C/ns"
mkdirs() { # each missing level, recorded (down.sh removes them deepest first)
	[ -d "$1" ] && return 0
	mkdirs "$(dirname "$1")"
	mkdir "$1" && rec dir "$1"
}
for d in "${NODE_DIRS[@]}"; do mkdirs "$d"; done # mount points on the host, left as they were found
for n in "${NODES[@]}"; do
	ip=$(nodeip "$n") nr=$C/$n/root
	ip netns add gozt-$n && rec netns gozt-$n
	ip link add gozt-$n type veth peer name eth0 netns gozt-$n && rec link gozt-$n
	ip link set gozt-$n master $BR up
	ip -n gozt-$n link set lo up
	ip -n gozt-$n addr add "$ip/24" dev eth0
	ip -n gozt-$n link set eth0 up
	ip -n gozt-$n route add default via $HOSTIP
	ip netns exec gozt-$n sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
	for m in "${NODES[@]}"; do
		[ "$m" = "$n" ] || ip -n gozt-$n route add "$(nodecidr "$m")" via "$(nodeip "$m")"
	done
	ip route add "$(nodecidr "$n")" via "$ip" && rec route "$(nodecidr "$n")"
	for d in "${NODE_DIRS[@]}"; do mkdir -p "$nr$d"; done
	cp /usr/lib/cni/* "$nr/opt/cni/bin/"
	# The node's PID namespace and mount namespace, held by its init (bin/cluster/app init,
	# which reaps the shims), with a /proc of its own: istio-cni's agent enters the node's
	# network namespace as /proc/1/ns/net, so PID 1 of the node must be in it, as in kind.
	# Stopping the init kills every process of the node.
	touch "$C/ns/$n.mnt" "$C/ns/$n.pid"
	start "init-$n" "$C/logs/init-$n.log" nsenter --net=/run/netns/gozt-$n unshare --mount="$C/ns/$n.mnt" \
		--pid="$C/ns/$n.pid" --fork --mount-proc --propagation private "$ROOT/bin/cluster/app" init
	rec mount "$C/ns/$n.mnt"
	rec mount "$C/ns/$n.pid"
	waitfor "init-$n (node namespaces)" "$C/logs/init-$n.log" 10 sh -c "findmnt -n '$C/ns/$n.pid' && findmnt -n '$C/ns/$n.mnt'"
	# Shared inside the node (a peer group of its own, not the host's), as kind makes its
	# nodes' root: containerd refuses mountPropagation (istio-cni's /var/run/netns) on a
	# path whose mount, "/" for /var/run/netns as it does not follow the /var/run link, is private.
	nsenter --mount="$C/ns/$n.mnt" mount --make-rshared /
	for d in "${NODE_DIRS[@]}"; do
		nsenter --mount="$C/ns/$n.mnt" sh -c "mount --bind '$nr$d' '$d' && mount --make-shared '$d'"
	done
	cat > "$nr/etc/cni/net.d/10-bridge.conflist" <<EOCNI
{"cniVersion": "0.4.0", "name": "gozt", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$(nodecidr "$n")"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOCNI
	cat > "$C/$n/containerd.toml" <<EOCTR
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/gozt/pause:v1"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
EOCTR
	start "containerd-$n" "$C/logs/containerd-$n.log" innode "$n" containerd --config "$C/$n/containerd.toml"
done
for n in "${NODES[@]}"; do
	sock=$C/$n/root/run/containerd/containerd.sock
	waitfor "containerd-$n" "$C/logs/containerd-$n.log" 30 ctr -a "$sock" version
	for img in "$IMAGES"/*.tar "$IMAGES"/ztunnel-*/ztunnel.tar; do
		ctr -a "$sock" -n k8s.io images import "$img" > /dev/null || fail "image import of $img into $n" "$C/logs/containerd-$n.log"
	done
done
phase "node namespaces, containerd, images"
for n in "${NODES[@]}"; do
	ip=$(nodeip "$n")
	# The node's cgroup root, in every v1 hierarchy: its kubelet's kubepods/<qos>/pod<uid>
	# cgroups go under it, apart from the other node's (as a kind node's cgroup namespace
	# makes them). istio-cni's agent needs the pod UID in a process's cgroup path to find a
	# running pod's network namespace when it restarts (cgroupsPerQOS: false leaves it out).
	for h in /sys/fs/cgroup/*/; do
		case $(stat -f -c %T "$h") in
		cgroupfs) [ -f "$h/cgroup.procs" ] && mkdir -p "$h/gozt-$n" && rec cgroup "$h/gozt-$n" ;;
		cgroup2fs) rec cgroup "$h/gozt-$n" ;; # the empty v2 mount: the kubelet makes its tree there too
		esac
	done
	cat > "$C/$n/kubelet.yaml" <<EOKL
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 on this machine: Kubernetes 1.31+ kubelets refuse it unless told not to; no
# systemd (cgroupfs driver); QoS and pod cgroups under the node's own root; no
# node-allocatable enforcement.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /gozt-$n
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: $ip
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $P/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $P/$n.crt
tlsPrivateKeyFile: $P/$n.key
serializeImagePulls: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podPidsLimit: -1
maxPods: 60
EOKL
	start "kubelet-$n" "$C/logs/kubelet-$n.log" innode "$n" "$T/kubelet" \
		--config "$C/$n/kubelet.yaml" --kubeconfig "$P/$n.kubeconfig" --hostname-override "$n" --node-ip "$ip" --v 1
	cat > "$C/$n/kube-proxy.yaml" <<EOKP
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $P/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $n
bindAddress: $ip
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0}
EOKP
	start "kube-proxy-$n" "$C/logs/kube-proxy-$n.log" innode "$n" "$T/kube-proxy" --config "$C/$n/kube-proxy.yaml"
done
K="$T/kubectl --kubeconfig $C/kubeconfig"
for n in "${NODES[@]}"; do
	waitfor "kubelet-$n (node Ready)" "$C/logs/kubelet-$n.log" 90 sh -c "$K get node $n -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
	waitfor "kube-proxy-$n" "$C/logs/kube-proxy-$n.log" 60 ip netns exec gozt-$n curl -sf http://127.0.0.1:10256/healthz
done
phase "kubelets and kube-proxies (nodes Ready)"

# --- CoreDNS as a Deployment behind kube-dns (10.96.0.10).
$K apply -f deploy/cluster/coredns.yaml > "$C/logs/coredns-apply.log" 2>&1 || fail "coredns (kubectl apply)" "$C/logs/coredns-apply.log"
$K -n kube-system rollout status deploy/coredns --timeout 120s > "$C/logs/coredns-rollout.log" 2>&1 || fail coredns "$C/logs/coredns-rollout.log (and kubectl -n kube-system logs deploy/coredns)"
phase coredns

cat <<EOM
cluster-up: two nodes ($(printf '%s ' "${NODES[@]}")) up in $(printf '%.0f' "$(echo "$(date +%s.%N) - $t0" | bc)") s. Use it with:
  export KUBECONFIG=$C/kubeconfig PATH=$T:\$PATH
  kubectl get nodes,pods -A -o wide
  istioctl ztunnel-config workloads         (Istio: installed next by make cluster-up, deploy/cluster/istio.sh)
  make cluster-load IMAGE=file.tar          (import an image into both nodes)
  make cluster-down                         (stops and removes everything it made)
Logs: $C/logs/. A node's view: nsenter --net=/run/netns/gozt-node1 --mount=$C/ns/node1.mnt --pid=$C/ns/node1.pid sh
EOM
