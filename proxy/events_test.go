package proxy_test

import (
	"sync/atomic"
	"testing"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/internal/testutil"
)

// TestHBONEConfigAsGiven: the proxy runs hbone with the configuration it is given. Node
// B's caller set its own OnTLS: that hook hears the HBONE connection and the proxy adds no
// counting of its own beside it; node A's hooks are its HBONEEvents (the test helper sets
// them as cmd/ztunnel does), which count it.
func TestHBONEConfigAsGiven(t *testing.T) {
	m := newMesh(t)
	var tlsSeen atomic.Int32
	cfg := m.serverConfig()
	cfg.HBONEServer.OnTLS = func(hbone.TLSInfo) { tlsSeen.Add(1) }
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
	m.a = startNode(t, "node-a", m.caDir, m.yaml, m.clientConfig())
	be := startBackend(t, m.serverIP+":0", echo)
	c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("socks5 code %d: %v", code, err)
	}
	c.Close()
	testutil.Eventually(t, "node B's own hook to hear of the HBONE connection's TLS", func() bool { return tlsSeen.Load() >= 1 })
	if got := counter(t, m.b.reg, "hbone_kernel_tls_connections_total", nil); got != 0 {
		t.Errorf("node B counted %v HBONE connections beside its caller's hook; want 0: the proxy adds no hook of its own", got)
	}
	if got := counter(t, m.a.reg, "hbone_kernel_tls_connections_total", nil); got != 1 {
		t.Errorf("node A's HBONEEvents counted %v HBONE connections; want 1", got)
	}
}
