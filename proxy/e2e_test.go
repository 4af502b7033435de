package proxy_test

// End-to-end tests of two nodes on loopback: a SOCKS5 client on node A (default/client,
// 127.0.0.2) reaches a backend of default/server (127.0.0.3) through a real mTLS HBONE tunnel
// to node B's 15008, with both nodes' certificates from one built-in CA.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// payload is size pseudo-random bytes determined by seed.
func payload(seed uint64, size int64) io.Reader {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	return io.LimitReader(rand.NewChaCha8(key), size)
}

// sendAndCheck writes size pseudo-random bytes to c, half-closes, and checks that exactly
// the same bytes come back (by SHA-256) before EOF.
func sendAndCheck(t testing.TB, c *net.TCPConn, size int64, seed uint64) {
	t.Helper()
	src := payload(seed, size)
	sent := sha256.New()
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.TeeReader(src, sent))
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	got := sha256.New()
	n, rerr := io.Copy(got, c)
	if rerr != nil || n != size {
		c.Close() // unblock the writer
	}
	if err := <-werr; err != nil && rerr == nil && n == size {
		t.Fatalf("write %d bytes: %v", size, err)
	}
	if rerr != nil {
		t.Fatalf("read echo: %v after %d of %d bytes", rerr, n, size)
	}
	if n != size {
		t.Fatalf("echo: got %d bytes, want %d", n, size)
	}
	if !bytes.Equal(got.Sum(nil), sent.Sum(nil)) {
		t.Fatalf("echo of %d bytes: content differs", size)
	}
}

func TestPayloadsThroughHBONE(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	for i, size := range []int64{0, 1, 64 << 10, 64 << 20} {
		t.Run(strconv.FormatInt(size, 10), func(t *testing.T) {
			c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
			if err != nil {
				t.Fatalf("socks5 connect: code %d: %v", code, err)
			}
			defer c.Close()
			sendAndCheck(t, c, size, uint64(i))
		})
	}
	if got := be.accepted.Load(); got != 4 {
		t.Errorf("backend accepted %d connections, want 4", got)
	}
	// One after another, the streams share one pooled HBONE connection.
	if got := hboneConns(t, m.serverIP); got != 1 {
		t.Errorf("%d HBONE connections from node A to node B, want 1 reused", got)
	}
}

// Connections that come one after another are set up by one goroutine, which keeps the
// stack setup grew: after each, exactly one goroutine waits in setupLoop, the same one.
func TestSetupGoroutineReused(t *testing.T) {
	leaktest.Check(t)
	proxy.SetSetupIdle(t, time.Minute) // a slow machine must not see the goroutine retire
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	waiting := func() []string {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		var ids []string
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "[select") && strings.Contains(g, "proxy.(*Proxy).setupLoop(") {
				ids = append(ids, strings.Fields(g)[1])
			}
		}
		return ids
	}
	var first string
	for i := range 5 {
		c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("socks5 connect: code %d: %v", code, err)
		}
		sendAndCheck(t, c, 100, uint64(i))
		c.Close()
		var ids []string
		testutil.Eventually(t, "a goroutine waiting in setupLoop", func() bool { ids = waiting(); return len(ids) > 0 })
		if len(ids) != 1 {
			t.Fatalf("connection %d: goroutines waiting in setupLoop %v, want one", i, ids)
		}
		if i == 0 {
			first = ids[0]
		} else if ids[0] != first {
			t.Fatalf("connection %d set up by goroutine %s, the first by %s; want it reused", i, ids[0], first)
		}
	}
}

