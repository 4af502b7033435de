package proxy_test

// End-to-end tests of the two loopback nodes (e2e_test.go): drain. Live and idle
// connections when the client's or the server's node shuts down.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
)

// pingEcho sends msg and expects it echoed.
func pingEcho(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echo %q, want %q", buf, msg)
	}
	return nil
}

func TestDrainWithLiveConnection(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	socks := m.a.socks(t)
	c, _, err := socksConnect(socks, m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ping := func(msg string) error { return pingEcho(c, msg) }
	if err := ping("before"); err != nil {
		t.Fatal(err)
	}

	const deadline = 1500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	shutdown := make(chan error, 1)
	go func() { shutdown <- m.a.shutdown(ctx) }()

	// New connections are refused once draining starts.
	testutil.Eventually(t, "the SOCKS5 listener to close", func() bool {
		nc, err := net.DialTimeout("tcp", socks, time.Second)
		if err == nil {
			nc.Close()
		}
		return err != nil
	})
	// The live one keeps flowing while the deadline has not passed.
	for i := 0; time.Since(began) < deadline/2; i++ {
		if err := ping(fmt.Sprintf("during drain %d", i)); err != nil {
			if time.Since(began) >= deadline { // a loaded machine's ping outlived the deadline
				break
			}
			t.Fatalf("live connection broke during drain after %v: %v", time.Since(began), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case err := <-shutdown:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(deadline + 10*time.Second):
		t.Fatal("Shutdown did not return after its deadline")
	}
	if took := time.Since(began); took < deadline {
		t.Errorf("Shutdown returned after %v, before its %v deadline, with a live connection", took, deadline)
	}
	// Then it is closed.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("live connection still open after Shutdown returned")
		}
	}
}

// TestDrainServerNode drains node B: its HBONE listener closes and node A's pooled
// connection gets GOAWAY, so new connections fail while the live stream keeps flowing until
// the deadline.
func TestDrainServerNode(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ping := func(msg string) error { return pingEcho(c, msg) }
	if err := ping("before"); err != nil {
		t.Fatal(err)
	}
	const deadline = 1500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	shutdown := make(chan error, 1)
	go func() { shutdown <- m.b.shutdown(ctx) }()

	// A connect may still get through before node B has begun to drain; the backend
	// accepts those too.
	openedEarly := int64(0)
	testutil.Eventually(t, "new connections through node A to draining node B to fail", func() bool {
		nc, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err == nil {
			openedEarly++
			nc.Close()
		}
		return err != nil
	})
	if err := ping("during drain"); err != nil && time.Since(began) < deadline-200*time.Millisecond {
		t.Fatalf("live stream broke during node B's drain after %v: %v", time.Since(began), err)
	}
	select {
	case err := <-shutdown:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(deadline + 10*time.Second):
		t.Fatal("node B's Shutdown did not return after its deadline")
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("client connection still open after node B closed its stream")
		}
	}
	if got, want := be.accepted.Load(), 1+openedEarly; got != want {
		t.Errorf("backend accepted %d connections, want %d (the live one and %d opened before the drain began)", got, want, openedEarly)
	}
}

// TestDrainWithIdleSocksClient: a client that connected to the SOCKS5 port but never sent
// its request must not hold Shutdown past its deadline.
func TestDrainWithIdleSocksClient(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	c, err := net.Dial("tcp", m.a.socks(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The greeting is answered: the handler is running and now waits for the request.
	if _, err := c.Write([]byte{5, 1, 0}); err != nil {
		t.Fatal(err)
	}
	var method [2]byte
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, method[:]); err != nil {
		t.Fatalf("greeting: %v", err)
	}
	const deadline = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	began := time.Now()
	if err := m.a.shutdown(ctx); err != nil {
		t.Errorf("shutdown: %v", err)
	}
	if took := time.Since(began); took > deadline+3*time.Second {
		t.Errorf("Shutdown took %v with a %v deadline: an idle SOCKS5 client held it", took, deadline)
	}
}

// lateAcceptor accepts on its own goroutine per listener but hands each connection over
// only when its watch is being stopped, as the Poller contract allows (until stop
// returns): the race of a drain with connections accepted just before the listeners closed.
type lateAcceptor struct {
	netpoll.PerSocket               // the rest of a Poller
	accepted          chan struct{} // a connection is waiting to be handed over
}

func (a lateAcceptor) Watch(ln net.Listener, handOver func(net.Conn, error)) (func(), error) {
	stopping, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			a.accepted <- struct{}{}
			<-stopping
			handOver(c, nil)
		}
	}()
	return sync.OnceFunc(func() {
		close(stopping)
		ln.Close()
		<-done
	}), nil
}

// A connection the Poller accepted before the drain began and hands over as the drain
// stops its watch is served like a live one, not closed: the kernel gave it to this proxy
// and no other will see it.
func TestDrainServesAcceptedConnection(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	acc := lateAcceptor{accepted: make(chan struct{}, 1)}
	cfg := m.clientConfig()
	cfg.Poller = acc
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)
	be := startBackend(t, m.outsideIP+":0", echo)
	c, err := net.Dial("tcp", m.a.socks(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-acc.accepted

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	shutdown := make(chan error, 1)
	go func() { shutdown <- m.a.shutdown(ctx) }()
	if code, err := socksHandshake(c, m.outsideIP, be.port()); err != nil || code != 0 {
		t.Fatalf("SOCKS5 CONNECT on the connection accepted before the drain: code %d, %v; want it served", code, err)
	}
	if err := pingEcho(c, "accepted before the drain"); err != nil {
		t.Fatal(err)
	}
	c.Close()
	if err := <-shutdown; err != nil {
		t.Errorf("shutdown: %v", err)
	}
}
