//go:build linux

package proxy_test

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/sys/unix"
)

// kernelHasTLS reports whether setsockopt(TCP_ULP, "tls") works here (`make test-ktls`
// runs this package's kernel TLS tests in a VM whose kernel has it).
func kernelHasTLS(t *testing.T) bool {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rc, _ := c.(*net.TCPConn).SyscallConn()
	var serr error
	rc.Control(func(fd uintptr) { serr = unix.SetsockoptString(int(fd), unix.SOL_TCP, unix.TCP_ULP, "tls") })
	return serr == nil
}

// TestKernelTLSThroughNodes: a proxied connection through two nodes runs its HBONE leg in
// kernel TLS where the kernel has it, else in user space; both nodes' metrics and
// connection lists say which, and on kernel TLS every payload byte was spliced.
func TestKernelTLSThroughNodes(t *testing.T) {
	leaktest.Check(t)
	kernel := kernelHasTLS(t)
	want, mode := "no_kernel_tls", "user"
	if kernel {
		want, mode = "kernel", "kernel"
	}
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("socks5 connect: code %d: %v", code, err)
	}
	defer c.Close()
	// After a round trip the connection is being copied, so it is listed.
	hello := []byte("hello")
	if _, err := c.Write(hello); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, hello); err != nil {
		t.Fatal(err)
	}
	_, outbound := m.a.proxy.Connections()
	if len(outbound) != 1 || outbound[0].Protocol != "HBONE" || outbound[0].TLS != mode {
		t.Errorf("node A's outbound connections %+v; want one HBONE with tls %q", outbound, mode)
	}
	const size = 4<<20 + 1
	sendAndCheck(t, c, size, 27)
	const total = float64(size + 5) // with the round trip
	for _, n := range []*node{m.a, m.b} {
		if got := counter(t, n.reg, "hbone_kernel_tls_connections_total", map[string]string{"result": want}); got != 1 {
			t.Errorf("%s: hbone_kernel_tls_connections_total{result=%q} = %v, want 1 (all: %v %v)", n.name, want, got, counter(t, n.reg, "hbone_kernel_tls_connections_total", nil), dumpKTLS(t, n))
		}
	}
	// The byte counts are recorded when the HBONE connection ends.
	c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m.a.shutdown(ctx)
	m.b.shutdown(ctx)
	bytes := func(n *node, dir, path string) float64 {
		return counter(t, n.reg, "hbone_kernel_tls_bytes_total", map[string]string{"direction": dir, "path": path})
	}
	if !kernel {
		if got := bytes(m.a, "sent", "spliced") + bytes(m.a, "sent", "copied"); got != 0 {
			t.Errorf("user-space connections counted %v kernel TLS bytes", got)
		}
		return
	}
	for _, n := range []*node{m.a, m.b} {
		sent, copied := bytes(n, "sent", "spliced"), bytes(n, "sent", "copied")
		in, inCopied := bytes(n, "received", "spliced"), bytes(n, "received", "copied")
		t.Logf("%s: sent %v spliced, %v copied; received %v spliced, %v copied", n.name, sent, copied, in, inCopied)
		if sent != total || copied != 0 || in+inCopied != total {
			t.Errorf("%s: sent %v spliced + %v copied, received %v + %v; want %v spliced each way", n.name, sent, copied, in, inCopied, total)
		}
	}
}

func dumpKTLS(t *testing.T, n *node) map[string]float64 {
	out := map[string]float64{}
	for _, r := range []string{"kernel", "no_kernel_tls", "used", "no_secrets", "no_handshake", "kernel_rejected", "cipher", "not_tcp", "tls_version", "disabled"} {
		if v := counter(t, n.reg, "hbone_kernel_tls_connections_total", map[string]string{"result": r}); v != 0 {
			out[r] = v
		}
	}
	return out
}