func TestCurlThroughSocks(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("curl not installed")
	}
	leaktest.Check(t)
	checkFDs(t)
	// The echo service of the example routes port 80 to 8080 on the server pod.
	m := newMesh(t, "8080")
	ln, err := net.Listen("tcp", m.serverIP+":8080")
	if err != nil {
		t.Skipf("needs %s:8080 free for the example's echo service: %v", m.serverIP, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s from %s", r.URL.Path, r.Host)
	})}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	defer func() {
		srv.Close()
		<-served
	}()
	m.start(t)
	for _, tc := range []struct{ name, url, want string }{
		{"by-ip", "http://" + m.serverIP + ":8080/ip", "hello /ip from " + m.serverIP + ":8080"},
		{"by-hostname", "http://echo.default.svc.cluster.local/name", "hello /name from echo.default.svc.cluster.local"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, curl, "-sS", "--fail", "--noproxy", "", "--socks5-hostname", m.a.socks(t), tc.url)
			cmd.Env = []string{"PATH=/usr/bin:/bin"}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("curl %s: %v\n%s", tc.url, err, out)
			}
			if string(out) != tc.want {
				t.Fatalf("curl %s: got %q, want %q", tc.url, out, tc.want)
			}
		})
	}
	// Node A knows the service only for the hostname request; node B guesses it for both
	// from the server's port map (8080 is echo's target port).
	echoSvc := map[string]string{"destination_service": "echo.default.svc.cluster.local"}
	testutil.Eventually(t, "both connections recorded", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_closed_total", echoSvc) == 2 &&
			counter(t, m.a.reg, "istio_tcp_connections_closed_total", nil) == 2
	})
	if got := counter(t, m.a.reg, "istio_tcp_connections_closed_total", echoSvc); got != 1 {
		t.Errorf("node A: %v connections labelled with the echo service, want 1\n%s", got, dumpCounters(m.a.reg))
	}
}

func TestHalfClose(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)

	t.Run("client-first", func(t *testing.T) {
		// The client sends and half-closes; the server reads to EOF, then still answers.
		be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			req, err := io.ReadAll(c)
			if err != nil {
				return
			}
			fmt.Fprintf(c, "got %d bytes: %s", len(req), req)
			_ = c.CloseWrite()
		})
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("request")); err != nil {
			t.Fatal(err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("read after half-close: %v (got %q)", err, resp)
		}
		if want := "got 7 bytes: request"; string(resp) != want {
			t.Fatalf("response after client FIN: got %q, want %q", resp, want)
		}
	})

	t.Run("server-first", func(t *testing.T) {
		// The server greets and half-closes at once; the client sees EOF, then still sends.
		got := make(chan string, 1)
		be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			if _, err := c.Write([]byte("greeting")); err != nil {
				got <- "write: " + err.Error()
				return
			}
			if err := c.CloseWrite(); err != nil {
				got <- "closewrite: " + err.Error()
				return
			}
			req, err := io.ReadAll(c)
			if err != nil {
				got <- "read: " + err.Error()
				return
			}
			got <- string(req)
		})
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		greet, err := io.ReadAll(c)
		if err != nil || string(greet) != "greeting" {
			t.Fatalf("read until server FIN: %q, %v; want %q", greet, err, "greeting")
		}
		if _, err := c.Write([]byte("after your FIN")); err != nil {
			t.Fatalf("write after server FIN: %v", err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		select {
		case s := <-got:
			if s != "after your FIN" {
				t.Fatalf("server received %q after its FIN, want %q", s, "after your FIN")
			}
		case <-time.After(20 * time.Second):
			t.Fatal("server never saw the client's bytes and FIN")
		}
	})
}

