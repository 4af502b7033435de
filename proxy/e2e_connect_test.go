package proxy_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// withService adds to yaml the service name.default.svc.cluster.local at vip, port 80 to
// 8080, whose endpoints are the HBONE workloads named in eps as "name=ip" (service account
// server).
func withService(yaml, name, vip string, eps ...string) string {
	host := name + ".default.svc.cluster.local"
	var workloads []string
	for _, ep := range eps {
		n, ip, _ := strings.Cut(ep, "=")
		workloads = append(workloads, strings.Replace(echoEndpointYAML(n, ip), "echo.default.svc.cluster.local", host, 1))
	}
	return withEndpoints(yaml, workloads...) + fmt.Sprintf(`  - name: %s
    namespace: default
    hostname: %s
    vips: ["/%s"]
    ports:
      80: 8080
`, name, host, vip)
}

// endpointIPs returns n addresses of m's subnet from .first on with port 15008 free, or
// skips the test.
func endpointIPs(t *testing.T, m *mesh, first, n int) []string {
	t.Helper()
	sub := strings.TrimSuffix(m.serverIP, "3")
	var ips []string
	for i := range n {
		ip := fmt.Sprintf("%s%d", sub, first+i)
		if !free(ip, []string{"15008"}) {
			t.Skipf("needs %s:15008 free", ip)
		}
		ips = append(ips, ip)
	}
	return ips
}

// serveHBONE serves HBONE with h on each of addrs, as workload identity default/server
// with a certificate of m's CA (a real TLS and HTTP/2 server, without a proxy behind it),
// until the test ends.
func serveHBONE(t *testing.T, m *mesh, h hbone.Handler, addrs ...string) {
	t.Helper()
	builtin, err := ca.NewBuiltin(m.caDir, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	mgr := certs.New(certs.Config{}, builtin)
	id := identity.MustParse("spiffe://" + serverPrinc)
	tlsCfg := mgr.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return id, nil })
	srv := hbone.NewServer(hbone.ServerConfig{Admission: hbone.AdmissionConfig{StreamStarts: -1}}, h)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var lns []net.Listener
	for _, a := range addrs {
		ln, err := net.Listen("tcp", a)
		if err != nil {
			t.Skipf("%s: %v", a, err)
		}
		lns = append(lns, ln)
		wg.Go(func() {
			for {
				raw, err := ln.Accept()
				if err != nil {
					return
				}
				wg.Go(func() { srv.ServeTLS(ctx, raw, tlsCfg) })
			}
		})
	}
	t.Cleanup(func() {
		for _, ln := range lns {
			ln.Close()
		}
		srv.Close()
		cancel()
		wg.Wait()
		mgr.Close()
	})
}

// timedConnect connects through socks to host:80 and returns how long the SOCKS5 answer
// took, failing the test if the connection worked.
func timedConnect(t *testing.T, socks, host string) time.Duration {
	start := time.Now()
	c, code, err := socksConnect(socks, host, 80)
	took := time.Since(start)
	if c != nil {
		c.Close()
	}
	if err == nil && code == repSucceeded {
		t.Errorf("connection to %s succeeded; want it to fail", host)
	}
	return took
}

// connectOK is timedConnect for a connection that must work: the test stops if it does not.
func connectOK(t *testing.T, socks, host string) time.Duration {
	t.Helper()
	start := time.Now()
	c, code, err := socksConnect(socks, host, 80)
	took := time.Since(start)
	if c != nil {
		c.Close()
	}
	if err != nil || code != repSucceeded {
		t.Fatalf("connect to %s after %v: code %d, %v; want it to succeed on an endpoint that serves", host, took, code, err)
	}
	return took
}

// neverAnswer is an HBONE handler that reads the CONNECT and never answers it.
func neverAnswer(r *hbone.Request) { <-r.Context().Done() }

// acceptAndDiscard is an HBONE handler that accepts the CONNECT and reads the stream to its end.
func acceptAndDiscard(r *hbone.Request) {
	if s, err := r.Accept(nil); err == nil {
		io.Copy(io.Discard, s)
		s.Close()
	}
}

