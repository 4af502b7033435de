//go:build linux

package interop

import (
	"context"
	"io"
	"maps"
	"net"
	"slices"
	"testing"
	"time"
)

// observed holds, per case, what each pair did where the two programs may legitimately
// answer differently; compareObserved turns disagreements into differences.
type observed map[string]map[string]string // case -> pair -> outcome

func (o observed) add(kase, pair, outcome string) {
	if o[kase] == nil {
		o[kase] = map[string]string{}
	}
	o[kase][pair] = outcome
}

// TestFlows runs the same traffic through every pair of programs (client node → server
// node, over HBONE with certificates from one CA) in dedicated mode with SOCKS5: what must
// work is asserted per pair; what each pair answers to a reset backend and to each policy is
// compared across the pairs, and a disagreement not in testdata/differences.txt fails. The
// FIPS gozt beside the Rust ztunnel (fipsPairs) must work and answer as gozt does there.
func TestFlows(t *testing.T) {
	requirePeers(t)
	obs := observed{}
	for _, pair := range pairs {
		t.Run(pairName(pair), func(t *testing.T) {
			m := newMesh(t, pair)
			runFlows(t, m, pairName(pair), obs)
		})
	}
	for _, fp := range fipsPairs {
		t.Run(pairName(fp.pair), func(t *testing.T) {
			m := newMesh(t, fp.pair)
			runFlows(t, m, pairName(fp.pair), obs)
		})
	}
	checkDifferences(t, "flows", compareObserved(obs)) // pairs only
	for _, kase := range slices.Sorted(maps.Keys(obs)) {
		for _, fp := range fipsPairs {
			if got, want := obs[kase][pairName(fp.pair)], obs[kase][pairName(fp.as)]; got != want {
				t.Errorf("%s: %s=%s, %s=%s; want the same", kase, pairName(fp.pair), got, pairName(fp.as), want)
			}
		}
	}
}

