//go:build linux

package proxy_test

import (
	"bytes"
	"context"
	"fmt"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/proxy"
)

// TestIdleKernelTLS: the idle tests over HBONE connections in kernel TLS (`make
// test-ktls` runs it in a VM whose kernel has it; elsewhere it skips). There the socket →
// stream copy splices (hbone's readFromSplice), and without parking each node keeps a
// goroutine in that splice per idle connection; with parking, a connection idle on both
// nodes keeps none, and resumes losslessly both ways, again and again. Half-closes and
// resets of parked connections end them as in user-space TLS (testIdleEnds).
func TestIdleKernelTLS(t *testing.T) {
	if !kernelHasTLS(t) {
		t.Skip("the kernel has no TLS (make test-ktls runs this in a VM whose kernel has it)")
	}
	t.Run("park and resume", testIdleKernelTLSParkResume)
	for _, resets := range []bool{true, false} {
		t.Run(fmt.Sprintf("ends/resets=%v", resets), func(t *testing.T) { testIdleEnds(t, resets, throughNodes) })
	}
}

func testIdleKernelTLSParkResume(t *testing.T) {
	leaktest.Check(t)
	proxy.SetIdleSweep(t, idleSweep, true) // parking off for the first connection
	m := startMesh(t)
	be, backends := heldBackend(t, m)
	// Bytes each node's copy moved into its stream: all spliced, none copied.
	var sentA, sentB int64

	// Unparked, as before: one goroutine per node waits in the splice.
	c0, bc0 := dialIdle(t, m, be, backends)
	wantKernel(t, m)
	exchange(t, c0, bc0, 64<<10)
	sentA, sentB = sentA+64<<10, sentB+64<<10
	time.Sleep(4 * idleSweep)
	if n := stacksWith("readFromSplice"); n != 2 {
		t.Fatalf("with parking off: %d goroutines in readFromSplice; want 2 (one per node)", n)
	}
	c0.Close()
	bc0.Close()
	waitStacks(t, "readFromSplice", 0)

	proxy.SetIdleSweep(t, idleSweep, false)
	c, bc := dialIdle(t, m, be, backends)
	up, down := parkResume(t, c, bc, func(round int) {
		waitParked(t, m, 1)
		// Parked on both nodes: no goroutine runs either copy's splice.
		waitStacks(t, "readFromSplice", 0)
		if n := stacksWith("(*pump).run"); n != 0 {
			t.Fatalf("round %d: parked on both nodes, yet %d goroutines run a copy direction", round, n)
		}
	})
	sentA, sentB = sentA+up, sentB+down
	wantKernel(t, m)

	// Every byte each node's copy moved went through the splice (the counts are
	// recorded when the HBONE connections end).
	c.Close()
	bc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m.a.shutdown(ctx)
	m.b.shutdown(ctx)
	for _, e := range []struct {
		n    *node
		want int64
	}{{m.a, sentA}, {m.b, sentB}} {
		sent := func(path string) float64 {
			return counter(t, e.n.reg, "hbone_kernel_tls_bytes_total", map[string]string{"direction": "sent", "path": path})
		}
		if spliced, copied := sent("spliced"), sent("copied"); spliced != float64(e.want) || copied != 0 {
			t.Errorf("%s: sent %v spliced, %v copied; want %d spliced", e.n.name, spliced, copied, e.want)
		}
	}
}

// wantKernel fails the test unless both nodes carry the connection in kernel TLS.
func wantKernel(t *testing.T, m *mesh) {
	t.Helper()
	_, out := m.a.proxy.Connections()
	in, _ := m.b.proxy.Connections()
	for _, cs := range [][]proxy.ConnInfo{out, in} {
		for _, c := range cs {
			if c.TLS != "kernel" {
				t.Fatalf("a connection runs on %q TLS; want kernel: %+v", c.TLS, c)
			}
		}
	}
}

// stacksWith counts the goroutines whose stack mentions fn.
func stacksWith(fn string) int {
	var buf bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&buf, 2) // as runtime.Stack(all): one block per goroutine
	count := 0
	for _, g := range bytes.Split(buf.Bytes(), []byte("\n\n")) {
		if bytes.Contains(g, []byte(fn)) {
			count++
		}
	}
	return count
}

func waitStacks(t *testing.T, fn string, want int) {
	t.Helper()
	err := testutil.Poll(10*time.Second, func() error {
		if n := stacksWith(fn); n != want {
			return fmt.Errorf("%d goroutines in %s; want %d", n, fn, want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
