package proxy_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone/hbonetest"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/logtest"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// Two networks on one loopback subnet S: net1 has the client (S.2, node A) and server
// (S.3, node B); net2 has server2 (S.5, node C), a waypoint (S.7, node W) and the
// east-west gateway (S.6:15008, identity istio-system/eastwest). Each network sees the
// other's workloads as istiod describes them: no address, a network gateway.
//
// Services (VIP 127.10.9.x:80 -> 8080): echo has endpoints on both networks, remote
// only on net2, wpsvc has a waypoint on net2, impostor's endpoint "other" is on net2 but
// the gateway routes it to server2 (a different identity), nogw's endpoint is on net3,
// which has no gateway.
const multinetNet1 = `
workloads:
  - {uid: c1//Pod/default/client, name: client, namespace: default, serviceAccount: client, network: net1, clusterId: cluster1,
     workloadIps: ["S.2"], protocol: HBONE, services: {}}
  - {uid: c1//Pod/default/server, name: server, namespace: default, serviceAccount: server, network: net1, clusterId: cluster1,
     workloadIps: ["S.3"], protocol: HBONE, services: {"default/echo.default.svc.cluster.local": {80: 8080},
                                                      "default/sink-local.default.svc.cluster.local": {80: 9090}}}
  - {uid: c2//Pod/default/server2, name: server2, namespace: default, serviceAccount: server2, network: net2, clusterId: cluster2,
     protocol: HBONE, networkGateway: {destination: "net2/S.6", hboneMtlsPort: 15008},
     services: {"default/echo.default.svc.cluster.local": {80: 8080}, "default/remote.default.svc.cluster.local": {80: 8080},
                "default/wpsvc.default.svc.cluster.local": {80: 8080}}}
  - {uid: c2//Pod/default/sink2, name: sink2, namespace: default, serviceAccount: server2, network: net2, clusterId: cluster2,
     protocol: HBONE, networkGateway: {destination: "net2/S.6", hboneMtlsPort: 15008},
     services: {"default/sink-remote.default.svc.cluster.local": {80: 9090}}}
  - {uid: c2//Pod/default/other, name: other, namespace: default, serviceAccount: other, network: net2, clusterId: cluster2,
     protocol: HBONE, networkGateway: {destination: "net2/S.6", hboneMtlsPort: 15008},
     services: {"default/impostor.default.svc.cluster.local": {80: 8080}}}
  - {uid: c2//Pod/default/waypoint, name: waypoint, namespace: default, serviceAccount: waypoint, network: net2, clusterId: cluster2,
     protocol: HBONE, networkGateway: {destination: "net2/S.6", hboneMtlsPort: 15008},
     services: {"default/waypoint.default.svc.cluster.local": {15008: 15008}}}
  - {uid: c2//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest, network: net2,
     clusterId: cluster2, workloadIps: ["S.6"], protocol: HBONE, services: {}}
  - {uid: c3//Pod/default/island, name: island, namespace: default, serviceAccount: island, network: net3, workloadIps: ["10.3.0.1"],
     protocol: HBONE, services: {"default/nogw.default.svc.cluster.local": {80: 8080}}}
services:
  - {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["net1/127.10.9.1"], ports: {80: 8080}}
  - {name: remote, namespace: default, hostname: remote.default.svc.cluster.local, vips: ["net1/127.10.9.2"], ports: {80: 8080}}
  - {name: wpsvc, namespace: default, hostname: wpsvc.default.svc.cluster.local, vips: ["net1/127.10.9.3"], ports: {80: 8080},
     waypoint: {destination: "default/waypoint.default.svc.cluster.local", hboneMtlsPort: 15008}}
  - {name: waypoint, namespace: default, hostname: waypoint.default.svc.cluster.local, vips: ["net1/127.10.9.4"], ports: {15008: 15008}}
  - {name: nogw, namespace: default, hostname: nogw.default.svc.cluster.local, vips: ["net1/127.10.9.5"], ports: {80: 8080}}
  - {name: impostor, namespace: default, hostname: impostor.default.svc.cluster.local, vips: ["net1/127.10.9.6"], ports: {80: 8080}}
  - {name: sink-local, namespace: default, hostname: sink-local.default.svc.cluster.local, vips: ["net1/127.10.9.7"], ports: {80: 9090}}
  - {name: sink-remote, namespace: default, hostname: sink-remote.default.svc.cluster.local, vips: ["net1/127.10.9.8"], ports: {80: 9090}}
`

