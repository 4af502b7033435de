//go:build linux

package proxy_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
)

// idleSweep is the tests' sweep: connections park 50–100 ms after their last byte.
const idleSweep = 50 * time.Millisecond

// waitParked waits until both nodes have parked want copies each (node A's client socket
// → stream, node B's backend socket → stream).
func waitParked(t *testing.T, m *mesh, want int) {
	t.Helper()
	waitParkedAB(t, m, want, want)
}

func waitParkedAB(t *testing.T, m *mesh, wantA, wantB int) {
	t.Helper()
	err := testutil.Poll(10*time.Second, func() error {
		if a, b := m.a.proxy.Parked(), m.b.proxy.Parked(); a != wantA || b != wantB {
			return fmt.Errorf("parked: node A %d, node B %d; want %d and %d", a, b, wantA, wantB)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// dialIdle opens a proxied connection to be through node A (and node B, for a backend on
// the server's address) and waits for the backend's end.
func dialIdle(t *testing.T, m *mesh, be *backend, backends <-chan *net.TCPConn) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	c, _, err := socksConnect(m.a.socks(t), be.ln.Addr().(*net.TCPAddr).IP.String(), be.port())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	select {
	case bc := <-backends:
		return c, bc
	case <-time.After(10 * time.Second):
		t.Fatal("the backend accepted nothing")
	}
	return nil, nil
}

// heldBackend's connections go to the channel; the handler holds each until the test ends.
func heldBackend(t *testing.T, m *mesh) (*backend, <-chan *net.TCPConn) {
	return heldBackendAt(t, m.serverIP)
}

// heldBackendAt is heldBackend on ip.
func heldBackendAt(t *testing.T, ip string) (*backend, <-chan *net.TCPConn) {
	ch := make(chan *net.TCPConn, 16)
	done := make(chan struct{})
	be := startBackend(t, ip+":0", func(c *net.TCPConn) {
		ch <- c
		<-done
	})
	t.Cleanup(func() { close(done); be.Close() })
	return be, ch
}

// exchange sends size random bytes each way at once, client → backend and backend →
// client, and checks each side read exactly what the other sent.
func exchange(t *testing.T, c, bc *net.TCPConn, size int) {
	t.Helper()
	up, down := make([]byte, size), make([]byte, size)
	rand.Read(up)
	rand.Read(down)
	var wg sync.WaitGroup
	check := func(who string, dst *net.TCPConn, src *net.TCPConn, data []byte) {
		defer wg.Done()
		go src.Write(data)
		dst.SetReadDeadline(time.Now().Add(20 * time.Second))
		got := make([]byte, size)
		if _, err := io.ReadFull(dst, got); err != nil {
			t.Errorf("%s: %v", who, err)
			return
		}
		dst.SetReadDeadline(time.Time{})
		if sha256.Sum256(got) != sha256.Sum256(data) {
			t.Errorf("%s: the %d bytes read differ from those sent", who, size)
		}
	}
	wg.Add(2)
	go check("client → backend", bc, c, up)
	go check("backend → client", c, bc, down)
	wg.Wait()
}

// TestIdleParkResume: a connection idle on both nodes gives up its goroutines and resumes
// when either end sends, again and again, with every byte arriving once and in order.
func TestIdleParkResume(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	be, backends := heldBackend(t, m)
	c, bc := dialIdle(t, m, be, backends)
	parkResume(t, c, bc, func(int) { waitParked(t, m, 1) })
}

// parkResume wakes the parked connection c ↔ bc, again and again, each round after parked
// has waited for it to park, and checks every byte arrives once and in order. It returns
// the bytes each end sent.
func parkResume(t *testing.T, c, bc *net.TCPConn, parked func(round int)) (up, down int64) {
	t.Helper()
	for round := range 4 {
		parked(round)
		switch round % 3 {
		case 0: // both ways at once, a megabyte each
			exchange(t, c, bc, 1<<20)
			up, down = up+1<<20, down+1<<20
		case 1: // the client speaks first
			start := time.Now()
			c.Write([]byte("ping"))
			expect(t, bc, "ping")
			t.Logf("round %d: a parked connection's first bytes arrived in %v", round, time.Since(start).Round(time.Microsecond))
			bc.Write([]byte("pong"))
			expect(t, c, "pong")
			up, down = up+4, down+4
		case 2: // the backend speaks first (the client's direction stays parked)
			bc.Write([]byte("news"))
			expect(t, c, "news")
			down += 4
		}
	}
	return up, down
}

func expect(t *testing.T, c *net.TCPConn, want string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, []byte(want)) {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

// TestIdleBurstRelease: connections that park after a burst of setups make the node return
// its memory once (release.go); one connection is no burst.
func TestIdleBurstRelease(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	const burst = 16
	released := proxy.SetBurstRelease(t, burst, time.Hour)
	m := startMesh(t)
	be, backends := heldBackend(t, m)
	dialIdle(t, m, be, backends)
	waitParked(t, m, 1)
	err := testutil.Poll(10*time.Second, func() error {
		if !m.a.proxy.SweepQuiet() || !m.b.proxy.SweepQuiet() {
			return errors.New("a node's sweep still runs")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := released(); n != 0 {
		t.Fatalf("one idle connection released memory %d times; want none", n)
	}
	for range burst {
		dialIdle(t, m, be, backends)
	}
	waitParked(t, m, burst+1)
	err = testutil.Poll(10*time.Second, func() error {
		if n := released(); n != 1 {
			return fmt.Errorf("%d releases after %d connections went idle; want 1 (both nodes share the process's limit)", n, burst)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestIdleEnds: half-closes and resets of parked connections end them as they end
// connections in use: a FIN stays a FIN the other way still flows after, a reset arrives
// as a reset (as a FIN with DisableResetPropagation); and each connection's completion runs
// (the tracker lets it go).
func TestIdleEnds(t *testing.T) {
	for _, resets := range []bool{true, false} {
		t.Run(fmt.Sprintf("resets=%v", resets), func(t *testing.T) { testIdleEnds(t, resets, throughNodes) })
	}
}

// idlePath is the way an idle test's connections take, and the directions each node
// parks on it (node A, node B): idle, after the client's FIN, after the backend's.
type idlePath struct {
	backendIP                     func(*mesh) string
	parked, clientFIN, backendFIN [2]int
}

var (
	// Through both nodes: client → stream on node A, backend → stream on node B.
	throughNodes = idlePath{func(m *mesh) string { return m.serverIP }, [2]int{1, 1}, [2]int{0, 1}, [2]int{1, 0}}
	// Node A's passthrough to an address outside the mesh, TCP ↔ TCP: both directions on
	// node A.
	passthrough = idlePath{func(m *mesh) string { return m.outsideIP }, [2]int{2, 0}, [2]int{1, 0}, [2]int{1, 0}}
)

func testIdleEnds(t *testing.T, resets bool, path idlePath) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMeshResets(t, resets)
	be, backends := heldBackendAt(t, path.backendIP(m))
	gone := func() {
		t.Helper()
		err := testutil.Poll(10*time.Second, func() error {
			if _, out := m.a.proxy.Connections(); len(out) != 0 {
				return fmt.Errorf("node A still has %d connections", len(out))
			}
			if in, _ := m.b.proxy.Connections(); len(in) != 0 {
				return fmt.Errorf("node B still has %d connections", len(in))
			}
			return nil
		})
		if err != nil {
			t.Error(err)
		}
	}
	t.Run("client half-closes", func(t *testing.T) {
		c, bc := dialIdle(t, m, be, backends)
		waitParkedAB(t, m, path.parked[0], path.parked[1])
		c.CloseWrite()
		wantEnd(t, "backend", bc, false)
		waitParkedAB(t, m, path.clientFIN[0], path.clientFIN[1]) // the client's direction is over; the other still parked
		bc.Write([]byte("late answer"))
		bc.CloseWrite()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if got, err := io.ReadAll(c); string(got) != "late answer" || err != nil {
			t.Fatalf("client read %q, %v; want the answer sent after its FIN, then EOF", got, err)
		}
		gone()
	})
	t.Run("backend half-closes", func(t *testing.T) {
		c, bc := dialIdle(t, m, be, backends)
		waitParkedAB(t, m, path.parked[0], path.parked[1])
		bc.CloseWrite()
		wantEnd(t, "client", c, false)
		waitParkedAB(t, m, path.backendFIN[0], path.backendFIN[1])
		c.Write([]byte("after"))
		c.CloseWrite()
		bc.SetReadDeadline(time.Now().Add(10 * time.Second))
		if got, err := io.ReadAll(bc); string(got) != "after" || err != nil {
			t.Fatalf("backend read %q, %v; want the bytes sent after its FIN, then EOF", got, err)
		}
		gone()
	})
	t.Run("client resets", func(t *testing.T) {
		c, bc := dialIdle(t, m, be, backends)
		waitParkedAB(t, m, path.parked[0], path.parked[1])
		resetConn(c)
		wantEnd(t, "backend", bc, resets)
		// Without resets the backend saw a FIN, and its direction lives on until it
		// closes too.
		bc.Close()
		gone()
	})
	t.Run("backend resets", func(t *testing.T) {
		c, bc := dialIdle(t, m, be, backends)
		waitParkedAB(t, m, path.parked[0], path.parked[1])
		resetConn(bc)
		wantEnd(t, "client", c, resets)
		c.Close() // likewise: the client saw a FIN without resets
		gone()
	})
}

// TestIdleShutdown: Shutdown waits for parked connections like any other and closes them
// at its deadline, leaving no goroutine behind.
func TestIdleShutdown(t *testing.T) { testIdleShutdown(t, throughNodes) }

func testIdleShutdown(t *testing.T, path idlePath) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	be, backends := heldBackendAt(t, path.backendIP(m))
	c, bc := dialIdle(t, m, be, backends)
	waitParkedAB(t, m, path.parked[0], path.parked[1])
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	m.a.shutdown(ctx)
	if d := time.Since(start); d < 250*time.Millisecond || d > 5*time.Second {
		t.Errorf("node A: Shutdown took %v with a parked connection and a 300 ms deadline; want it to wait for the connection, then close it", d)
	}
	// Node A closed the client's socket and the stream, so node B resets the backend's (or
	// node A closed both sockets).
	for _, e := range []struct {
		who string
		c   *net.TCPConn
	}{{"client", c}, {"backend", bc}} {
		e.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, e.c); err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("%s: the connection did not end after node A's Shutdown", e.who)
		}
	}
	m.b.shutdown(context.Background())
}

// TestIdleConnsGoroutines: many idle proxied connections hold at most one goroutine per
// 100 on both nodes together (the backend here holds its sockets without goroutines).
func TestIdleConnsGoroutines(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	ln, err := net.Listen("tcp", m.serverIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Conn
	var mu sync.Mutex
	acceptDone := make(chan struct{})
	go func() {
		defer close(acceptDone)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-acceptDone
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
	})
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	// One connection first, so the HBONE connection and the pools exist before counting.
	first, _, err := socksConnect(m.a.socks(t), m.serverIP, port)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	waitParked(t, m, 1)
	time.Sleep(1500 * time.Millisecond) // setup goroutines wait a second for more work
	runtime.GC()
	before := runtime.NumGoroutine()
	const n = 400
	clients := make([]*net.TCPConn, 0, n)
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	for range n {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, port)
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
	}
	waitParked(t, m, n+1)
	time.Sleep(1500 * time.Millisecond)
	after := runtime.NumGoroutine()
	// Each HBONE connection carries up to 100 streams (MaxStreamsPerConn) and keeps its
	// frame reader and writer on both nodes: 4 more goroutines per 100 connections, which
	// are the HBONE connections', not the proxied connections'.
	hbone := 4 * ((n+1+99)/100 - 1)
	own := after - before - hbone
	t.Logf("%d idle proxied connections: %d goroutines before, %d after: %d of %d more HBONE connections (reader and writer on both nodes), %d of the proxied connections",
		n, before, after, hbone, hbone/4, own)
	if per100 := float64(own) / n * 100; per100 > 1 {
		buf := make([]byte, 1<<20)
		t.Errorf("%.2f goroutines per 100 idle connections beside their HBONE connections'; want at most 1:\n%s", per100, buf[:runtime.Stack(buf, true)])
	}
	mu.Lock()
	conns := append([]net.Conn(nil), held...)
	mu.Unlock()
	if len(conns) != n+1 {
		t.Fatalf("backend holds %d connections; want %d", len(conns), n+1)
	}

	// A wake-up storm: every parked connection sends at once, each its own number; the
	// backend must read each number once, and each client gets its own back.
	start := time.Now()
	for i, c := range clients {
		if _, err := c.Write(binary.BigEndian.AppendUint32(nil, uint32(i))); err != nil {
			t.Fatal(err)
		}
	}
	seen := make(map[uint32]bool, n)
	for _, bc := range conns[1:] { // conns[0] is first's, which sends nothing
		bc.SetReadDeadline(time.Now().Add(20 * time.Second))
		buf := make([]byte, 4)
		if _, err := io.ReadFull(bc, buf); err != nil {
			t.Fatalf("backend: %v", err)
		}
		v := binary.BigEndian.Uint32(buf)
		if v >= n || seen[v] {
			t.Fatalf("backend read %d: out of range or twice", v)
		}
		seen[v] = true
		bc.Write(buf)
	}
	arrived := time.Since(start)
	for i, c := range clients {
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		buf := make([]byte, 4)
		if _, err := io.ReadFull(c, buf); err != nil || binary.BigEndian.Uint32(buf) != uint32(i) {
			t.Fatalf("client %d read %v, %v; want its own number back", i, buf, err)
		}
	}
	t.Logf("wake-up storm: %d parked connections sent at once; all arrived in %v, all answered in %v", n, arrived.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// TestIdlePolicyClose: a policy change that denies a parked inbound connection closes it
// (liveConn.close unparks the copy, which finds its socket closed), and the connection is
// recorded once, as denied, with the bytes it carried.
func TestIdlePolicyClose(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	be, backends := heldBackend(t, m)
	c, bc := dialIdle(t, m, be, backends)
	c.Write([]byte("alive"))
	expect(t, bc, "alive")
	waitParked(t, m, 1)
	m.b.store.Apply(denyClient("deny-parked"))
	for _, e := range []struct {
		who string
		c   *net.TCPConn
	}{{"client", c}, {"backend", bc}} {
		e.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, e.c); errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("%s: the parked connection is still open after the DENY policy", e.who)
		}
	}
	deny := map[string]string{"reporter": "destination", "response_flags": metrics.FlagDeny, "source_principal": "spiffe://" + clientPrinc}
	testutil.Eventually(t, "node B records the policy close", func() bool { return counter(t, m.b.reg, "istio_tcp_connections_closed_total", deny) == 1 })
	if got := counter(t, m.b.reg, "istio_tcp_received_bytes_total", deny); got != 5 {
		t.Errorf("received bytes of the closed connection = %v, want 5", got)
	}
	if in, _ := m.b.proxy.Connections(); len(in) != 0 {
		t.Errorf("node B still lists %d inbound connections", len(in))
	}
}
