//go:build !race

package proxy_test

import (
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/gozt/gozt/proxy"
)

// An idle proxied connection's goroutines keep 4 KiB stacks: the copy runs on a goroutine
// that never ran the setup (handOff), so the TLS writes it makes stay within 4 KiB. Had
// the setup goroutine copied, each node's goroutine would need 8 KiB. (Not under -race,
// whose instrumentation makes every frame larger; make test runs it without.)
//
// Parking is off here: this is the goroutine a copy holds until it parks (and for good
// where it cannot park: no epoll); TestIdleConnsGoroutines counts parked ones.
func TestIdleConnectionStacks(t *testing.T) {
	proxy.SetIdleSweep(t, 100*time.Millisecond, true)
	m := startMesh(t)
	// The backend's goroutine is deliberately shallow, so that what is measured is the
	// two nodes'.
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		b := make([]byte, 64)
		for {
			n, err := c.Read(b)
			if err != nil {
				return
			}
			if _, err := c.Write(b[:n]); err != nil {
				return
			}
		}
	})
	roundTrip := func(c *net.TCPConn) {
		t.Helper()
		buf := make([]byte, 64)
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatal(err)
		}
	}
	dial := func() *net.TCPConn {
		t.Helper()
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	roundTrip(dial()) // the HBONE connection and the pools are warm
	time.Sleep(100 * time.Millisecond)

	const n = 300
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	goroutines := runtime.NumGoroutine()
	for range n {
		roundTrip(dial())
	}
	time.Sleep(200 * time.Millisecond)
	runtime.ReadMemStats(&after)
	perConn := float64(runtime.NumGoroutine()-goroutines) / n
	stack := float64(after.StackInuse-before.StackInuse) / n / 1024
	t.Logf("per idle proxied connection: %.2f goroutines, %.1f KiB of stacks", perConn, stack)
	if perConn > 3.1 {
		t.Errorf("%.2f goroutines per idle connection; want 3 (one per node, one in the backend)", perConn)
	}
	// Node A 4 + node B 4 + backend 2 = 10 KiB; with 8 KiB per node it would be 18.
	if stack > 13 {
		t.Errorf("%.1f KiB of stacks per idle connection; want about 10 (4 KiB per node)", stack)
	}
}
