//go:build linux

package proxy_test

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/proxy"
)

// TestIdleTCP: a TCP ↔ TCP pair (node A's passthrough to an address outside the mesh)
// gives up both its copy goroutines while idle, each direction on its own, and resumes
// losslessly both ways; half-closes and resets of parked pairs end them as of unparked
// ones, and Shutdown waits for them, then closes them.
func TestIdleTCP(t *testing.T) {
	t.Run("park and resume", testIdleTCPParkResume)
	for _, resets := range []bool{true, false} {
		t.Run(fmt.Sprintf("ends/resets=%v", resets), func(t *testing.T) { testIdleEnds(t, resets, passthrough) })
	}
	t.Run("shutdown", func(t *testing.T) { testIdleShutdown(t, passthrough) })
}

func testIdleTCPParkResume(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	proxy.SetIdleSweep(t, idleSweep, false)
	m := startMesh(t)
	be, backends := heldBackendAt(t, m.outsideIP)
	c, bc := dialIdle(t, m, be, backends)
	parkResume(t, c, bc, func(round int) {
		waitParkedAB(t, m, 2, 0)
		if _, out := m.a.proxy.Connections(); len(out) != 1 || out[0].Protocol != "TCP" {
			t.Fatalf("node A's outbound connections %+v; want one TCP", out)
		}
		if n := stacksWith("(*pump).run"); n != 0 {
			t.Fatalf("round %d: both directions parked, yet %d goroutines run a copy direction", round, n)
		}
	})

	// The backend talks on, the client says nothing: the client's direction parks while
	// the backend's keeps its goroutine.
	waitParkedAB(t, m, 2, 0)
	stop := make(chan struct{})
	ticked := make(chan int, 1)
	go func() {
		n := 0
		defer func() { ticked <- n }()
		tick := time.NewTicker(idleSweep / 5)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := bc.Write([]byte("tick")); err != nil {
					return
				}
				n++
			}
		}
	}()
	time.Sleep(5 * idleSweep)
	parked, running := m.a.proxy.Parked(), stacksWith("(*pump).run")
	close(stop)
	n := <-ticked
	if parked != 1 || running != 1 {
		t.Errorf("one direction busy, the other quiet: %d parked, %d running; want 1 and 1", parked, running)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 4*n)
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, bytes.Repeat([]byte("tick"), n)) {
		t.Fatalf("client read %q, %v; want %d ticks", got, err, n)
	}
	c.SetReadDeadline(time.Time{})
	c.Write([]byte("done"))
	expect(t, bc, "done")
}