// TestConnectDeadlineSilentPeers: the silent service's two endpoints complete TLS and
// HTTP/2, read the CONNECT and never answer it. The client hears within the dial timeout,
// in total: not never (no wait for the answer used to end), nor once per endpoint.
func TestConnectDeadlineSilentPeers(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 20, 2)
	m.yaml = withService(m.yaml, "silent", "127.10.0.3", "silent0="+ips[0], "silent1="+ips[1])
	serveHBONE(t, m, neverAnswer, ips[0]+":15008", ips[1]+":15008")
	const timeout = time.Second
	cfg := m.clientConfig()
	cfg.DialTimeout, cfg.ConnectRetries = timeout, 2
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	for range 2 {
		if took := timedConnect(t, m.a.socks(t), "silent.default.svc.cluster.local"); took < timeout || took > 2*timeout {
			t.Errorf("the client heard after %v; want about the dial timeout, %v", took, timeout)
		}
	}
}

// TestConnectRetryAfterSilentEndpoint: of the service's two endpoints one reads the CONNECT
// and never answers (a node cut off, a pooled connection to a peer that is gone), the other
// serves. Every connect succeeds within the dial timeout: an attempt that may be retried
// gets its share of the deadline (half, with one other endpoint to retry on), not all of
// it, so the silent endpoint leaves time to try the other.
func TestConnectRetryAfterSilentEndpoint(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 24, 2)
	m.yaml = withService(m.yaml, "halfsilent", "127.10.0.5", "quiet0="+ips[0], "serves1="+ips[1])
	serveHBONE(t, m, neverAnswer, ips[0]+":15008")
	serveHBONE(t, m, acceptAndDiscard, ips[1]+":15008")
	const timeout = 3 * time.Second
	cfg := m.clientConfig()
	cfg.DialTimeout, cfg.ConnectRetries, cfg.Outliers = timeout, 2, nil // every connect may pick the silent one
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	slow := 0
	for range 8 {
		took := connectOK(t, m.a.socks(t), "halfsilent.default.svc.cluster.local")
		if took > timeout/3 {
			slow++ // it tried the silent endpoint first
		}
		if took > timeout*2/3 {
			t.Errorf("connect took %v; want the silent endpoint given up after about %v", took, timeout/2)
		}
	}
	t.Logf("%d of 8 connects tried the silent endpoint first", slow)
}

// TestConnectRetryLeavesSilentNode: two of the service's three endpoints sit on one node and
// never answer the CONNECT (the node cut off), the third, on another node, serves. With one
// retry every connect succeeds: an attempt that got no answer sends the retry to another
// node, not to the silent node's other pod (which, picked at random, failed a third of the
// connects).
func TestConnectRetryLeavesSilentNode(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 28, 3)
	m.yaml = withService(m.yaml, "cutnode", "127.10.0.6", "quiet0="+ips[0], "quiet1="+ips[1], "serves2="+ips[2])
	m.yaml = strings.Replace(m.yaml, "node: node-quiet1", "node: node-quiet0", 1) // one node, two pods
	serveHBONE(t, m, neverAnswer, ips[0]+":15008", ips[1]+":15008")
	serveHBONE(t, m, acceptAndDiscard, ips[2]+":15008")
	const timeout = 2 * time.Second
	cfg := m.clientConfig()
	cfg.DialTimeout, cfg.ConnectRetries, cfg.Outliers = timeout, 1, nil // every connect may pick a silent one
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	slow := 0
	for range 12 {
		took := connectOK(t, m.a.socks(t), "cutnode.default.svc.cluster.local")
		if took > timeout/4 {
			slow++ // it tried a silent endpoint first
		}
	}
	t.Logf("%d of 12 connects tried a silent endpoint first", slow)
}

