package proxy_test

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
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

// TestConnectDeadlineSilentPeers: the silent service's two endpoints complete TLS and
// HTTP/2, read the CONNECT and never answer it. The client hears within the dial timeout,
// in total: not never (no wait for the answer used to end), nor once per endpoint.
func TestConnectDeadlineSilentPeers(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	ips := endpointIPs(t, m, 20, 2)
	m.yaml = withService(m.yaml, "silent", "127.10.0.3", "silent0="+ips[0], "silent1="+ips[1])
	serveHBONE(t, m, func(r *hbone.Request) { <-r.Context().Done() }, ips[0]+":15008", ips[1]+":15008")
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
