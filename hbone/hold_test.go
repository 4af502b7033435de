package hbone

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
)

// A held refusal goes out when due, one wait after it was held; past the limit the
// oldest goes out at once; close sends every held one, and a refusal held after it goes
// out at once.
func TestRefusalHold(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := &refusalHold{wait: 10 * time.Second, limit: 2}
		var mu sync.Mutex
		var out []int
		reset := func(i int) func() {
			return func() { mu.Lock(); out = append(out, i); mu.Unlock() }
		}
		want := func(when string, w ...int) {
			t.Helper()
			synctest.Wait()
			mu.Lock()
			defer mu.Unlock()
			if !slices.Equal(out, w) {
				t.Errorf("%s: refused %v; want %v", when, out, w)
			}
		}
		h.hold(reset(1))
		time.Sleep(time.Second)
		h.hold(reset(2))
		want("two held, within their wait")
		h.hold(reset(3))
		want("a third held past the limit of two", 1)
		time.Sleep(9*time.Second + time.Second/2)
		want("before the second's due", 1)
		time.Sleep(time.Second / 2)
		want("at the second's and third's due", 1, 2, 3)
		h.hold(reset(4))
		if n := h.held(); n != 1 {
			t.Errorf("%d held; want 1", n)
		}
		h.close()
		want("after close", 1, 2, 3, 4)
		h.hold(reset(5))
		want("held after close", 1, 2, 3, 4, 5)
	})
}

// A connection refused as it is accepted, its source past its budgets, is held unread
// until its handshake deadline before its RST: its client learns of the refusal, and dials
// again, no sooner than a stalled handshake let in would (the cluster's stalled-handshake
// attacker dials again as soon as one ends). Close resets the held ones at once. Both accept
// loops: the AdmitListener's Accept, and the node's epoll poller, which accepts itself.
func TestRefusedHeldUntilDeadline(t *testing.T) {
	for _, loop := range []string{"accept", "netpoll"} {
		t.Run(loop, func(t *testing.T) {
			leaktest.Check(t)
			testCA()
			var drops dropCounts
			const deadline = time.Second
			srv := NewServer(ServerConfig{Config: Config{DialTimeout: deadline, OnDrop: drops.hook}, Admission: AdmissionConfig{SourceHandshakes: 1, SourceHandshakeRate: -1, SourceFailedHandshakes: -1}}, echo)
			defer srv.Close()
			release, _, _, ok := srv.adm.admitSource(floodSrc, false) // the source's one place, taken
			if !ok {
				t.Fatal("the source's first place refused")
			}
			defer release(false)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			serve := func(ctx context.Context, raw net.Conn) { srv.ServeTLS(ctx, raw, srvTLS) }
			if loop == "accept" {
				serveEach(t, srv.Admit(ln), srv, serve)
			} else {
				watchEach(t, srv.Admit(ln), serve)
			}
			start := time.Now()
			c, err := dialFrom(floodSrc, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			testutil.Eventually(t, "the connection to be refused and held", func() bool {
				return drops[DropSourceHandshakes].Load() == 1 && srv.adm.hold.held() == 1
			})
			c.SetReadDeadline(time.Now().Add(deadline + 10*time.Second))
			_, err = c.Read(make([]byte, 1))
			if took := time.Since(start); !errors.Is(err, syscall.ECONNRESET) || took < deadline {
				t.Errorf("the refused connection ended with %v after %v; want a reset, no sooner than its deadline (%v)", err, took, deadline)
			}
			c2, err := dialFrom(floodSrc, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c2.Close()
			testutil.Eventually(t, "the second connection to be held", func() bool { return srv.adm.hold.held() == 1 })
			srv.Close()
			if n := srv.adm.hold.held(); n != 0 {
				t.Errorf("%d refused connections held after Close; want none", n)
			}
			c2.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := c2.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("the held connection after Close: %v; want a reset", err)
			}
		})
	}
}

// watchEach serves each connection the node's poller accepts on ln (the proxy's shape
// since netpoll) on a goroutine of its own, until the test ends.
func watchEach(t *testing.T, ln *AdmitListener, serve func(context.Context, net.Conn)) {
	t.Helper()
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	stop, err := p.Watch(ln, func(c net.Conn, err error) {
		if err == nil {
			wg.Go(func() { serve(ctx, c) })
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close(); stop(); cancel(); wg.Wait(); p.Close() })
}
