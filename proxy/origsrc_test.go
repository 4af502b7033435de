package proxy_test

import (
	"io"
	"net"
	"os"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// With OrigSrc, the workload sees the client's address (node A's loopback workload IP, the
// HBONE connection's source) instead of node B's own: IP_TRANSPARENT needs root.
func TestOrigSrcKeepsClientAddress(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("IP_TRANSPARENT needs root (CAP_NET_ADMIN); CI runs as root")
	}
	leaktest.Check(t)
	checkFDs(t)
	for _, origSrc := range []bool{false, true} {
		m := newMesh(t)
		cfg := m.serverConfig()
		cfg.OrigSrc = origSrc
		m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
		m.a = startNode(t, "node-a", m.caDir, m.yaml, m.clientConfig())
		peers := make(chan string, 1)
		be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			peers <- c.RemoteAddr().(*net.TCPAddr).IP.String()
			io.Copy(io.Discard, c)
		})
		c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("OrigSrc=%v: connect: code %d: %v", origSrc, code, err)
		}
		got := <-peers
		c.Close()
		// The HBONE peer address is the client workload's IP (node A leaves from it); only
		// with OrigSrc does node B dial the workload from there.
		if origSrc && got != m.clientIP {
			t.Errorf("OrigSrc: workload saw the connection from %s; want the client %s", got, m.clientIP)
		}
		if !origSrc && got == m.clientIP {
			t.Errorf("without OrigSrc the workload saw the client's address %s; want node B's own", got)
		}
		be.Close()
	}
}
