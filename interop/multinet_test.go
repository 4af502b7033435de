//go:build linux

package interop

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone/hbonetest"
	"github.com/gozt/gozt/identity"
)

// Double HBONE across two networks: node A (net1) serves the client, node B (net2) the
// server, and a test east-west gateway in node B's namespace on serverIP:15009 forwards
// each outer CONNECT's bytes raw to node B's 15008. Each node reads its own network's view,
// as istiod sends it: node A sees the server without an address, behind the gateway. The
// service names the server's identity in its SANs: the Rust ztunnel's inner TLS expects
// those only (gozt's also the destination workload's).
const (
	gatewayPort = "15009"
	eastwestID  = "spiffe://cluster.local/ns/istio-system/sa/eastwest"
)

var net1View = `workloads:
  - {uid: c1//Pod/default/client, name: client, namespace: default, serviceAccount: client, trustDomain: cluster.local,
     clusterId: cluster1, network: net1, workloadIps: ["` + clientIP + `"], protocol: HBONE, node: node-a, services: {}}
  - {uid: c2//Pod/default/server, name: server, namespace: default, serviceAccount: server, trustDomain: cluster.local,
     clusterId: cluster2, network: net2, workloadIps: [], protocol: HBONE, node: node-b,
     networkGateway: {destination: "net2/` + serverIP + `", hboneMtlsPort: ` + gatewayPort + `},
     services: {"default/echo.default.svc.cluster.local": {80: 8080}}}
  - {uid: c2//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest,
     trustDomain: cluster.local, clusterId: cluster2, network: net2, workloadIps: ["` + serverIP + `"], protocol: TCP,
     node: node-b, services: {}}
services:
  - {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["net1/` + echoVIP + `"], ports: {80: 8080},
     subjectAltNames: ["` + serverID + `"]}
`

var net2View = `workloads:
  - {uid: c2//Pod/default/server, name: server, namespace: default, serviceAccount: server, trustDomain: cluster.local,
     clusterId: cluster2, network: net2, workloadIps: ["` + serverIP + `"], protocol: HBONE, node: node-b,
     services: {"default/echo.default.svc.cluster.local": {80: 8080}}}
services:
  - {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["net2/` + echoVIP + `"], ports: {80: 8080}}
`

// TestDoubleHBONE sends a connection from node A to the echo service through the gateway,
// for every pair of the two programs, and compares what each side did: the gateway's
// view of the outer CONNECT (authority, client identity, header names) and whether the
// destination took the client's network from the inner CONNECT.
func TestDoubleHBONE(t *testing.T) {
	requirePeers(t)
	outerHeaders := map[string]string{} // client program -> the outer CONNECT's header names
	for _, pair := range pairs {
		t.Run(pairName(pair), func(t *testing.T) {
			m := newHosts(t)
			serveConns(m.b.listen(t, net.JoinHostPort(serverIP, portEcho)), func(c *net.TCPConn) {
				io.WriteString(c, banner)
				echo(c)
			})
			now := time.Now()
			gwCert := m.ca.root.Issue(t, identity.MustParse(eastwestID), now.Add(-time.Minute), now.Add(time.Hour)).Certificate
			gw := hbonetest.ServeGateway(m.b.listen(t, net.JoinHostPort(serverIP, gatewayPort)), hbonetest.GatewayConfig{
				TLS: &tls.Config{Certificates: []tls.Certificate{gwCert}, ClientAuth: tls.RequireAnyClientCert, NextProtos: []string{"h2"}},
				Route: func(authority string) (netip.AddrPort, bool) {
					return netip.MustParseAddrPort(net.JoinHostPort(serverIP, "15008")), authority == "echo.default.svc.cluster.local:80"
				},
				Dial: func(ctx context.Context, addr string) (net.Conn, error) { return m.b.dial(ctx, addr) },
			})
			t.Cleanup(func() { gw.Close() })

			envB := m.dedicatedEnv(pair[1], "node-b", "default/server/server")
			envB["LOCAL_XDS_PATH"], envB["NETWORK"] = writeConfig(t, net2View), "net2"
			envA := m.dedicatedEnv(pair[0], "node-a", "default/client/client")
			envA["LOCAL_XDS_PATH"], envA["NETWORK"] = writeConfig(t, net1View), "net1"
			m.nodeB = startNode(t, pair[1], m.b, envB)
			m.nodeA = startNode(t, pair[0], m.a, envA)

			c := m.dial(t, echoVIP+":80")
			got := make([]byte, len(banner))
			if _, err := io.ReadFull(c, got); err != nil || string(got) != banner {
				t.Fatalf("through the gateway: %q, %v; want the server's banner", got, err)
			}
			io.WriteString(c, "ping")
			if _, err := io.ReadFull(c, got[:4]); err != nil || string(got[:4]) != "ping" {
				t.Fatalf("echo through the gateway: %q, %v", got[:4], err)
			}
			c.Close()

			reqs := gw.Requests()
			if len(reqs) != 1 || reqs[0].Authority != "echo.default.svc.cluster.local:80" || reqs[0].Peer.String() != clientID {
				t.Fatalf("gateway saw %+v; want one CONNECT echo.default.svc.cluster.local:80 from %s", reqs, clientID)
			}
			var names []string
			for k := range reqs[0].Header {
				names = append(names, strings.ToLower(k))
			}
			slices.Sort(names)
			outerHeaders[pair[0]] = strings.Join(names, ",")

			// The destination knows the client came from net1: gozt logs it; both take the
			// source from the peer's identity, not from the gateway's address.
			text := m.nodeB.metrics(t)
			if !hasSeries(text, "istio_tcp_connections_opened", labels("reporter", "destination", "source_principal", clientID)...) {
				t.Errorf("%s server: no inbound series from %s:\n%s", pair[1], clientID, strings.Join(series(text, "istio_tcp_connections_opened"), "\n"))
			}
			if pair[1] == gozt {
				deadline := time.Now().Add(5 * time.Second)
				for !slices.ContainsFunc(m.nodeB.logLines(), func(l string) bool { return strings.Contains(l, "src.network=net1") }) {
					if time.Now().After(deadline) {
						t.Errorf("gozt server's access log has no src.network=net1 (the %s client's x-forwarded-network):\n%s", pair[0], m.nodeB.Tail(10))
						break
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		})
	}
	if outerHeaders[gozt] != "" && outerHeaders[rs] != "" && outerHeaders[gozt] != outerHeaders[rs] {
		t.Errorf("outer CONNECT headers: gozt %s; rs %s; want the same", outerHeaders[gozt], outerHeaders[rs])
	}
	t.Logf("outer CONNECT headers: %v", outerHeaders)
}
