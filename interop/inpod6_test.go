//go:build linux

package interop

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/cnirules"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// The dual-stack in-pod topology: TestInPod's pods, each with an IPv6 address beside its
// IPv4 one, and the echo service with a VIP of each family.
const (
	podA6      = "fd00:32::1"
	podB6      = "fd00:32::2"
	inPodVIP4  = "10.96.32.1"
	inPodVIP6  = "fd00:96:32::1"
	inPodEchoH = "echo.default.svc.cluster.local."
)

var inPodConfig6 = `workloads:
  - uid: Kubernetes//Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["` + podA + `", "` + podA6 + `"]
    protocol: HBONE
    node: node-a
    services: {}
  - uid: Kubernetes//Pod/default/server
    name: server
    namespace: default
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["` + podB + `", "` + podB6 + `"]
    protocol: HBONE
    node: node-b
    services:
      "default/echo.default.svc.cluster.local":
        80: 8080
services:
  - name: echo
    namespace: default
    hostname: echo.default.svc.cluster.local
    vips: ["/` + inPodVIP4 + `", "/` + inPodVIP6 + `"]
    ports:
      80: 8080
`

// TestInPodIPv6 runs every pair in in-pod mode with dual-stack pods and istio-cni's rules
// for both families (iptables and ip6tables, and the ::/0 route), in both shapes istio-cni
// has installed: REDIRECT (cnirules.InPod6, istio 1.24 and later) and TPROXY
// (cnirules.InPodTPROXY6, 1.22 and 1.23). Pod A's connections to pod B's IPv6 address and
// to the service's IPv6 VIP are captured on A's [::]:15001 and carried over HBONE to B's
// 15008 over IPv6; pod A's DNS question to an IPv6 server is answered by its node's DNS
// proxy on [::1]:15053 with the service's IPv6 VIP.
func TestInPodIPv6(t *testing.T) {
	requirePeers(t)
	netnstest.Require(t, "ip6tables")
	shapes := []struct {
		name   string
		v4, v6 [][]string
	}{
		{"REDIRECT", cnirules.InPod(), cnirules.InPod6()},
		{"TPROXY", cnirules.InPodTPROXY(), cnirules.InPodTPROXY6()},
	}
	for _, pair := range pairs {
		for _, shape := range shapes {
			t.Run(pairName(pair)+"/"+shape.name, func(t *testing.T) {
				pa, pb := newHost(t, "pa"), newHost(t, "pb")
				link(t, pa, pb, podPrefix)
				link6(t, pa, podA6, pb, podB6)
				for _, p := range []*host{pa, pb} {
					installRules(t, p, shape.v4)
					installRules6(t, p, shape.v6)
				}
				serveConns(pb.listen(t, net.JoinHostPort(podB6, portEcho)), echo)
				c := newCA(t)
				config := writeConfig(t, inPodConfig6)
				nodeB := startInPodNode(t, pair[1], "node-b", c, config,
					zdsagent.Pod{UID: "Kubernetes//Pod/default/server", Name: "server", Namespace: "default", ServiceAccount: "server", NetNS: "/var/run/netns/" + pb.Name})
				nodeA := startInPodNode(t, pair[0], "node-a", c, config,
					zdsagent.Pod{UID: "Kubernetes//Pod/default/client", Name: "client", Namespace: "default", ServiceAccount: "client", NetNS: "/var/run/netns/" + pa.Name})

				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				for i, target := range []string{net.JoinHostPort(podB6, portEcho), net.JoinHostPort(inPodVIP6, "80")} {
					conn, err := dialRetry(ctx, pa, target)
					if err != nil {
						t.Fatalf("pod A -> %s: %v", target, err)
					}
					conn.SetDeadline(time.Now().Add(20 * time.Second))
					sent, got, err := stream(conn, 1<<20, uint64(7+i))
					conn.Close()
					if err != nil || got != sent {
						t.Fatalf("1 MiB from pod A to %s came back with %s, %v; sent %s", target, got, err, sent)
					}
				}
				a := labels("reporter", "source", "source_principal", clientID, "destination_principal", serverID, "connection_security_policy", "mutual_tls")
				b := labels("reporter", "destination", "source_principal", clientID, "destination_principal", serverID, "connection_security_policy", "mutual_tls")
				if !eventually(func() bool { return sumSeries(nodeA.metrics(t), "istio_tcp_connections_opened_total", a...) >= 2 }) {
					t.Errorf("node A (%s) counted fewer than 2 captured mTLS connections with %v", nodeA.prog, a)
				}
				if !eventually(func() bool { return sumSeries(nodeB.metrics(t), "istio_tcp_connections_opened_total", b...) >= 2 }) {
					t.Errorf("node B (%s) counted fewer than 2 inbound mTLS connections with %v", nodeB.prog, b)
				}
				// Nothing listens on pod B's port 53: pod A's rules send the question to its
				// own [::1]:15053.
				if got, want := askAt(t, pa, net.JoinHostPort(podB6, "53"), inPodEchoH, dns.TypeAAAA), "NOERROR AAAA "+inPodVIP6; got != want {
					t.Errorf("node A (%s): AAAA %s asked over IPv6: %q; want %q", nodeA.prog, inPodEchoH, got, want)
				}
			})
		}
	}
}

// link6 gives two linked hosts an IPv6 address each on their veth (nodad: usable at once)
// and a default route via the other, as a pod has one (a service VIP is reached through
// it), and waits for duplicate address detection (netnstest.NS.WaitDAD).
func link6(t *testing.T, a *host, aIP string, b *host, bIP string) {
	t.Helper()
	for _, h := range []struct {
		*host
		ip, peer string
	}{{a, aIP, bIP}, {b, bIP, aIP}} {
		h.AddAddrBeside(t, h.host.ip, h.ip+"/64")
		h.MustExec(t, "ip", "-6", "route", "add", "default", "via", h.peer)
	}
	a.WaitDAD(t)
	b.WaitDAD(t)
}

// installRules6 installs ip6tables rules (each the arguments after `ip6tables -w`) and the
// IPv6 in-pod routes in h.
func installRules6(t *testing.T, h *host, rules [][]string) {
	t.Helper()
	for _, rule := range rules {
		h.MustExec(t, append([]string{"ip6tables", "-w"}, rule...)...)
	}
	for _, args := range cnirules.InPodRoutes6() {
		h.MustExec(t, append([]string{"ip"}, args...)...)
	}
}