// TestConnectDeadlineTLSStall: the stalled service's endpoint accepts TCP and never
// finishes TLS. Four clients at once: each hears within the dial timeout, though their
// connects wait for each other's dial of the one HBONE connection.
func TestConnectDeadlineTLSStall(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 22, 1)
	m.yaml = withService(m.yaml, "stalled", "127.10.0.4", "stalled0="+ips[0])
	ln, err := net.Listen("tcp", ips[0]+":15008")
	if err != nil {
		t.Skip(err)
	}
	var held sync.WaitGroup
	conns := make(chan net.Conn, 64)
	held.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns <- c // never read: the ClientHello goes unanswered
		}
	})
	defer func() {
		ln.Close()
		held.Wait()
		close(conns)
		for c := range conns {
			c.Close()
		}
	}()
	const timeout = time.Second
	cfg := m.clientConfig()
	cfg.DialTimeout, cfg.ConnectRetries = timeout, 2
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if took := timedConnect(t, m.a.socks(t), "stalled.default.svc.cluster.local"); took > 2*timeout {
				t.Errorf("a client heard after %v; want about the dial timeout, %v", took, timeout)
			}
		})
	}
	wg.Wait()
}

// gate answers every CONNECT 503, but only when released: until then it holds them.
type gate struct {
	mu      sync.Mutex
	open    bool            // answer at once from now on
	waiting []chan struct{} // the CONNECTs held
}

func (g *gate) handle(r *hbone.Request) {
	g.mu.Lock()
	if g.open {
		g.mu.Unlock()
		r.Reject(http.StatusServiceUnavailable)
		return
	}
	ch := make(chan struct{})
	g.waiting = append(g.waiting, ch)
	g.mu.Unlock()
	select {
	case <-ch:
		r.Reject(http.StatusServiceUnavailable)
	case <-r.Context().Done():
	}
}

// held counts the CONNECTs held now.
func (g *gate) held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.waiting)
}

// release answers the CONNECTs held now; with open, every later one too.
func (g *gate) release(open bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, ch := range g.waiting {
		close(ch)
	}
	g.waiting, g.open = nil, open
}

// TestRetryBudget: every endpoint of the gated service answers 503, when the test lets it.
// Thirty clients connect at once; when their first attempts fail together, six (a fifth
// of the connects in flight) are retried and the other 24 are refused at once and counted,
// where each would have been retried twice.
func TestRetryBudget(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 30, 6)
	var eps, addrs []string
	for i, ip := range ips {
		eps = append(eps, fmt.Sprintf("gated%d=%s", i, ip))
		addrs = append(addrs, ip+":15008")
	}
	m.yaml = withService(m.yaml, "gated", "127.10.0.5", eps...)
	var g gate
	serveHBONE(t, m, g.handle, addrs...)
	cfg := m.clientConfig()
	cfg.DialTimeout, cfg.ConnectRetries = time.Minute, 2 // only the budget ends a retry here
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	socks := m.a.socks(t)
	svc := map[string]string{"destination_service": "gated.default.svc.cluster.local"}

	const clients = 30
	var failed atomic.Int32
	var wg sync.WaitGroup
	defer func() { g.release(true); wg.Wait() }() // when a check fails midway
	for range clients {
		wg.Go(func() {
			c, code, err := socksConnect(socks, "gated.default.svc.cluster.local", 80)
			if c != nil {
				c.Close()
			}
			if err == nil && code == repSucceeded {
				t.Error("a connection to the gated service succeeded")
			}
			failed.Add(1)
		})
	}
	testutil.Eventually(t, "every client's first attempt held", func() bool { return g.held() == clients })
	g.release(false)
	testutil.Eventually(t, "six retries held, 24 clients answered", func() bool { return g.held() == 6 && failed.Load() == clients-6 })
	if got := counter(t, m.a.reg, "outbound_connect_retries_total", svc); got != 6 {
		t.Errorf("%v retries; want 6", got)
	}
	if got := counter(t, m.a.reg, "outbound_connect_retries_over_budget_total", svc); got != clients-6 {
		t.Errorf("%v retries refused by the budget; want %d", got, clients-6)
	}
	g.release(true)
	wg.Wait()
	// The six retried connects, failing again, share a budget of three.
	retries, refused := counter(t, m.a.reg, "outbound_connect_retries_total", svc), counter(t, m.a.reg, "outbound_connect_retries_over_budget_total", svc)
	if retries > 6+3 || retries+refused != clients+6 {
		t.Errorf("%v retries, %v refused; want at most 9, and %d in all (each connect asked once, the six retried twice)", retries, refused, clients+6)
	}
}