// Node C knows more of server2 than node A's view says (its workload and canonical
// names, its locality): node A learns them from server2's answer (response baggage).
const multinetNet2 = `
workloads:
  - {uid: c2//Pod/default/server2, name: server2, namespace: default, serviceAccount: server2, network: net2, clusterId: cluster2,
     workloadName: server2-v2, canonicalName: echo-app, canonicalRevision: v2, locality: {region: r2, zone: z2},
     workloadIps: ["S.5"], protocol: HBONE, networkGateway: {destination: "net2/S.6", hboneMtlsPort: 15008},
     services: {"default/echo.default.svc.cluster.local": {80: 8080}, "default/remote.default.svc.cluster.local": {80: 8080},
                "default/impostor.default.svc.cluster.local": {80: 8080},
                "default/sink-remote.default.svc.cluster.local": {80: 9090}}}
  - {uid: c2//Pod/default/waypoint, name: waypoint, namespace: default, serviceAccount: waypoint, network: net2, clusterId: cluster2,
     workloadIps: ["S.7"], protocol: HBONE, services: {}}
  - {uid: c2//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest, network: net2,
     clusterId: cluster2, workloadIps: ["S.6"], protocol: TCP, services: {}}
services:
  - {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: ["net2/127.10.8.1"], ports: {80: 8080}}
  - {name: remote, namespace: default, hostname: remote.default.svc.cluster.local, vips: ["net2/127.10.8.2"], ports: {80: 8080}}
  - {name: wpsvc, namespace: default, hostname: wpsvc.default.svc.cluster.local, vips: ["net2/127.10.8.3"], ports: {80: 8080}}
  - {name: impostor, namespace: default, hostname: impostor.default.svc.cluster.local, vips: ["net2/127.10.8.6"], ports: {80: 8080}}
  - {name: sink-remote, namespace: default, hostname: sink-remote.default.svc.cluster.local, vips: ["net2/127.10.8.8"], ports: {80: 9090}}
`

var eastwestID = identity.MustParse("spiffe://cluster.local/ns/istio-system/sa/eastwest")

// multinet is the two-network mesh: nodes, gateway and the access logs of A and C.
type multinet struct {
	sub        string
	a, b, c, w *node
	gw         *hbonetest.Gateway
	logA, logC *logtest.Recorder
}

