//go:build linux

package proxy_test

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// Out of file descriptors, a listener's accepts fail: the proxy backs off, AcceptError
// names the listener and the reason (readiness shows it), and once descriptors are free
// again a client is served and AcceptError is nil. The limit is the process's
// real RLIMIT_NOFILE, lowered for the test.
func TestAcceptOutOfFileDescriptors(t *testing.T) {
	leaktest.Check(t)
	m := startMesh(t)
	socks := m.a.socks(t)
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Skip(err)
	}
	restore := func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) }
	defer restore()
	low := old
	low.Cur = uint64(fdCount(t) + 64)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Skip("cannot lower RLIMIT_NOFILE:", err)
	}
	// Take every descriptor left, so accept(2) finds none; fill again as the runtime and
	// earlier tests' finalizers free some.
	var fillers []*os.File
	fill := func() {
		for {
			f, err := os.Open(os.DevNull)
			if err != nil {
				return
			}
			fillers = append(fillers, f)
		}
	}
	unfill := func() {
		for _, f := range fillers {
			f.Close()
		}
		fillers = nil
	}
	defer unfill()
	fill()
	var clients []net.Conn
	for len(clients) < 2 {
		// Free one descriptor for the client's socket; the node's own goroutines may take
		// it first, so free another until the dial gets one.
		if len(fillers) == 0 {
			restore()
			t.Fatal("no descriptor left to free for the clients")
		}
		fillers[len(fillers)-1].Close()
		fillers = fillers[:len(fillers)-1]
		c, err := net.Dial("tcp", socks) // the kernel completes it; accept(2) is what fails
		if errors.Is(err, syscall.EMFILE) {
			continue
		}
		if err != nil {
			unfill()
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
		fill()
		err := m.a.proxy.AcceptError()
		return err != nil && strings.Contains(err.Error(), "socks5 listener") && strings.Contains(err.Error(), "too many open files")
	})
	unfill()
	restore()
	// With descriptors back, the node accepts and serves again. (The clients that waited may
	// have been accepted while descriptors were short and failed then: a new one is the test.)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(socks, m.serverIP, be.port())
	if err != nil {
		t.Fatalf("a client after descriptors were freed: %v", err)
	}
	defer c.Close()
	if err := pingEcho(c, "served again"); err != nil {
		t.Fatal(err)
	}
	testutil.EventuallyNil(t, func() error { return m.a.proxy.AcceptError() })
}
