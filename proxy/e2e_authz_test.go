package proxy_test

// End-to-end tests of the two loopback nodes (e2e_test.go): who may reach whom. Peers
// with the wrong identity or trust domain, authorization policies (at setup, changed
// during it, and closing live connections), a workload calling itself, an IP reused by
// another identity.

import (
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

func TestWrongIdentityRefused(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	// Node C believes the server pod runs as sa "other"; node B serves it as "server".
	wrong := strings.Replace(m.yaml, "serviceAccount: server", "serviceAccount: other", 1)
	if wrong == m.yaml {
		t.Fatal("topology edit did not apply")
	}
	cnode := startNode(t, "node-c", m.caDir, wrong, m.clientConfig())

	if _, code, err := socksConnect(cnode.socks(t), m.serverIP, be.port()); err == nil || code == repSucceeded {
		t.Fatalf("connect with wrong expected identity: code %d, err %v; want a failure", code, err)
	}
	testutil.Eventually(t, "node C records the failure", func() bool {
		return counter(t, cnode.reg, "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "source", "destination_principal": "spiffe://cluster.local/ns/default/sa/other",
		}) == 1
	})
	// The right identity still works from node A, and only that connection reached the backend.
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("node A with the right identity: %v", err)
	}
	sendAndCheck(t, c, 100, 1)
	c.Close()
	if got := be.accepted.Load(); got != 1 {
		t.Errorf("backend accepted %d connections, want 1 (the refused one must not reach it)", got)
	}
}

// TestForeignTrustDomainRefused: node B serves cluster.local and must refuse a client whose
// certificate, although signed by the same CA, is for another trust domain.
func TestForeignTrustDomainRefused(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	foreign := strings.Replace(m.yaml, "serviceAccount: client", "serviceAccount: client\n    trustDomain: evil.local", 1)
	if foreign == m.yaml {
		t.Fatal("topology edit did not apply")
	}
	cnode := startNode(t, "node-c", m.caDir, foreign, m.clientConfig())
	if _, code, err := socksConnect(cnode.socks(t), m.serverIP, be.port()); err == nil || code == repSucceeded {
		t.Fatalf("connect from trust domain evil.local: code %d, err %v; want a failure", code, err)
	}
	testutil.Eventually(t, "node C records the failure", func() bool {
		return counter(t, cnode.reg, "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "source", "source_principal": "spiffe://evil.local/ns/default/sa/client",
		}) == 1
	})
	if got := be.accepted.Load(); got != 0 {
		t.Errorf("backend accepted %d connections from a foreign trust domain", got)
	}
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 0 {
		t.Errorf("node B opened %v connections for a foreign trust domain", got)
	}
}

func denyClient(name string) *state.Batch {
	return &state.Batch{Policies: []*state.Policy{{
		Name: name, Namespace: "default", Scope: state.ScopeNamespace, Action: state.ActionDeny,
		Rules: []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{
			Principals: []state.StringMatch{{Kind: state.MatchExact, Value: clientPrinc}},
		}}}}}},
	}}}
}

func TestAuthorization(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	deny := map[string]string{"reporter": "destination", "response_flags": metrics.FlagDeny, "source_principal": "spiffe://" + clientPrinc}

	t.Run("deny", func(t *testing.T) {
		m.b.store.Apply(denyClient("deny-client"))
		defer m.b.store.Apply(&state.Batch{RemovePolicies: []string{"default/deny-client"}})
		_, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err == nil || code != repNotAllowed {
			t.Fatalf("denied connect: code %d, err %v; want code %d (not allowed)", code, err, repNotAllowed)
		}
		testutil.Eventually(t, "node B records DENY", func() bool { return counter(t, m.b.reg, "istio_tcp_connections_closed_total", deny) == 1 })
		// Node A records after it has answered the client.
		testutil.Eventually(t, "node A records failed{DENY}", func() bool {
			return counter(t, m.a.reg, "istio_tcp_connections_failed_total", map[string]string{"reporter": "source", "response_flags": metrics.FlagDeny}) == 1
		})
		if got := be.accepted.Load(); got != 0 {
			t.Errorf("backend accepted %d connections despite DENY", got)
		}
	})

	t.Run("policy-change-closes-live-connection", func(t *testing.T) {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("allowed connect: %v", err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		buf := make([]byte, 5)
		if _, err := c.Write([]byte("alive")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "alive" {
			t.Fatalf("echo before policy change: %q, %v", buf, err)
		}
		// A second live connection, to another port, that the new policy does not cover.
		other := startBackend(t, m.serverIP+":0", echo)
		c2, _, err := socksConnect(m.a.socks(t), m.serverIP, other.port())
		if err != nil {
			t.Fatalf("allowed connect: %v", err)
		}
		defer c2.Close()
		_ = c2.SetDeadline(time.Now().Add(20 * time.Second))

		policy := denyClient("deny-client-live")
		policy.Policies[0].Rules[0].Clauses[0].Matches[0].DestinationPorts = []uint16{be.port()}
		m.b.store.Apply(policy)
		// The connection ends without the client closing it: EOF or reset.
		n, err := io.Copy(io.Discard, c)
		if ne := (net.Error)(nil); errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("live connection still open after the DENY policy (read %d bytes)", n)
		}
		// The other one is untouched.
		if _, err := c2.Write([]byte("still")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c2, buf); err != nil || string(buf) != "still" {
			t.Fatalf("connection the policy does not cover: echo %q, %v", buf, err)
		}
		testutil.Eventually(t, "node B records the policy close", func() bool { return counter(t, m.b.reg, "istio_tcp_connections_closed_total", deny) == 2 })
		if got := counter(t, m.b.reg, "istio_tcp_received_bytes_total", deny); got != 5 {
			t.Errorf("received bytes of the closed connection = %v, want 5", got)
		}
	})
}

func TestSelfCallRefused(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	targets := []string{m.clientIP + ":15008", m.clientIP + ":15001", "127.0.0.1:15080"}
	for _, a := range m.a.proxy.Addrs() {
		targets = append(targets, a.String())
	}
	for _, target := range targets {
		t.Run(target, func(t *testing.T) {
			host, portStr, _ := net.SplitHostPort(target)
			port, _ := strconv.ParseUint(portStr, 10, 16)
			_, code, err := socksConnect(m.a.socks(t), host, uint16(port))
			if err == nil || code != repNotAllowed {
				t.Fatalf("connect to own port %s: code %d, err %v; want code %d", target, code, err, repNotAllowed)
			}
		})
	}
	// A connection made straight to the outbound capture listener has no original
	// destination but the listener itself: it must be dropped, not looped.
	t.Run("outbound-listener-direct", func(t *testing.T) {
		c, err := net.Dial("tcp", m.a.addr(t, proxy.ListenerOutbound))
		if errors.Is(err, syscall.ECONNRESET) {
			return // dropped so soon that the reset beat connect's return: on loopback it can
		}
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := io.Copy(io.Discard, c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("direct connection to the outbound listener stays open")
		}
		if n != 0 {
			t.Fatalf("direct connection to the outbound listener got %d bytes", n)
		}
	})
	testutil.Eventually(t, "node A records every self-call as a CONNECT failure", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_failed_total", map[string]string{"response_flags": metrics.FlagConnect}) == float64(len(targets)+1)
	})
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 0 {
		t.Errorf("self-calls reached node B: %v connections", got)
	}
}