// startMultinet starts the mesh; configure, if given, adjusts each node's proxy.Config
// ("node-a", "node-b", "node-c", "node-w").
func startMultinet(t testing.TB, configure ...func(node string, c *proxy.Config)) *multinet {
	t.Helper()
	var sub string
	for _, s := range subnets {
		if free(s+"3", []string{"15008", "8080", "9090"}) && free(s+"5", []string{"15008", "8080", "9090"}) &&
			free(s+"6", []string{"15008"}) && free(s+"7", []string{"15008", "8080"}) {
			sub = s
			break
		}
	}
	if sub == "" {
		t.Skipf("no loopback subnet of %v has 15008, 8080 and 9090 free on .3, .5, .6 and .7", subnets)
	}
	m := &multinet{sub: sub, logA: &logtest.Recorder{}, logC: &logtest.Recorder{}}
	caDir := filepath.Join(t.TempDir(), "ca")
	r := strings.NewReplacer("S.", sub)
	net1, net2 := r.Replace(multinetNet1), r.Replace(multinetNet2)
	for name, ip := range map[string]string{"server": "3", "server2": "5", "waypoint": "7"} {
		startBackend(t, sub+ip+":8080", func(c *net.TCPConn) {
			io.WriteString(c, name+"\n")
			echo(c)
		})
	}
	for _, ip := range []string{"3", "5"} {
		startBackend(t, sub+ip+":9090", chunkSink(benchChunk))
	}
	dedicated := func(node, name, network, ip string) proxy.Config {
		c := proxy.Config{
			Local:       state.Local{Mode: state.ModeDedicated, Network: network, Workload: state.WorkloadRef{Namespace: "default", Name: name, ServiceAccount: name}},
			InboundAddr: sub + ip + ":15008",
		}
		if node == "node-a" {
			c.InboundAddr, c.Socks5Addr = sub+"2:0", sub+"2:0"
		}
		for _, f := range configure {
			f(node, &c)
		}
		return c
	}
	m.b = startNode(t, "node-b", caDir, net1, dedicated("node-b", "server", "net1", "3"))
	m.c = startNodeLogged(t, "node-c", caDir, net2, dedicated("node-c", "server2", "net2", "5"), m.logC.Logger())
	m.w = startNode(t, "node-w", caDir, net2, dedicated("node-w", "waypoint", "net2", "7"))
	m.a = startNodeLogged(t, "node-a", caDir, net1, dedicated("node-a", "client", "net1", "2"), m.logA.Logger())

	builtin, err := ca.NewBuiltin(caDir, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	gwCerts := certs.New(certs.Config{}, builtin)
	t.Cleanup(func() { gwCerts.Close() })
	routes := map[string]string{
		"echo.default.svc.cluster.local:80":        sub + "5:15008",
		"remote.default.svc.cluster.local:80":      sub + "5:15008",
		"impostor.default.svc.cluster.local:80":    sub + "5:15008", // not "other": the peer presents server2's identity
		"wpsvc.default.svc.cluster.local:80":       sub + "7:15008", // the service's waypoint
		"sink-remote.default.svc.cluster.local:80": sub + "5:15008",
	}
	ln, err := net.Listen("tcp", sub+"6:15008")
	if err != nil {
		t.Skipf("gateway: %v", err)
	}
	gw := hbonetest.ServeGateway(ln, hbonetest.GatewayConfig{
		TLS: gwCerts.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return eastwestID, nil }),
		Dial: func(ctx context.Context, addr string) (net.Conn, error) { // from the gateway's own address
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(sub + "6")}}
			return d.DialContext(ctx, "tcp", addr)
		},
		Route: func(authority string) (netip.AddrPort, bool) {
			a, ok := routes[authority]
			if !ok {
				return netip.AddrPort{}, false
			}
			return netip.MustParseAddrPort(a), true
		},
	})
	t.Cleanup(func() { gw.Close() })
	m.gw = gw
	return m
}

// call connects through node A's SOCKS5 to vip:80 and returns the name the backend
// announced, after checking the connection echoes.
func (m *multinet) call(t *testing.T, vip string) (string, error) {
	t.Helper()
	c, _, err := socksConnect(m.a.socks(t), vip, 80)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	name, err := br.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("banner: %w", err)
	}
	msg := "hello from net1"
	io.WriteString(c, msg)
	c.CloseWrite()
	back, err := io.ReadAll(br)
	if err != nil || string(back) != msg {
		return "", fmt.Errorf("echo %q, %v; want %q", back, err, msg)
	}
	return strings.TrimSpace(name), nil
}

// benchChunk is what BenchmarkDoubleHBONE sends per iteration; the sinks acknowledge it.
const benchChunk = 4 << 20