func runFlows(t *testing.T, m *mesh, pair string, obs observed) {
	t.Run("echo", func(t *testing.T) {
		if got := m.roundTrip(net.JoinHostPort(serverIP, portEcho)); got != "ok" {
			t.Fatalf("round trip to the server workload: %s", got)
		}
	})
	t.Run("dedicated-capture", func(t *testing.T) {
		// Not through SOCKS5: dialed from node A's namespace and redirected to 15001. The
		// backend is reachable across the veth without ztunnel too, so the proof is node A
		// counting one more outbound mTLS connection.
		outbound := labels("reporter", "source", "source_principal", clientID, "destination_principal", serverID)
		before := sumSeries(m.nodeA.metrics(t), "istio_tcp_connections_opened_total", outbound...)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := m.a.dial(ctx, net.JoinHostPort(serverIP, portEcho))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		sent, got, err := stream(c, 4<<20, 5)
		if err != nil || got != sent {
			t.Fatalf("4 MiB through the captured path came back with %s, %v; sent %s", got, err, sent)
		}
		if !eventually(func() bool {
			return sumSeries(m.nodeA.metrics(t), "istio_tcp_connections_opened_total", outbound...) > before
		}) {
			t.Error("node A counted no new outbound mTLS connection: the rules did not hand it the client's")
		}
	})
	t.Run("service-vip", func(t *testing.T) {
		if got := m.roundTrip(net.JoinHostPort(echoVIP, "80")); got != "ok" {
			t.Fatalf("round trip to the service VIP: %s", got)
		}
	})
	t.Run("server-first", func(t *testing.T) {
		c := m.dial(t, net.JoinHostPort(serverIP, portServerFirst))
		got := make([]byte, len(banner))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != banner {
			t.Fatalf("banner before the client wrote: %q, %v", got, err)
		}
	})
	t.Run("half-close-client", func(t *testing.T) {
		// The client sends 1 MiB and half-closes; the server reads to EOF and only then
		// answers: the FIN went through both nodes and the return path stayed open.
		c := m.dial(t, net.JoinHostPort(serverIP, portSHA))
		sent, err := send(c, 1<<20, 1)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		if err != nil || string(got) != sent {
			t.Fatalf("server's SHA-256 of what it read %q; want %q", got, sent)
		}
	})
	t.Run("half-close-server", func(t *testing.T) {
		// The server writes and half-closes first; the client reads to EOF and then sends
		// 1 MiB, which the server must still receive in full.
		c := m.dial(t, net.JoinHostPort(serverIP, portHalfServer))
		b, err := io.ReadAll(c)
		if err != nil || string(b) != "bye" {
			t.Fatalf("client read %q, %v; want bye then EOF", b, err)
		}
		sent, err := send(c, 1<<20, 2)
		if err != nil {
			t.Fatal(err)
		}
		if n := <-m.halfServer; n != 1<<20 {
			t.Fatalf("server read %d bytes after its half-close; want %d (sent %s)", n, 1<<20, sent[:8])
		}
	})
	t.Run("64MiB", func(t *testing.T) {
		c := m.dial(t, net.JoinHostPort(serverIP, portEcho))
		sent, got, err := stream(c, 64<<20, 3)
		if err != nil {
			t.Fatal(err)
		}
		if got != sent {
			t.Fatalf("64 MiB came back with SHA-256 %s; sent %s", got, sent)
		}
	})
	t.Run("reset", func(t *testing.T) {
		// What the client sees when the server's backend resets: recorded, compared below.
		c := m.dial(t, net.JoinHostPort(serverIP, portReset))
		c.Write([]byte("x"))
		_, err := c.Read(make([]byte, 1))
		t.Logf("the backend reset; the client saw %s", errKind(err))
		obs.add("backend reset, client sees", pair, errKind(err))
	})
	t.Run("client-reset", func(t *testing.T) {
		// What the server's backend sees when the client resets: recorded, compared below.
		c := m.dial(t, net.JoinHostPort(serverIP, portReport))
		c.Write([]byte("x"))
		time.Sleep(50 * time.Millisecond) // the stream is up on node B
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
		select {
		case got := <-m.reported:
			t.Logf("the client reset; the backend saw %s", got)
			obs.add("client reset, backend sees", pair, got)
		case <-time.After(10 * time.Second):
			t.Error("the backend's connection stayed open 10s after the client reset")
		}
	})
	t.Run("policy", func(t *testing.T) {
		for _, p := range []struct{ port, want string }{
			{portEcho, "ok"},       // ALLOW by principal and port
			{portBySA, "ok"},       // ALLOW by service account and port
			{portNotAllowed, "no"}, // no ALLOW rule names the port
			{portDenied, "no"},     // ALLOW names it, a DENY rule by namespace too
			{portDenyByID, "no"},   // ALLOW names it, a DENY rule by principal too
		} {
			got := m.roundTrip(net.JoinHostPort(serverIP, p.port))
			if (got == "ok") != (p.want == "ok") {
				t.Errorf("port %s: %s; want %s", p.port, got, p.want)
			}
			obs.add("policy on port "+p.port+", client sees", pair, got)
		}
	})
	t.Run("certificates", func(t *testing.T) {
		// Each program's CA client asked the shared CA for its own workload's identity.
		asked := map[string]bool{}
		for _, r := range m.ca.srv.Requests() {
			if r.CSR != nil && len(r.CSR.URIs) == 1 {
				asked[r.CSR.URIs[0].String()] = true
			}
		}
		for _, id := range []string{clientID, serverID} {
			if !asked[id] {
				t.Errorf("no certificate request for %s; the CA saw %v", id, asked)
			}
		}
	})
	t.Run("identities", func(t *testing.T) {
		// Each side names the other by its SPIFFE identity in Istio's standard metrics.
		a := labels("reporter", "source", "source_principal", clientID, "destination_principal", serverID)
		b := labels("reporter", "destination", "source_principal", clientID, "destination_principal", serverID)
		if !eventually(func() bool { return hasSeries(m.nodeA.metrics(t), "istio_tcp_connections_opened_total", a...) }) {
			t.Errorf("node A (%s) has no istio_tcp_connections_opened_total with %v:\n%s", m.nodeA.prog, a,
				trimLog(joinLines(series(m.nodeA.metrics(t), "istio_tcp_connections_opened_total"))))
		}
		if !eventually(func() bool { return hasSeries(m.nodeB.metrics(t), "istio_tcp_connections_opened_total", b...) }) {
			t.Errorf("node B (%s) has no istio_tcp_connections_opened_total with %v:\n%s", m.nodeB.prog, b,
				trimLog(joinLines(series(m.nodeB.metrics(t), "istio_tcp_connections_opened_total"))))
		}
	})
}
