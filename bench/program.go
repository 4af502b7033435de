package bench

import (
	"runtime"
	"strconv"
)

// A program is a ztunnel implementation a namespace path runs on its nodes: gozt's own, or
// the Rust ztunnel (istio/ztunnel), whose binary the suite is given by path
// (SuiteConfig.ZtunnelRS) and never builds. Both are configured from the same facts, so
// that on a path between two namespaces only the program differs: one node per network
// namespace on the fixed ports the Rust ztunnel binds (15001, 15006 and 15008 on the
// wildcard, SOCKS5 on 127.0.0.1:15080, readiness 15021, stats 15020, admin
// 127.0.0.1:15000), certificates from one Istio-CA-protocol server reached on each node's
// own loopback (127.0.0.1:15012), the same worker threads, and inbound dials from the
// node's own address (ENABLE_ORIG_SRC=false: a dedicated node's spoofed source would send
// the server's replies across the veth to the client's namespace instead of back to it).
type program struct {
	rust bool
	bin  string
}

// tag is the program's short name in path names: "gozt" or "rs".
func (pg program) tag() string {
	if pg.rust {
		return "rs"
	}
	return "gozt"
}

// nodeCA is what a node needs to fetch its certificates from the suite's CA.
type nodeCA struct {
	rootFile  string // the CA's root, PEM: CA_ROOT_CA
	tokenFile string // AUTH_TOKEN; the CA accepts any
}

// caAddr is where every node reaches the CA: a listener inside its own namespace.
const caAddr = "127.0.0.1:15012"

// workerThreads is ZTUNNEL_WORKER_THREADS for both programs: gozt's default for this
// machine (a quarter of the cores, at least 2, at most all; cmd/ztunnel/workers.go), set
// explicitly so the Rust ztunnel's own default rule cannot differ.
func workerThreads() int {
	cores := runtime.NumCPU()
	return min(cores, max(2, (cores+3)/4))
}

// common is the environment every node of the program gets, in either mode.
func (pg program) common(node, topology string, ca nodeCA) []string {
	env := []string{
		"NODE_NAME=" + node,
		"XDS_ADDRESS=",
		"LOCAL_XDS_PATH=" + topology,
		"CA_ROOT_CA=" + ca.rootFile,
		"AUTH_TOKEN=" + ca.tokenFile,
		"CLUSTER_ID=Kubernetes",
		"TRUST_DOMAIN=cluster.local",
		"ZTUNNEL_WORKER_THREADS=" + strconv.Itoa(workerThreads()),
		"ENABLE_ORIG_SRC=false",
	}
	if pg.rust {
		return append(env, "CA_ADDRESS=https://"+caAddr)
	}
	return append(env, "CA_PROVIDER=istio", "CA_ADDRESS="+caAddr, "KERNEL_TLS=false")
}

// dedicatedEnv is the environment of a dedicated node serving workload (ns/name/sa); socks5
// turns on its SOCKS5 listener on 127.0.0.1:15080 (gozt's default address, the Rust
// ztunnel's only one).
func (pg program) dedicatedEnv(node, workload, topology string, ca nodeCA, socks5 bool) []string {
	env := append(pg.common(node, topology, ca), "PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO="+workload)
	if socks5 {
		env = append(env, "UNSTABLE_ENABLE_SOCKS5=true")
	}
	return env
}

// sharedEnv is the environment of an in-pod node taking its pods over ZDS from the agent
// at uds; its sockets carry mark, which the pods' rules let through.
func (pg program) sharedEnv(node, uds, topology string, ca nodeCA, mark string) []string {
	return append(pg.common(node, topology, ca), "PROXY_MODE=shared", "INPOD_UDS="+uds, "PACKET_MARK="+mark)
}