func TestThousandConcurrentConnections(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	const n = 1000
	socks := m.a.socks(t)

	// Every connection is established before any sends, so all 1000 are open at once.
	var established, done sync.WaitGroup
	established.Add(n)
	done.Add(n)
	start := make(chan struct{})
	errs := make(chan error, n)
	for i := range n {
		go func() {
			defer done.Done()
			c, code, err := socksConnect(socks, m.serverIP, be.port())
			established.Done()
			if err != nil {
				errs <- fmt.Errorf("conn %d: code %d: %w", i, code, err)
				return
			}
			defer c.Close()
			<-start
			msg := fmt.Appendf(nil, "connection %04d %s", i, strings.Repeat("x", i))
			if _, err := c.Write(msg); err != nil {
				errs <- fmt.Errorf("conn %d: write: %w", i, err)
				return
			}
			if err := c.CloseWrite(); err != nil {
				errs <- fmt.Errorf("conn %d: closewrite: %w", i, err)
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			got, err := io.ReadAll(c)
			if err != nil || !bytes.Equal(got, msg) {
				errs <- fmt.Errorf("conn %d: echo %d bytes (%v), want %d", i, len(got), err, len(msg))
			}
		}()
	}
	established.Wait()
	// Every connection is held open until start: node B must see all of them at once.
	// (On a failure above this gives up after a while and reports the failures below.)
	allOpen := testutil.Poll(testutil.Timeout, func() error {
		if got := counter(t, m.b.reg, "istio_tcp_sockets_open", map[string]string{"reporter": "destination"}); got != n {
			return fmt.Errorf("%v open", got)
		}
		return nil
	}) == nil
	// At most 100 streams share a pooled connection, so 1000 need at least 10.
	pooled := hboneConns(t, m.serverIP)
	close(start)
	done.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if failed < 5 {
			t.Error(err)
		}
		failed++
	}
	if failed > 0 {
		t.Fatalf("%d of %d connections failed", failed, n)
	}
	if pooled < n/100 || pooled > 2*n/100 {
		t.Errorf("%d HBONE connections carry %d streams, want %d to %d (100 streams each)", pooled, n, n/100, 2*n/100)
	}
	t.Logf("%d streams on %d HBONE connections", n, pooled)
	if !allOpen {
		t.Errorf("node B never had all %d inbound connections open at once", n)
	}
	if got := be.accepted.Load(); got != n {
		t.Errorf("backend accepted %d connections, want %d", got, n)
	}
	testutil.Eventually(t, "all connections recorded closed on both nodes", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "source"}) == n &&
			counter(t, m.b.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "destination"}) == n
	})
}

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

func TestPassthroughUnknownDestination(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	outside := startBackend(t, m.outsideIP+":0", echo)
	c, code, err := socksConnect(m.a.socks(t), m.outsideIP, outside.port())
	if err != nil {
		t.Fatalf("passthrough connect: code %d: %v", code, err)
	}
	sendAndCheck(t, c, 256<<10, 7)
	c.Close()
	testutil.Eventually(t, "node A records the passthrough", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "source"}) == 1
	})
	// Plain TCP: nothing went through node B, and A did not claim mTLS.
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 0 {
		t.Errorf("node B saw %v connections for an out-of-mesh destination", got)
	}
	if got := counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"connection_security_policy": "mutual_tls"}); got != 0 {
		t.Errorf("passthrough recorded as mutual_tls")
	}
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

// pingEcho sends msg and expects it echoed.
func pingEcho(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echo %q, want %q", buf, msg)
	}
	return nil
}

func TestDrainWithLiveConnection(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	socks := m.a.socks(t)
	c, _, err := socksConnect(socks, m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ping := func(msg string) error { return pingEcho(c, msg) }
	if err := ping("before"); err != nil {
		t.Fatal(err)
	}

	const deadline = 1500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	shutdown := make(chan error, 1)
	go func() { shutdown <- m.a.shutdown(ctx) }()

	// New connections are refused once draining starts.
	testutil.Eventually(t, "the SOCKS5 listener to close", func() bool {
		nc, err := net.DialTimeout("tcp", socks, time.Second)
		if err == nil {
			nc.Close()
		}
		return err != nil
	})
	// The live one keeps flowing while the deadline has not passed.
	for i := 0; time.Since(began) < deadline/2; i++ {
		if err := ping(fmt.Sprintf("during drain %d", i)); err != nil {
			t.Fatalf("live connection broke during drain after %v: %v", time.Since(began), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case err := <-shutdown:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(deadline + 10*time.Second):
		t.Fatal("Shutdown did not return after its deadline")
	}
	if took := time.Since(began); took < deadline {
		t.Errorf("Shutdown returned after %v, before its %v deadline, with a live connection", took, deadline)
	}
	// Then it is closed.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("live connection still open after Shutdown returned")
		}
	}
}

// TestDrainServerNode drains node B: its HBONE listener closes and node A's pooled
// connection gets GOAWAY, so new connections fail while the live stream keeps flowing until
// the deadline.
func TestDrainServerNode(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ping := func(msg string) error { return pingEcho(c, msg) }
	if err := ping("before"); err != nil {
		t.Fatal(err)
	}
	const deadline = 1500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	shutdown := make(chan error, 1)
	go func() { shutdown <- m.b.shutdown(ctx) }()

	// A connect may still get through before node B has begun to drain; the backend
	// accepts those too.
	openedEarly := int64(0)
	testutil.Eventually(t, "new connections through node A to draining node B to fail", func() bool {
		nc, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err == nil {
			openedEarly++
			nc.Close()
		}
		return err != nil
	})
	if err := ping("during drain"); err != nil && time.Since(began) < deadline-200*time.Millisecond {
		t.Fatalf("live stream broke during node B's drain after %v: %v", time.Since(began), err)
	}
	select {
	case err := <-shutdown:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(deadline + 10*time.Second):
		t.Fatal("node B's Shutdown did not return after its deadline")
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("client connection still open after node B closed its stream")
		}
	}
	if got, want := be.accepted.Load(), 1+openedEarly; got != want {
		t.Errorf("backend accepted %d connections, want %d (the live one and %d opened before the drain began)", got, want, openedEarly)
	}
}