func TestMultiNetwork(t *testing.T) {
	checkFDs(t)
	m := startMultinet(t)
	clientID := "spiffe://cluster.local/ns/default/sa/client"

	t.Run("remote service through the gateway", func(t *testing.T) {
		name, err := m.call(t, "127.10.9.2")
		if err != nil || name != "server2" {
			t.Fatalf("got %q, %v; want server2's answer", name, err)
		}
		reqs := m.gw.Requests()
		last := reqs[len(reqs)-1]
		if last.Authority != "remote.default.svc.cluster.local:80" || last.Peer.String() != clientID || last.Header.Get("X-Forwarded-Network") != "" {
			t.Errorf("gateway saw %q from %v, x-forwarded-network %q; want the service's authority from the client, no network on the outer CONNECT",
				last.Authority, last.Peer, last.Header.Get("X-Forwarded-Network"))
		}
		// Node C saw the client's network and identity and took its cluster from baggage.
		want := map[string]string{"reporter": "destination", "source_principal": clientID, "source_cluster": "cluster1",
			"destination_service": "remote.default.svc.cluster.local", "destination_workload": "server2-v2"}
		if err := eventually(func() bool { return counter(t, m.c.reg, "istio_tcp_connections_closed_total", want) >= 1 }); err != nil {
			t.Errorf("node C has no closed connection %v:\n%s", want, dumpCounters(m.c.reg))
		}
		if !hasLine(m.logC, "src.network=net1", "dst.hbone_addr=remote.default.svc.cluster.local:80") {
			t.Errorf("node C's access log lacks src.network=net1: %q", m.logC.Lines(slog.LevelInfo))
		}
		want = map[string]string{"reporter": "source", "destination_principal": "spiffe://cluster.local/ns/default/sa/server2",
			"destination_service": "remote.default.svc.cluster.local", "connection_security_policy": "mutual_tls"}
		if err := eventually(func() bool { return counter(t, m.a.reg, "istio_tcp_connections_closed_total", want) >= 1 }); err != nil {
			t.Errorf("node A has no closed connection %v:\n%s", want, dumpCounters(m.a.reg))
		}
	})

	t.Run("remote service by hostname", func(t *testing.T) {
		name, err := m.call(t, "remote.default.svc.cluster.local")
		if err != nil || name != "server2" {
			t.Fatalf("got %q, %v; want server2's answer", name, err)
		}
	})

	t.Run("endpoints on both networks share the service", func(t *testing.T) {
		seen := map[string]int{}
		for range 30 {
			name, err := m.call(t, "127.10.9.1")
			if err != nil {
				t.Fatal(err)
			}
			seen[name]++
		}
		if seen["server"] == 0 || seen["server2"] == 0 {
			t.Errorf("answers over 30 calls: %v; want both networks' endpoints", seen)
		}
	})

	t.Run("waypoint on the remote network", func(t *testing.T) {
		name, err := m.call(t, "127.10.9.3")
		if err != nil || name != "waypoint" {
			t.Fatalf("got %q, %v; want the waypoint's answer", name, err)
		}
	})

	t.Run("inner identity mismatch is refused", func(t *testing.T) {
		before := m.gw.Forwarded.Load()
		if name, err := m.call(t, "127.10.9.6"); err == nil {
			t.Fatalf("impostor answered as %q; want the inner TLS to refuse server2's identity", name)
		}
		if m.gw.Forwarded.Load() == before {
			t.Error("the gateway forwarded nothing: the outer leg should have succeeded")
		}
		if !hasLine(m.logA, "dst.hbone_addr=impostor.default.svc.cluster.local:80", "spiffe://cluster.local/ns/default/sa/other") {
			t.Errorf("node A's access log does not name the identity it expected: %q", m.logA.Lines(slog.LevelWarn))
		}
	})

	// Every connection through the gateway reaches node C from the gateway's address. Its
	// per-source budgets would let one client's failed handshakes (here, 20 refused
	// impostor calls: the failure budget's burst is 16) shut out every other client behind
	// the gateway; they do not apply to a network gateway.
	t.Run("failed handshakes through the gateway shut nobody out", func(t *testing.T) {
		for range 20 {
			m.call(t, "127.10.9.6")
		}
		if name, err := m.call(t, "127.10.9.2"); err != nil || name != "server2" {
			t.Fatalf("after 20 failed handshakes through the gateway: %q, %v; want server2's answer", name, err)
		}
	})

	t.Run("no gateway is a clear error", func(t *testing.T) {
		if name, err := m.call(t, "127.10.9.5"); err == nil {
			t.Fatalf("nogw answered as %q", name)
		}
		if !hasLine(m.logA, "no network gateway", "island") {
			t.Errorf("node A's access log does not say the gateway is missing: %q", m.logA.Lines(slog.LevelWarn))
		}
	})
}

