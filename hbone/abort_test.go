package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"golang.org/x/net/http2"
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
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		defer handled.Add(1)
		proxyDeliver(r, backend, rand.IntN(3) == 0)
	})
	const streams = 300
	runLimited(streams, 60, func(i int) { abortingClient(t, e, uint64(i)) })
	testutil.EventuallyNil(t, func() error {
		if n := handled.Load(); n != streams {
			return fmt.Errorf("%d of %d handlers returned", n, streams)
		}
		return nil
	})

	cli := onlyConn(t, e.pool.all)
	e.srv.mu.Lock()
	srvConns := map[*conn]bool{}
	for _, c := range e.srv.connsLocked(false) {
		srvConns[c] = true
	}
	e.srv.mu.Unlock()
	srv := onlyConn(t, srvConns)
	testutil.EventuallyNil(t, func() error {
		if last := leaks(cli, srv); last != "" {
			return errors.New(last)
		}
		return nil
	})
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
	_, err = io.Copy(io.Discard, s)
	var re *ResetError
	if backendAbort := errors.As(err, &re) && re.Code == http2.ErrCodeCancel; err != nil && abortAfter < 0 && !backendAbort {
		t.Errorf("stream %d: clean echo of %d bytes: %v", seed, size, err)
	}
}

// TestPoolUnderConnectionBreaks dials streams on a few keys while their connections are
// cut at random, go idle and are dialed again, with four streams per connection so that
// keys hold several. Dials may fail while a connection breaks under them, but none may
// hang, most must succeed, and once the streams have ended every connection must go idle
// and leave the pool: a stream slot or key entry leaked on a failure path would keep a
// connection (and its goroutines) forever.
func TestPoolUnderConnectionBreaks(t *testing.T) {
	leaktest.Check(t)
	e := newEnvConfigs(t, ServerConfig{}, ClientConfig{MaxStreamsPerConn: 4, IdleTimeout: 20 * time.Millisecond}, echo)
	keys := []Key{e.key}
	for _, src := range []string{"spiffe://cluster.local/ns/a/sa/one", "spiffe://cluster.local/ns/a/sa/two"} {
		keys = append(keys, NewKey(mustID(src), e.key.Expected(), e.addr, netip.Addr{}))
	}
	stop := make(chan struct{})
	cutter := make(chan struct{})
	go func() { // cuts a random server-side connection every few milliseconds
		defer close(cutter)
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(rand.IntN(4)+1) * time.Millisecond):
			}
			e.mu.Lock()
			if len(e.raws) > 0 {
				e.raws[rand.IntN(len(e.raws))].Close()
			}
			e.mu.Unlock()
		}
	}()
	const dials = 600
	var ok atomic.Int32
	runLimited(dials, 30, func(i int) {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		s, err := e.pool.Dial(ctx, keys[i%len(keys)], "10.0.0.1:80", nil)
		if errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("dial %d hung", i)
		}
		if err != nil {
			return
		}
		defer s.Close()
		if err := pingEchoStream(s); err == nil {
			ok.Add(1)
		}
	})
	close(stop)
	<-cutter
	if n := ok.Load(); n < dials/2 {
		t.Errorf("%d of %d streams carried an echo, want most", n, dials)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		e.pool.mu.Lock()
		nk, nc := len(e.pool.keys), len(e.pool.all)
		var held []string
		for c := range e.pool.all {
			c.mu.Lock()
			held = append(held, fmt.Sprintf("%d active, %d reserved", c.active, c.reserved))
			c.mu.Unlock()
		}
		e.pool.mu.Unlock()
		if nk == 0 && nc == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after every stream ended: %d keys and %d connections still pooled (%v)", nk, nc, held)
		}
	}
}

// A connection that breaks between its SETTINGS and joining the pool must not stay in
// it: here the server closes every connection right after its SETTINGS, so the client's
// frame reader usually ends it before Dial has added it.
func TestConnectionBrokenBeforePooled(t *testing.T) {
	leaktest.Check(t)
	testCA()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", srvTLS)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			preface := make([]byte, len(http2.ClientPreface))
			if _, err := io.ReadFull(c, preface); err == nil {
				http2.NewFramer(c, c).WriteSettings()
			}
			c.Close()
		}
	}()
	pool := NewPool(ClientConfig{}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	addr := netip.MustParseAddrPort(ln.Addr().String())
	k := NewKey(mustID(clientID), []identity.ID{mustID(serverID)}, addr, netip.Addr{})
	for range 20 {
		if s, err := pool.Dial(t.Context(), k, "10.0.0.1:80", nil); err == nil {
			s.Close()
		}
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		pool.mu.Lock()
		n := len(pool.keys)
		pool.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys still pooled after every connection broke", n)
		}
	}
}

// pingEchoStream sends a few bytes on s and reads them back from the echo handler.
func pingEchoStream(s *Stream) error {
	s.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Write([]byte("ping")); err != nil {
		return err
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(s, b); err != nil {
		return err
	}
	if string(b) != "ping" {
		return fmt.Errorf("echo %q", b)
	}
	return nil
}

// runLimited calls f(0) to f(n-1), at most par at once, and returns when all have.
func runLimited(n, par int, f func(i int)) {
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			f(i)
		}()
	}
	wg.Wait()
}