func TestMetricsBothReporters(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	// The backend reads the whole request, then answers three times as many bytes.
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		n, err := io.Copy(io.Discard, c)
		if err != nil {
			return
		}
		_, _ = c.Write(bytes.Repeat([]byte("r"), int(3*n)))
		_ = c.CloseWrite()
	})
	const conns, req = 3, 1000
	for range conns {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write(bytes.Repeat([]byte("q"), req))
		_ = c.CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || len(got) != 3*req {
			t.Fatalf("response: %d bytes, %v; want %d", len(got), err, 3*req)
		}
	}
	common := map[string]string{
		"source_principal":           "spiffe://" + clientPrinc,
		"destination_principal":      "spiffe://" + serverPrinc,
		"source_workload":            "client",
		"destination_workload":       "server",
		"connection_security_policy": "mutual_tls",
		"response_flags":             "-",
	}
	for _, n := range []*node{m.a, m.b} {
		reporter := "source"
		if n == m.b {
			reporter = "destination"
		}
		labels := map[string]string{"reporter": reporter}
		for k, v := range common {
			labels[k] = v
		}
		testutil.Eventually(t, n.name+" closes", func() bool { return counter(t, n.reg, "istio_tcp_connections_closed_total", labels) == conns })
		for name, want := range map[string]float64{
			"istio_tcp_connections_opened_total": conns,
			"istio_tcp_received_bytes_total":     conns * req,     // client to server
			"istio_tcp_sent_bytes_total":         conns * 3 * req, // server to client
			"istio_tcp_connections_failed_total": 0,
		} {
			if got := counter(t, n.reg, name, labels); got != want {
				t.Errorf("%s %s%v = %v, want %v\n%s", n.name, name, labels, got, want, dumpCounters(n.reg))
			}
		}
		// Only its own reporter on each node.
		other := map[string]string{"reporter": map[string]string{"source": "destination", "destination": "source"}[reporter]}
		if got := counter(t, n.reg, "istio_tcp_connections_opened_total", other); got != 0 {
			t.Errorf("%s recorded %v connections as %s", n.name, got, other["reporter"])
		}
		if got := counter(t, n.reg, "istio_tcp_sockets_open", nil); got != 0 {
			t.Errorf("%s: istio_tcp_sockets_open = %v after every connection closed", n.name, got)
		}
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

// TestUpstreamRefused: node B cannot reach the pod's port, answers 503, and node A turns
// that into SOCKS5 "connection refused"; both record a CONNECT failure.
func TestUpstreamRefused(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	_, code, err := socksConnect(m.a.socks(t), m.serverIP, closedPort(t, m.serverIP))
	if err == nil || code != 5 {
		t.Fatalf("connect to a closed port behind node B: code %d, err %v; want 5 (connection refused)", code, err)
	}
	failed := map[string]string{"response_flags": metrics.FlagConnect}
	testutil.Eventually(t, "both nodes record CONNECT failures", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_failed_total", failed) == 1 &&
			counter(t, m.b.reg, "istio_tcp_connections_failed_total", failed) == 1
	})
}

