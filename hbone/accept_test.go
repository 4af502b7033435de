package hbone

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/attack"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// acceptEnv serves ServeTLS on a listener from an accept loop shaped like the proxy's: the
// server's AdmitListener, a goroutine per connection.
func acceptEnv(t *testing.T, cfg ServerConfig) (*Server, netip.AddrPort) {
	t.Helper()
	testCA()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(cfg, echo)
	serveEach(t, srv.Admit(ln), srv, func(ctx context.Context, raw net.Conn) { srv.ServeTLS(ctx, raw, srvTLS) })
	return srv, netip.MustParseAddrPort(ln.Addr().String())
}

// A flood of connections that start TLS and stall (each sends a ClientHello, which the
// server must answer with a key exchange, then nothing more) and of bare TCP
// connections that never start it: the accept loop waits while 2 × MaxHandshakes
// connections are pending, so goroutines stay bounded whatever the flood's size, and an
// honest client's handshake still completes beside it.
func TestAcceptBoundedUnderHandshakeFlood(t *testing.T) {
	leaktest.Check(t)
	const maxHands, flood = 16, 600
	srv, addr := acceptEnv(t, ServerConfig{Config: Config{DialTimeout: time.Minute}, MaxHandshakes: maxHands, Admission: AdmissionConfig{HandshakeWorkers: 1, SourceFailedHandshakes: -1}})
	hello := attack.ClientHello(cliTLS) // what a peer that starts TLS and stalls sends
	g0 := runtime.NumGoroutine()
	stopPeaks := peaks(t)
	var mostPending int64
	done := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for {
			mostPending = max(mostPending, srv.adm.room.pending.Load())
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range flood {
		src := netip.AddrFrom4([4]byte{127, 0, 1, byte(1 + i%8)}) // 8 sources, each under its budgets
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", addr.String())
		if err != nil {
			t.Fatalf("flood connection %d: %v", i, err)
		}
		conns = append(conns, c)
		if i%2 == 0 {
			c.Write(hello)
		}

	}
	start := time.Now()
	honestHandshake(t, addr)
	t.Logf("honest handshake beside %d stalled connections took %v", flood, time.Since(start))
	close(done)
	sampler.Wait()
	gPeak, _ := stopPeaks()
	// MaxHandshakes connections in their handshake and as many evicted on their way out,
	// each with its serving goroutine and, in a handshake, crypto/tls's watcher of its
	// context; 40 for the test's own and goroutines on their way out.
	if limit := g0 + 2*(2*maxHands) + 40; gPeak > limit {
		t.Errorf("goroutines peaked at %d under a flood of %d (from %d), want at most %d", gPeak, flood, g0, limit)
	}
	// The accept loop waits while as many connections as that are pending (in their
	// handshake, or evicted and not yet gone): one more may be on its way in.
	if limit := 2*int64(maxHands) + 1; mostPending > limit {
		t.Errorf("%d connections pending at once, want at most %d", mostPending, limit)
	}
	t.Logf("peaks: %d goroutines (from %d), %d pending", gPeak, g0, mostPending)
}

// honestHandshake completes an mTLS handshake of identity honestID with the server at addr.
func honestHandshake(t *testing.T, addr netip.AddrPort) {
	t.Helper()
	raw, err := dialFrom(honestSrc, addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	tc := tls.Client(raw, testCA().ClientConfig(honestID))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tc.HandshakeContext(ctx); err != nil {
		t.Fatal(fmt.Errorf("honest handshake beside the flood: %w", err))
	}
}

// A connection whose source is past its budgets is refused by the AdmitListener as it is
// accepted (an RST, counted) and never handed to the accept loop's caller, so that a
// flood's refusals cost no goroutine, socket setup or TLS state; another source's
// handshake goes through meanwhile.
func TestRefusedAtAccept(t *testing.T) {
	leaktest.Check(t)
	testCA()
	var drops dropCounts
	const budget, flood = 4, 20
	srv := NewServer(ServerConfig{Config: Config{DialTimeout: time.Minute, OnDrop: drops.hook}, Admission: AdmissionConfig{SourceHandshakes: budget, SourceHandshakeRate: -1}}, echo)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var served atomic.Int64
	serveEach(t, srv.Admit(ln), srv, func(ctx context.Context, raw net.Conn) {
		served.Add(1)
		srv.ServeTLS(ctx, raw, srvTLS)
	})
	addr := netip.MustParseAddrPort(ln.Addr().String())
	for i := range flood {
		if i == budget {
			// The source's places are taken (by connections that never start TLS) before
			// the rest arrive.
			testutil.Eventually(t, "the source's handshake places to be taken", func() bool { return srv.adm.inFlight(floodSrc) == budget })
		}
		c, err := dialFrom(floodSrc, addr.String())
		if err != nil {
			continue // on loopback the refusal's RST can beat connect's return
		}
		defer c.Close()
	}
	testutil.Eventually(t, "the connections past the budget to be refused", func() bool {
		return drops[DropSourceHandshakes].Load() == flood-budget
	})
	if n := served.Load(); n != budget {
		t.Errorf("%d connections handed to the accept loop's caller; want the %d admitted, the rest refused as they were accepted", n, budget)
	}
	honestHandshake(t, addr)
}
