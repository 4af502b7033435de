//go:build linux

package proxy_test

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/proxy/outlier"
)

// Out of file descriptors, a listener's accepts fail: the proxy backs off, AcceptError
// names the listener and the reason (readiness shows it), and once descriptors are free
// again a client is served and AcceptError is nil. The limit is the process's
// real RLIMIT_NOFILE, lowered for the test.
func TestAcceptOutOfFileDescriptors(t *testing.T) {
	leaktest.Check(t)
	m := startMesh(t)
	socks := m.a.socks(t)
	fds := starveFDs(t)
	restore, fill, unfill := fds.restore, fds.fill, fds.unfill
	// Take every descriptor left, so accept(2) finds none; fill again as the runtime and
	// earlier tests' finalizers free some.
	fill()
	var clients []net.Conn
	for len(clients) < 2 {
		// Free one descriptor for the client's socket; the node's own goroutines may take
		// it first, so free another until the dial gets one.
		if !fds.free() {
			restore()
			t.Fatal("no descriptor left to free for the clients")
		}
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

// fdStarver holds the process's file descriptors short: RLIMIT_NOFILE lowered to a little
// above what it holds, the rest taken by fill. The limit and the descriptors are given
// back when the test ends, if not before.
type fdStarver struct {
	old     syscall.Rlimit
	fillers []*os.File
}

// starveFDs lowers the limit, or skips the test when it cannot.
func starveFDs(t *testing.T) *fdStarver {
	s := &fdStarver{}
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &s.old); err != nil {
		t.Skip(err)
	}
	low := s.old
	low.Cur = uint64(fdCount(t) + 64)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Skip("cannot lower RLIMIT_NOFILE:", err)
	}
	t.Cleanup(func() { s.unfill(); s.restore() })
	return s
}

// fill takes every descriptor left.
func (s *fdStarver) fill() {
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return
		}
		s.fillers = append(s.fillers, f)
	}
}

// free gives one descriptor back, if fill holds any.
func (s *fdStarver) free() bool {
	if len(s.fillers) == 0 {
		return false
	}
	s.fillers[len(s.fillers)-1].Close()
	s.fillers = s.fillers[:len(s.fillers)-1]
	return true
}

func (s *fdStarver) unfill() {
	for _, f := range s.fillers {
		f.Close()
	}
	s.fillers = nil
}

func (s *fdStarver) restore() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &s.old) }

// TestOutboundOutOfFileDescriptors: an outbound connect that fails because node A is out
// of file descriptors is node A's failure, not the endpoint's: it is not retried and
// leaves no record against the endpoint.
func TestOutboundOutOfFileDescriptors(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t, "8080")
	startBackend(t, m.serverIP+":8080", echo)
	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	outliers := outlier.New(outlier.Config{})
	cfg := m.clientConfig()
	cfg.ConnectRetries, cfg.Outliers = 2, outliers
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)

	// The SOCKS5 session is accepted (a descriptor) before the descriptors run out; the
	// node dials when it reads the CONNECT request, sent after.
	c, err := net.Dial("tcp", m.a.socks(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	var method [2]byte
	if _, err := c.Write([]byte{5, 1, 0}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, method[:]); err != nil {
		t.Fatal(err)
	}
	fds := starveFDs(t)
	runtime.GC() // run the finalizers that would free a descriptor during the dial
	fds.fill()
	host := "echo.default.svc.cluster.local"
	req := append([]byte{5, 1, 0, 3, byte(len(host))}, host...)
	if _, err := c.Write(binary.BigEndian.AppendUint16(req, 80)); err != nil {
		t.Fatal(err)
	}
	var rep [10]byte
	_, err = io.ReadFull(c, rep[:])
	fds.unfill()
	fds.restore()
	if err != nil {
		t.Fatal(err)
	}
	if rep[1] == repSucceeded {
		t.Skip("a descriptor was freed before node A dialed: nothing to check")
	}
	echoSvc := map[string]string{"destination_service": "echo.default.svc.cluster.local"}
	if got := counter(t, m.a.reg, "outbound_connect_retries_total", echoSvc); got != 0 {
		t.Errorf("%v retries after node A ran out of descriptors; want none", got)
	}
	if outliers.Any() {
		t.Errorf("node A running out of descriptors left records against the endpoint: ejected %q", ejections(outliers))
	}
}