func TestPassthroughIPv6(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	ln.Close()
	m := startMesh(t)
	outside := startBackend(t, "[::1]:0", echo)
	c, code, err := socksConnect(m.a.socks(t), "::1", outside.port())
	if err != nil {
		t.Fatalf("socks5 CONNECT [::1]: code %d: %v", code, err)
	}
	defer c.Close()
	sendAndCheck(t, c, 4096, 3)
}

// TestPlaintextListenerDirect: a connection made straight to the inbound plaintext listener
// (on a configured, non-standard port) has the listener itself as its original destination;
// node B must refuse it rather than dial itself in a loop.
func TestPlaintextListenerDirect(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	cfg := m.serverConfig()
	cfg.InboundPlaintextAddr = m.serverIP + ":0"
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
	c, err := net.Dial("tcp", m.b.addr(t, proxy.ListenerInboundPlaintext))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Fatalf("direct connection to the plaintext listener: %d bytes, %v; want closed", n, err)
	}
	failed := map[string]string{"reporter": "destination", "response_flags": metrics.FlagConnect}
	testutil.Eventually(t, "node B records the refusal", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_failed_total", failed) >= 1
	})
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 1 {
		t.Errorf("node B opened %v connections for one direct connection, want 1 (a loop?)", got)
	}
}

// TestLateLocalWorkload: node B learns its own workload only after the first connection
// arrives (a new pod racing its xDS push); it waits for it, up to WorkloadWait.
func TestLateLocalWorkload(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	const serverUID = "Kubernetes//v1/Pod/default/server"
	m := newMesh(t)
	cfg := m.serverConfig()
	cfg.WorkloadWait = 3 * time.Second
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
	m.a = startNode(t, "node-a", m.caDir, m.yaml, m.clientConfig())
	full := parseBatch(t, m.yaml)
	m.b.store.Apply(&state.Batch{RemoveAddresses: []string{serverUID}})
	be := startBackend(t, m.serverIP+":0", echo)

	type result struct {
		c   *net.TCPConn
		err error
	}
	waiting := make(chan struct{}, 1)
	m.b.proxy.OnLocalWait(func() {
		select {
		case waiting <- struct{}{}:
		default:
		}
	})
	got := make(chan result, 1)
	go func() {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		got <- result{c, err}
	}()
	select { // node B's handshake waits for its workload: only now does it learn it
	case <-waiting:
	case <-time.After(testutil.Timeout):
		t.Fatal("node B never waited for its workload")
	}
	m.b.store.Apply(full)
	r := <-got
	if r.err != nil {
		t.Fatalf("connect while node B learns its workload: %v", r.err)
	}
	sendAndCheck(t, r.c, 1000, 9)
	r.c.Close()
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

// TestDrainWithIdleSocksClient: a client that connected to the SOCKS5 port but never sent
// its request must not hold Shutdown past its deadline.
func TestDrainWithIdleSocksClient(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	c, err := net.Dial("tcp", m.a.socks(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The greeting is answered: the handler is running and now waits for the request.
	if _, err := c.Write([]byte{5, 1, 0}); err != nil {
		t.Fatal(err)
	}
	var method [2]byte
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, method[:]); err != nil {
		t.Fatalf("greeting: %v", err)
	}
	const deadline = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	if err := m.a.shutdown(ctx); err != nil {
		t.Errorf("shutdown: %v", err)
	}
	if took := time.Since(began); took > deadline+3*time.Second {
		t.Errorf("Shutdown took %v with a %v deadline: an idle SOCKS5 client held it", took, deadline)
	}
}

// TestNodeCaptureMode runs both nodes in node-capture mode (NODE_NAME node-a / node-b): node A finds
// the client workload by the SOCKS5 client's source address, node B the server workload by
// the address the HBONE connection was sent to.
func TestNodeCaptureMode(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	bcfg := proxy.Config{Local: state.Local{Mode: state.ModeNode, Node: "node-b"}, InboundAddr: m.serverIP + ":15008"}
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	acfg := proxy.Config{Local: state.Local{Mode: state.ModeNode, Node: "node-a"}, Socks5Addr: m.clientIP + ":0", WorkloadWait: 200 * time.Millisecond}
	m.a = startNode(t, "node-a", m.caDir, m.yaml, acfg)
	be := startBackend(t, m.serverIP+":0", echo)

	c, code, err := socksConnectFrom(m.clientIP, m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("socks5 from the client pod's address: code %d: %v", code, err)
	}
	sendAndCheck(t, c, 64<<10, 5)
	c.Close()
	testutil.Eventually(t, "node B records the client's identity", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "source_principal": "spiffe://" + clientPrinc, "destination_principal": "spiffe://" + serverPrinc,
		}) == 1
	})

	// From an address that is no workload of node A: refused once the wait is over.
	if _, code, err := socksConnectFrom("127.0.0.1", m.a.socks(t), m.serverIP, be.port()); err == nil || code != repNotAllowed {
		t.Fatalf("socks5 from an unknown source: code %d, err %v; want %d", code, err, repNotAllowed)
	}
}

