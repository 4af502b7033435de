//go:build linux

package proxy_test

import (
	"net"
	"strings"
	"syscall"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// Out of file descriptors, a listener's accepts fail: the proxy backs off, AcceptError
// names the listener and the reason (readiness shows it), and once descriptors are free
// again the waiting clients are served and AcceptError is nil. The limit is the process's
// real RLIMIT_NOFILE, lowered for the test.
func TestAcceptOutOfFileDescriptors(t *testing.T) {
	leaktest.Check(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	socks := m.a.socks(t)
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Skip(err)
	}
	restore := func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) }
	defer restore()
	// Room for the two client sockets below and nothing more.
	low := old
	low.Cur = uint64(fdCount(t) + 2)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Skip("cannot lower RLIMIT_NOFILE:", err)
	}
	var clients []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", socks) // the kernel completes it; accept(2) is what fails
		if err != nil {
			restore()
			t.Fatalf("client dial: %v", err)
		}
		clients = append(clients, c)
	}
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	testutil.Eventually(t, "AcceptError to name the SOCKS5 listener", func() bool {
		err := m.a.proxy.AcceptError()
		return err != nil && strings.Contains(err.Error(), "socks5 listener") && strings.Contains(err.Error(), "too many open files")
	})
	restore()
	for i, c := range clients {
		if _, err := socksHandshake(c, m.serverIP, be.port()); err != nil {
			t.Fatalf("client %d after descriptors were freed: %v", i, err)
		}
		if err := pingEcho(c, "served after all"); err != nil {
			t.Fatalf("client %d: %v", i, err)
		}
	}
	testutil.EventuallyNil(t, func() error { return m.a.proxy.AcceptError() })
}
