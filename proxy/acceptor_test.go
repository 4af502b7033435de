//go:build linux

package proxy_test

import (
	"context"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
)

// recordingAcceptor is a netpoll.Poller that keeps each watch's callback by listener
// address, so a test can tell the proxy an accept failed, and counts the watches not
// stopped yet.
type recordingAcceptor struct {
	netpoll.Poller
	mu       sync.Mutex
	accepted map[string]func(net.Conn, error)
	running  int
}

func (r *recordingAcceptor) Watch(ln net.Listener, accepted func(net.Conn, error)) (func(), error) {
	stop, err := r.Poller.Watch(ln, accepted)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.accepted[ln.Addr().String()] = accepted
	r.running++
	return func() {
		stop()
		r.mu.Lock()
		r.running--
		r.mu.Unlock()
	}, nil
}

func (r *recordingAcceptor) watches() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.running
}

// With the node's poller a proxy runs no accept loop: every listener is the poller's,
// connections it hands over are carried over HBONE as usual, a failed accept shows in
// AcceptError until one succeeds, and Shutdown stops every watch.
func TestAcceptor(t *testing.T) {
	leaktest.Check(t)
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	acc := &recordingAcceptor{Poller: p, accepted: map[string]func(net.Conn, error){}}
	m := newMesh(t)
	cfgB, cfgA := m.serverConfig(), m.clientConfig()
	cfgB.Poller, cfgA.Poller = acc, acc
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfgB)
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfgA)
	testutil.Eventually(t, "both nodes' listeners watched", func() bool { return acc.watches() == 4 })

	be := startBackend(t, m.serverIP+":0", echo)
	roundTrip := func(msg string) {
		t.Helper()
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("%s: %v", msg, err)
		}
		defer c.Close()
		if err := pingEcho(c, msg); err != nil {
			t.Fatalf("%s: %v", msg, err)
		}
	}
	roundTrip("through the acceptor")

	acc.mu.Lock()
	fail := acc.accepted[m.a.socks(t)]
	acc.mu.Unlock()
	fail(nil, syscall.EMFILE) // as the poller reports a failed accept4
	if err := m.a.proxy.AcceptError(); err == nil || !strings.Contains(err.Error(), "socks5 listener") || !strings.Contains(err.Error(), "too many open files") {
		t.Errorf("AcceptError after a failed accept: %v; want the socks5 listener's EMFILE", err)
	}
	roundTrip("after the failure")
	if err := m.a.proxy.AcceptError(); err != nil {
		t.Errorf("AcceptError after an accept succeeded again: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, n := range []*node{m.a, m.b} {
		if err := n.shutdown(ctx); err != nil {
			t.Errorf("%s: shutdown: %v", n.name, err)
		}
	}
	if w := acc.watches(); w != 0 {
		t.Errorf("%d watches running after both proxies shut down", w)
	}
}

// failingAcceptor watches no listener.
type failingAcceptor struct{ netpoll.PerSocket }

func (failingAcceptor) Watch(net.Listener, func(net.Conn, error)) (func(), error) {
	return nil, syscall.ENOSPC // epoll_ctl's answer past fs.epoll.max_user_watches
}

// A listener the poller cannot watch is served by an accept loop of its own.
func TestAcceptorCannotWatch(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	cfgA := m.clientConfig()
	cfgA.Poller = failingAcceptor{}
	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfgA)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := pingEcho(c, "served by a fallback accept loop"); err != nil {
		t.Fatal(err)
	}
}