// TestApplicationTunnelProxyV2: a server workload with an application tunnel gets its
// inbound traffic on localhost:<tunnel port>, prefixed by a PROXY v2 header naming the
// HBONE target and carrying the client's SPIFFE identity in TLV 0xD0.
func TestApplicationTunnelProxyV2(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	headers := make(chan proxyHeader, 1)
	tunnel := startBackend(t, "127.0.0.1:0", func(c *net.TCPConn) {
		h, err := readProxyV2(c)
		h.err = err
		headers <- h
		if err == nil {
			echo(c)
		}
	})
	m.yaml = strings.Replace(m.yaml, "serviceAccount: server", fmt.Sprintf("serviceAccount: server\n    applicationTunnel: {protocol: PROXY, port: %d}", tunnel.port()), 1)
	m.start(t)

	c, code, err := socksConnect(m.a.socks(t), m.serverIP, 9999)
	if err != nil {
		t.Fatalf("socks5 connect: code %d: %v", code, err)
	}
	defer c.Close()
	h := <-headers
	if h.err != nil {
		t.Fatalf("PROXY v2 header: %v", h.err)
	}
	if want := m.serverIP + ":9999"; h.dst != want {
		t.Errorf("PROXY header destination %s, want the HBONE target %s", h.dst, want)
	}
	if got, want := h.tlv[0xD0], "spiffe://"+clientPrinc; got != want {
		t.Errorf("TLV 0xD0 = %q, want %q", got, want)
	}
	sendAndCheck(t, c, 10000, 11)
}

// proxyHeader is what readProxyV2 parsed; err is for the test's channel.
type proxyHeader struct {
	dst string
	tlv map[byte]string
	err error
}

// proxyV2Sig opens every PROXY protocol v2 header.
var proxyV2Sig = []byte("\r\n\r\n\x00\r\nQUIT\n")

// readProxyV2 parses a PROXY v2 header over TCP/IPv4, keeping its TLVs by type.
func readProxyV2(r io.Reader) (h proxyHeader, err error) {
	var fixed [16]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return h, err
	}
	if !bytes.Equal(fixed[:12], proxyV2Sig) || fixed[12] != 0x21 || fixed[13] != 0x11 {
		return h, fmt.Errorf("not a PROXY v2 TCP/IPv4 header: % x", fixed)
	}
	body := make([]byte, int(fixed[14])<<8|int(fixed[15]))
	if _, err := io.ReadFull(r, body); err != nil || len(body) < 12 {
		return h, fmt.Errorf("header body (%d bytes): %v", len(body), err)
	}
	dst := netip.AddrFrom4([4]byte(body[4:8]))
	h.dst = netip.AddrPortFrom(dst, uint16(body[10])<<8|uint16(body[11])).String()
	h.tlv = map[byte]string{}
	for rest := body[12:]; len(rest) > 0; {
		if len(rest) < 3 {
			return h, fmt.Errorf("truncated TLV % x", rest)
		}
		n := int(rest[1])<<8 | int(rest[2])
		if len(rest) < 3+n {
			return h, fmt.Errorf("TLV %#x of %d bytes overruns the header", rest[0], n)
		}
		h.tlv[rest[0]] = string(rest[3 : 3+n])
		rest = rest[3+n:]
	}
	return h, nil
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