// TestPolicyChangeDuringSetup applies a DENY policy at the moment node B's upstream
// connection is made, between its authorization check and the copy: the connection must
// still be closed, whichever side of B's registration the change lands on.
func TestPolicyChangeDuringSetup(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	var round atomic.Int64
	applied := make(chan struct{}, 1)
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		m.b.store.Apply(denyClient("deny-during-setup-" + strconv.FormatInt(round.Load(), 10)))
		applied <- struct{}{}
		echo(c)
	})
	survived := 0
	const rounds = 50
	for i := range rounds {
		round.Store(int64(i))
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("round %d: connect before the policy: %v", i, err)
		}
		<-applied
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = io.Copy(io.Discard, c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			survived++
		}
		c.Close()
		m.b.store.Apply(&state.Batch{RemovePolicies: []string{"default/deny-during-setup-" + strconv.Itoa(i)}})
	}
	if survived > 0 {
		t.Errorf("%d of %d connections outlived a DENY policy applied during their setup", survived, rounds)
	}
}

// TestSelectorPolicyClosesLiveConnection: a WORKLOAD_SELECTOR DENY policy arrives together
// with the server workload's update that selects it; the live connection must be
// re-evaluated against the workload as it is now, and closed.
func TestSelectorPolicyClosesLiveConnection(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := pingEcho(c, "alive"); err != nil {
		t.Fatal(err)
	}
	selected := strings.Replace(m.yaml, "serviceAccount: server", "serviceAccount: server\n    authorizationPolicies: [default/sel-deny]", 1)
	if selected == m.yaml {
		t.Fatal("topology edit did not apply")
	}
	update := parseBatch(t, selected)
	policy := denyClient("sel-deny").Policies[0]
	policy.Scope = state.ScopeWorkloadSelector
	update.Policies = append(update.Policies, policy)
	m.b.store.Apply(update)

	// New connections are denied...
	if _, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port()); err == nil || code != repNotAllowed {
		t.Fatalf("new connection after the selector policy: code %d, err %v; want %d", code, err, repNotAllowed)
	}
	// ...and the live one is closed.
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("live connection still open after a selector DENY policy for its workload (read %d bytes)", n)
	}
}

// TestReusedIPNewIdentity: the workload at the server's IP is replaced by one with another
// identity (its IP reused) while node A still holds a pooled HBONE connection to the old
// one. Node A must not send the new workload's traffic over that connection, which was
// verified for the old identity: it dials anew, expecting the new identity, and since
// node B still serves the old one, the handshake fails and the connection is refused.
func TestReusedIPNewIdentity(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	sendAndCheck(t, c, 100, 1)
	c.Close()
	if n := hboneConns(t, m.serverIP); n != 1 {
		t.Fatalf("%d HBONE connections to node B after the first connection, want 1", n)
	}
	reused := strings.Replace(m.yaml, "serviceAccount: server", "serviceAccount: other", 1)
	if reused == m.yaml {
		t.Fatal("topology edit did not apply")
	}
	m.a.store.Apply(parseBatch(t, reused)) // node A learns the IP's new workload
	if _, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port()); err == nil || code == repSucceeded {
		t.Fatalf("connect to the reused IP: code %d, err %v; want a failure (node B still serves the old identity)", code, err)
	}
	if got := be.accepted.Load(); got != 1 {
		t.Errorf("backend accepted %d connections, want 1: the new identity's traffic must not ride the old connection", got)
	}
	testutil.Eventually(t, "node A to record the failure for the new identity", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "source", "destination_principal": "spiffe://cluster.local/ns/default/sa/other",
		}) == 1
	})
}
