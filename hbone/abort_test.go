package hbone

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// TestAbortsKeepWindowsWhole runs many streams over one connection and aborts most of
// them mid-transfer from either end (client, handler, backend), racing their own writes
// and deliveries. Once every
// stream has ended, each byte either side sent must have been released back to it
// (WINDOW_UPDATEs) or still be counted as unacknowledged at the receiver: a connection
// window that leaks on aborts stalls every stream on the connection for good. Nor may
// either side still count a stream as open.
func TestAbortsKeepWindowsWhole(t *testing.T) {
	leaktest.Check(t)
	backend := abortingEcho(t)
	var handled atomic.Int32
	e := newEnv(t, Config{}, func(r *Request) {
		defer handled.Add(1)
		proxyDeliver(r, backend, rand.IntN(3) == 0)
	})
	const streams = 300
	sem := make(chan struct{}, 60)
	var wg sync.WaitGroup
	for i := range streams {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			abortingClient(t, e, uint64(i))
		}()
	}
	wg.Wait()
	for deadline := time.Now().Add(10 * time.Second); handled.Load() != streams; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d handlers returned", handled.Load(), streams)
		}
	}

	cli := onlyConn(t, e.pool.all)
	e.srv.mu.Lock()
	srvConns := e.srv.conns
	e.srv.mu.Unlock()
	srv := onlyConn(t, srvConns)
	var last string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if last = leaks(cli, srv); last == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(last)
		}
	}
}

// onlyConn returns the one connection in m.
func onlyConn[V any](t *testing.T, m map[*conn]V) *conn {
	t.Helper()
	if len(m) != 1 {
		t.Fatalf("%d connections, want 1", len(m))
	}
	for c := range m {
		return c
	}
	return nil
}

// leaks describes how the connection windows between a and b fail to add up, or which
// streams they still count, or "".
func leaks(a, b *conn) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out string
	for _, d := range [...]struct {
		name     string
		tx, rx   *conn
		rxWindow int64
	}{{"client to server", a, b, int64(b.cfg.ConnWindow)}, {"server to client", b, a, int64(a.cfg.ConnWindow)}} {
		if got := d.tx.sendConnAvail + d.rx.connUnacked; got != d.rxWindow {
			out += fmt.Sprintf("%s: send window %d + unacknowledged %d = %d, want %d; ",
				d.name, d.tx.sendConnAvail, d.rx.connUnacked, got, d.rxWindow)
		}
		if got := d.rx.recvConnAvail + d.rx.connUnacked; got != d.rxWindow {
			out += fmt.Sprintf("%s: receiver holds %d bytes nobody will read; ", d.name, d.rxWindow-got)
		}
	}
	for _, c := range [...]*conn{a, b} {
		if c.active != 0 || len(c.streams) != 0 || c.reserved != 0 {
			out += fmt.Sprintf("server=%v: %d active, %d in the stream map, %d reserved after every stream ended; ",
				c.server, c.active, len(c.streams), c.reserved)
		}
	}
	return out
}

// proxyDeliver serves r as the proxy package does: DeliverTo the backend socket one way,
// ReadFrom it the other, any failure closing both. With abort it also closes the stream
// at a random moment, as a drain deadline or a policy change would.
func proxyDeliver(r *Request, backend string, abort bool) {
	s, tc, ok := acceptTo(r, backend)
	if !ok {
		return
	}
	defer tc.Close()
	defer s.Close()
	if abort {
		t := time.AfterFunc(time.Duration(rand.Int64N(int64(5*time.Millisecond))), func() { s.Close() })
		defer t.Stop()
	}
	done := make(chan struct{})
	if err := s.DeliverTo(tc, func(_ int64, err error) {
		if err != nil {
			s.Close()
			tc.Close()
		} else {
			tc.CloseWrite()
		}
		close(done)
	}); err != nil {
		return
	}
	if _, err := s.ReadFrom(tc); err != nil {
		s.Close()
		tc.Close()
	} else {
		s.CloseWrite()
	}
	<-done
}

// abortingEcho is a TCP echo backend that resets one connection in three after echoing
// a random number of bytes.
func abortingEcho(t *testing.T) string {
	addr, stop := tcpBackend(t, func(c *net.TCPConn) {
		if rand.IntN(3) == 0 {
			io.CopyN(c, c, rand.Int64N(256<<10))
			c.SetLinger(0)
			return
		}
		io.Copy(c, c)
		c.CloseWrite()
	})
	t.Cleanup(stop)
	return addr
}

// abortingClient opens one stream, writes a random amount while reading the echo, and
// ends it cleanly or, two times in three, with a Close at a random moment.
func abortingClient(t *testing.T, e *env, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	s, err := e.pool.Dial(t.Context(), e.key, "10.0.0.1:80", nil)
	if err != nil {
		t.Errorf("stream %d: %v", seed, err)
		return
	}
	defer s.Close()
	size := rng.Int64N(1 << 20)
	abortAfter := time.Duration(-1)
	if rng.IntN(3) != 0 {
		abortAfter = time.Duration(rng.Int64N(int64(5 * time.Millisecond)))
	}
	go func() {
		io.Copy(s, io.LimitReader(newPRNG(byte(seed)), size))
		s.CloseWrite()
	}()
	if abortAfter >= 0 {
		time.AfterFunc(abortAfter, func() { s.Close() })
	}
	s.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, s); err != nil && abortAfter < 0 {
		t.Errorf("stream %d: clean echo of %d bytes: %v", seed, size, err)
	}
}
