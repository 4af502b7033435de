package proxy_test

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestPeerKillTruncatesCleanly: when node B dies mid-stream (here: Shutdown with a drain
// deadline already past, as TestSoak's node kill does), the client of node A should see the
// connection fail, a reset, not a clean FIN: a FIN after part of a response is
// indistinguishable from the server having sent all of it. Found by TestSoak, where about
// one in a hundred connections cut by the kill ended in a clean EOF and node A wrote no
// ERROR access-log record for them.
func TestPeerKillTruncatesCleanly(t *testing.T) {
	t.Skip("known bug: node A half-closes the client (FIN) when its HBONE peer dies mid-stream; copyBoth's cleanEnd treats the stream's end as clean (proxy/copy.go, and hbone's stream error on connection loss)")
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
