//go:build linux

package interop

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/cnirules"
)

// The in-pod topology, as in production: pods A (10.32.0.1) and B (10.32.0.2) are network
// namespaces joined by a veth, each with istio-cni's in-pod rules; node A and node B are
// namespaces of their own (loopback only: admin, the CA) where one ztunnel each runs in
// PROXY_MODE=shared, enrolled by a ZDS agent that hands it its pod's namespace.
const (
	podPrefix = "10.32.0"
	podA      = podPrefix + ".1"
	podB      = podPrefix + ".2"
)

var inPodConfig = `workloads:
  - uid: Kubernetes//Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    trustDomain: cluster.local # the Rust ztunnel's local config has no default (spiffe:///ns/...)
    workloadIps: ["` + podA + `"]
    protocol: HBONE
    node: node-a
    services: {}
  - uid: Kubernetes//Pod/default/server
    name: server
    namespace: default
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["` + podB + `"]
    protocol: HBONE
    node: node-b
    services: {}
`

// TestInPod runs every pair in in-pod mode: the client in pod A dials pod B's address, the
// rules hand the connection to node A's ztunnel inside pod A, which carries it over HBONE
// to node B's ztunnel inside pod B, and on to the server.
//
// With a connection open, the gozt-gozt and rs-rs pairs' /config_dump (workloadState and its
// connections, what istioctl ztunnel-config connections prints) and metrics are compared as
// TestObservability compares them in dedicated mode, and so is the net.ipv4.tcp_migrate_req
// each program leaves in the client's pod.
func TestInPod(t *testing.T) {
	requirePeers(t)
	views := map[string][2]view{}
	migrate := map[string]string{} // program -> pod A's net.ipv4.tcp_migrate_req once enrolled
	for _, pair := range pairs {
		t.Run(pairName(pair), func(t *testing.T) {
			pa, pb := newHost(t, "pa"), newHost(t, "pb")
			link(t, pa, pb, podPrefix)
			for _, p := range []*host{pa, pb} {
				installInPodRules(t, p)
			}
			serveConns(pb.listen(t, net.JoinHostPort(podB, portEcho)), echo)
			c := newCA(t)
			config := writeConfig(t, inPodConfig)
			// Node B first, so that the server pod is enrolled before the client dials it.
			nodeB := startInPodNode(t, pair[1], "node-b", c, config,
				zdsagent.Pod{UID: "Kubernetes//Pod/default/server", Name: "server", Namespace: "default", ServiceAccount: "server", NetNS: "/var/run/netns/" + pb.Name})
			nodeA := startInPodNode(t, pair[0], "node-a", c, config,
				zdsagent.Pod{UID: "Kubernetes//Pod/default/client", Name: "client", Namespace: "default", ServiceAccount: "client", NetNS: "/var/run/netns/" + pa.Name})

			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			conn, err := dialRetry(ctx, pa, net.JoinHostPort(podB, portEcho))
			if err != nil {
				t.Fatalf("pod A -> pod B: %v", err)
			}
			defer conn.Close()
			sent, got, err := stream(conn, 16<<20, 4)
			if err != nil || got != sent {
				t.Fatalf("16 MiB from pod A to pod B came back with %s, %v; sent %s", got, err, sent)
			}
			// Both ends saw the other's identity: the connection went over HBONE, so it
			// was captured on both sides and not sent straight across the veth.
			a := labels("reporter", "source", "source_principal", clientID, "destination_principal", serverID, "connection_security_policy", "mutual_tls")
			b := labels("reporter", "destination", "source_principal", clientID, "destination_principal", serverID, "connection_security_policy", "mutual_tls")
			if !eventually(func() bool { return hasSeries(nodeA.metrics(t), "istio_tcp_connections_opened_total", a...) }) {
				t.Errorf("node A (%s) counted no captured mTLS connection with %v", nodeA.prog, a)
			}
			if !eventually(func() bool { return hasSeries(nodeB.metrics(t), "istio_tcp_connections_opened_total", b...) }) {
				t.Errorf("node B (%s) counted no inbound mTLS connection with %v", nodeB.prog, b)
			}
			if pair[0] != pair[1] {
				return
			}
			open, err := dialRetry(ctx, pa, net.JoinHostPort(podB, portEcho))
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			open.Write([]byte("ping"))
			io.ReadFull(open, make([]byte, 4))
			var v [2]view
			for i, n := range []*node{nodeA, nodeB} {
				_, dump, err := n.get("15000", "/config_dump")
				if err != nil {
					t.Fatal(err)
				}
				v[i] = view{metrics: n.metrics(t), dump: dump}
				keep(t, pair[0]+"-inpod-"+[]string{"node-a", "node-b"}[i], v[i])
			}
			views[pair[0]] = v
			// /proc/sys/net is that of the reading process's namespace.
			migrate[pair[0]] = strings.TrimSpace(pa.MustExec(t, "cat", "/proc/sys/net/ipv4/tcp_migrate_req"))
		})
	}
	if t.Failed() {
		return
	}
	diffs := compareViews(views)
	if migrate[gozt] != migrate[rs] {
		diffs = append(diffs, "pod A: net.ipv4.tcp_migrate_req: gozt="+migrate[gozt]+", rs="+migrate[rs])
	}
	checkDifferences(t, "inpod", diffs)
}