// Baggage across networks, as the Rust ztunnel reads it (istio/ztunnel#1734): node A
// knows server2 only as node A's view describes it; server2's node answers the inner
// CONNECT with baggage naming its workload, canonical service and revision, cluster and
// locality, which node A's metrics and access log take for the destination. With
// ENABLE_RESPONSE_BAGGAGE=false on node C (DisableBaggage) it answers without, and
// node A keeps its own view; node C then ignores the client's baggage too, so a client it
// knows only through the gateway has no cluster.
func TestDoubleHBONEBaggage(t *testing.T) {
	checkFDs(t)
	const clientID = "spiffe://cluster.local/ns/default/sa/client"
	for _, tc := range []struct {
		name    string
		disable bool
		atA     map[string]string // node A's (source) labels of the connection
		logA    []string          // in node A's access record
		atC     map[string]string // node C's (destination) labels
	}{{
		name: "default",
		atA: map[string]string{"reporter": "source", "destination_workload": "server2-v2", "destination_canonical_service": "echo-app",
			"destination_canonical_revision": "v2", "destination_app": "server2-v2", "destination_version": "v2",
			"destination_cluster": "cluster2", "destination_workload_namespace": "default", "destination_region": "r2", "destination_zone": "z2",
			"destination_principal": "spiffe://cluster.local/ns/default/sa/server2", "destination_service": "remote.default.svc.cluster.local"},
		logA: []string{"dst.workload=server2-v2", "dst.namespace=default"},
		atC:  map[string]string{"reporter": "destination", "source_principal": clientID, "source_cluster": "cluster1"},
	}, {
		name: "ENABLE_RESPONSE_BAGGAGE=false", disable: true,
		atA: map[string]string{"reporter": "source", "destination_workload": "server2", "destination_canonical_service": "server2",
			"destination_canonical_revision": "unknown", "destination_cluster": "cluster2", "destination_region": "unknown"},
		logA: []string{"dst.workload=server2"},
		atC:  map[string]string{"reporter": "destination", "source_principal": clientID, "source_cluster": "unknown"},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			m := startMultinet(t, func(node string, c *proxy.Config) { c.DisableBaggage = tc.disable && node == "node-c" })
			if name, err := m.call(t, "127.10.9.2"); err != nil || name != "server2" {
				t.Fatalf("got %q, %v; want server2's answer", name, err)
			}
			if err := eventually(func() bool { return counter(t, m.a.reg, "istio_tcp_connections_closed_total", tc.atA) >= 1 }); err != nil {
				t.Errorf("node A has no closed connection %v:\n%s", tc.atA, dumpCounters(m.a.reg))
			}
			if !hasLine(m.logA, append([]string{"dst.hbone_addr=remote.default.svc.cluster.local:80"}, tc.logA...)...) {
				t.Errorf("node A's access log lacks %v: %q", tc.logA, m.logA.Lines(slog.LevelInfo))
			}
			if err := eventually(func() bool { return counter(t, m.c.reg, "istio_tcp_connections_closed_total", tc.atC) >= 1 }); err != nil {
				t.Errorf("node C has no closed connection %v:\n%s", tc.atC, dumpCounters(m.c.reg))
			}
		})
	}
}

// hasLine reports whether some access-log line (any level) contains every one of parts.
func hasLine(r *logtest.Recorder, parts ...string) bool {
	ok := false
	_ = eventually(func() bool {
		for _, lvl := range []slog.Level{slog.LevelInfo, slog.LevelWarn, slog.LevelError, slog.LevelDebug} {
		lines:
			for _, l := range r.Lines(lvl) {
				for _, p := range parts {
					if !strings.Contains(l, p) {
						continue lines
					}
				}
				ok = true
				return true
			}
		}
		return false
	})
	return ok
}

func eventually(f func() bool) error {
	for range 100 {
		if f() {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("timed out")
}
