package proxy_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/proxy"
)

// recordingSockets opens host sockets and records each call, as "listen addr" or
// "dial addr".
var _ proxy.Sockets = (*recordingSockets)(nil)

type recordingSockets struct {
	mu    sync.Mutex
	calls []string
}

func (r *recordingSockets) Listen(ctx context.Context, network, address string) (net.Listener, error) {
	r.record("listen " + address)
	return (&net.ListenConfig{}).Listen(ctx, network, address)
}

func (r *recordingSockets) Dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	r.record("dial " + address)
	return d.DialContext(ctx, network, address)
}

func (r *recordingSockets) record(call string) {
	r.mu.Lock()
	r.calls = append(r.calls, call)
	r.mu.Unlock()
}

func (r *recordingSockets) has(call string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.calls {
		if c == call {
			return true
		}
	}
	return false
}

// TestSocketsSeam: with Config.Sockets set (and HBONEClient.Dial its Dial, as in-pod mode
// sets both), every listener is opened and every connection dialed through it: node A's
// outbound HBONE connection, node B's dial to the workload.
func TestSocketsSeam(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	sa, sb := &recordingSockets{}, &recordingSockets{}
	bcfg := m.serverConfig()
	bcfg.Sockets, bcfg.HBONEClient.Dial = sb, sb.Dial
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	acfg := m.clientConfig()
	acfg.Sockets, acfg.HBONEClient.Dial = sa, sa.Dial
	m.a = startNode(t, "node-a", m.caDir, m.yaml, acfg)
	be := startBackend(t, m.serverIP+":0", echo)

	c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("socks5 connect: code %d: %v", code, err)
	}
	sendAndCheck(t, c, 64<<10, 7)
	c.Close()

	for _, want := range []struct {
		s    *recordingSockets
		node string
		call string
	}{
		{sb, "B", "listen " + m.serverIP + ":15008"},
		{sa, "A", "listen " + m.clientIP + ":0"},
		{sa, "A", "dial " + m.serverIP + ":15008"},
		{sb, "B", "dial " + be.ln.Addr().String()},
	} {
		if !want.s.has(want.call) {
			t.Errorf("node %s: no %q through Config.Sockets; got %v", want.node, want.call, want.s.calls)
		}
	}
}