// startInPodNode starts prog in a node namespace of its own, enrolled over ZDS with pod.
func startInPodNode(t *testing.T, prog, nodeName string, c *ca, config string, pod zdsagent.Pod) *node {
	t.Helper()
	h := newHost(t, nodeName)
	c.serveIn(t, h)
	agent, err := zdsagent.Listen(filepath.Join(t.TempDir(), "ztunnel.sock"), pod)
	if err != nil {
		t.Fatal(err)
	}
	replayed := make(chan error, 4)
	served := make(chan struct{})
	go func() {
		defer close(served)
		agent.Serve(func(_ int, err error) { replayed <- err })
	}()
	t.Cleanup(func() { agent.Close(); <-served })
	env := c.env(prog)
	for k, v := range map[string]string{
		"PROXY_MODE":     "shared",
		"NODE_NAME":      nodeName,
		"INPOD_UDS":      agent.Path,
		"XDS_ADDRESS":    "",
		"LOCAL_XDS_PATH": config,
		"PACKET_MARK":    "1337",
		"RUST_LOG":       "info",
	} {
		env[k] = v
	}
	n := startProcess(t, prog, h, env)
	select {
	case err := <-replayed:
		if err != nil {
			t.Fatalf("%s: ZDS snapshot: %v", prog, err)
		}
	case <-n.Done():
		t.Fatalf("%s exited before it took the pods; log:\n%s", prog, n.Tail(30))
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not connect to the ZDS agent in 30s; log:\n%s", prog, n.Tail(30))
	}
	n.waitReady(t)
	return n
}

// installInPodRules installs istio-cni's in-pod rules and routes in h.
func installInPodRules(t *testing.T, h *host) { installRules(t, h, cnirules.InPod()) }

// installRules installs iptables rules (each the arguments after `iptables -w`) and the
// in-pod routes in h.
func installRules(t *testing.T, h *host, rules [][]string) {
	t.Helper()
	for _, rule := range rules {
		h.MustExec(t, append([]string{"iptables", "-w"}, rule...)...)
	}
	for _, args := range cnirules.InPodRoutes() {
		h.MustExec(t, append([]string{"ip"}, args...)...)
	}
}

// dialRetry dials addr from inside h until it connects: a pod's listeners come up as its
// node takes it, and until then the rules send the connection nowhere.
func dialRetry(ctx context.Context, h *host, addr string) (net.Conn, error) {
	var last error
	for ctx.Err() == nil {
		c, err := h.dial(ctx, addr)
		if err == nil {
			return c, nil
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	return nil, errors.Join(ctx.Err(), last)
}

// TestInPodTPROXY is one pod-to-pod connection with the rules of the istio-cni releases that
// hand inbound TCP over with TPROXY (cnirules.InPodTPROXY), for each program on both nodes:
// both must accept it (their pod listeners are transparent).
func TestInPodTPROXY(t *testing.T) {
	requirePeers(t)
	for _, prog := range []string{gozt, rs} {
		t.Run(prog, func(t *testing.T) {
			pa, pb := newHost(t, "pa"), newHost(t, "pb")
			link(t, pa, pb, podPrefix)
			for _, p := range []*host{pa, pb} {
				installRules(t, p, cnirules.InPodTPROXY())
			}
			serveConns(pb.listen(t, net.JoinHostPort(podB, portEcho)), echo)
			c := newCA(t)
			config := writeConfig(t, inPodConfig)
			nodeB := startInPodNode(t, prog, "node-b", c, config,
				zdsagent.Pod{UID: "Kubernetes//Pod/default/server", Name: "server", Namespace: "default", ServiceAccount: "server", NetNS: "/var/run/netns/" + pb.Name})
			startInPodNode(t, prog, "node-a", c, config,
				zdsagent.Pod{UID: "Kubernetes//Pod/default/client", Name: "client", Namespace: "default", ServiceAccount: "client", NetNS: "/var/run/netns/" + pa.Name})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			conn, err := dialRetry(ctx, pa, net.JoinHostPort(podB, portEcho))
			if err != nil {
				t.Fatalf("pod A -> pod B: %v", err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(20 * time.Second))
			sent, got, err := stream(conn, 1<<20, 6)
			if err != nil || got != sent {
				t.Fatalf("1 MiB from pod A to pod B came back with %s, %v; sent %s", got, err, sent)
			}
			b := labels("reporter", "destination", "source_principal", clientID, "connection_security_policy", "mutual_tls")
			if !eventually(func() bool { return hasSeries(nodeB.metrics(t), "istio_tcp_connections_opened_total", b...) }) {
				t.Errorf("node B (%s) counted no inbound mTLS connection", prog)
			}
		})
	}
}
