package proxy_test

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// TestPeerKillResetsClient: when node B dies mid-stream (here: Shutdown with a drain
// deadline already past, as TestSoak's node kill does), the client of node A sees the
// connection fail, a reset, not a clean FIN: a FIN after part of a response is
// indistinguishable from the server having sent all of it. Found by TestSoak, where about
// one in a hundred connections cut by the kill ended in a clean EOF and node A wrote no
// ERROR access-log record for them: node B's RST_STREAM(CANCEL) read as EOF.
func TestPeerKillResetsClient(t *testing.T) {
	m := startMesh(t)
	sent := make(chan struct{})
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		_, _ = c.Write(make([]byte, 1000))
		close(sent)
		_, _ = io.Copy(io.Discard, c) // hold the connection open
	})
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-sent
	if _, err := io.ReadFull(c, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = m.b.shutdown(ctx)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := c.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after node B died: read %d bytes, %v; want a connection reset", n, err)
	}
}

// TestHBONELossResetsClient: when the HBONE connection between the nodes breaks
// mid-stream (here a relay in front of node B's 15008 drops it), node A resets its client
// rather than closing it with a FIN, which would make the cut response look whole, and
// records the connection as failed.
func TestHBONELossResetsClient(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	// Node B serves HBONE on :15009; a relay on its :15008, where node A dials, forwards.
	bcfg := m.serverConfig()
	bcfg.InboundAddr = net.JoinHostPort(m.serverIP, "15009")
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	relay, err := net.Listen("tcp", net.JoinHostPort(m.serverIP, "15008"))
	if err != nil {
		t.Skipf("relay: %v", err)
	}
	defer relay.Close()
	var mu sync.Mutex
	var legs []net.Conn
	go func() {
		for {
			c, err := relay.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", bcfg.InboundAddr)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			legs = append(legs, c, up)
			mu.Unlock()
			go io.Copy(up, c)
			go io.Copy(c, up)
		}
	}()
	cut := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range legs {
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}
	}
	defer cut()
	m.a = startNode(t, "node-a", m.caDir, m.yaml, m.clientConfig())
	sent := make(chan struct{})
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		c.Write(make([]byte, 1000))
		close(sent)
		io.Copy(io.Discard, c) // the rest never comes
	})
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-sent
	if _, err := io.ReadFull(c, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	cut()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after the HBONE connection broke: read %d bytes, %v; want a connection reset", n, err)
	}
	testutil.Eventually(t, "node A to record the connection as failed", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_closed_total", nil) == 1
	})
}
