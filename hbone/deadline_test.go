package hbone

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// silent is a handler that reads the CONNECT and never answers it, until the server ends.
func silent(r *Request) { <-r.Context().Done() }

// TestDialAnswerDeadline: a server that completes TLS and HTTP/2, reads the CONNECT's
// HEADERS and never answers it: Dial returns at its deadline (DialTimeout, or ctx's if
// sooner), not never. Two CONNECTs on one connection, the later one due first, each end at
// their own deadline: the connection's one timer is set for the earlier.
func TestDialAnswerDeadline(t *testing.T) {
	leaktest.Check(t)
	const timeout = 2 * time.Second
	e := newEnvConfigs(t, ServerConfig{}, ClientConfig{Config: Config{DialTimeout: timeout}}, silent)
	type result struct {
		took time.Duration
		err  error
	}
	// start is taken before ctx's deadline is set: taken in the goroutine, after a loaded
	// scheduler's delay, it made a Dial that ended at the deadline look early.
	dial := func(ctx context.Context, start time.Time, out chan<- result) {
		s, err := e.pool.Dial(ctx, e.key, "10.0.0.1:80", nil)
		if s != nil {
			s.Close()
		}
		out <- result{time.Since(start), err}
	}
	// Whatever happens, no Dial outlives this: the old code waited for the answer until it.
	safety, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	long, short := make(chan result, 1), make(chan result, 1)
	go dial(safety, time.Now(), long)
	// The connection is being made before the second CONNECT: they share it.
	testutil.Eventually(t, "the first Dial's connection", func() bool { return e.serverConns() == 1 })
	shortStart := time.Now()
	sctx, scancel := context.WithTimeout(safety, timeout/4)
	defer scancel()
	go dial(sctx, shortStart, short)
	for _, c := range []struct {
		name     string
		ch       chan result
		min, max time.Duration
	}{{"the CONNECT due at ctx's deadline", short, timeout / 4, timeout}, {"the CONNECT due at DialTimeout", long, timeout, 3 * timeout}} {
		r := <-c.ch
		if r.err == nil || !errors.Is(r.err, context.DeadlineExceeded) {
			t.Errorf("%s: err %v; want a deadline", c.name, r.err)
		}
		if r.took < c.min || r.took > c.max {
			t.Errorf("%s: returned after %v; want between %v and %v", c.name, r.took, c.min, c.max)
		}
		t.Logf("%s: %v after %v", c.name, r.err, r.took)
	}
	if n := e.serverConns(); n != 1 {
		t.Errorf("%d connections; want the two CONNECTs on one", n)
	}
}

// TestDialTLSDeadline: a peer that accepts TCP and never finishes TLS. Three Dials of the
// same key at once share one dial and then dial in turn; each still returns by its own
// deadline, not one DialTimeout after the dial it waited for.
func TestDialTLSDeadline(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	held := make(chan net.Conn, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(held)
				return
			}
			held <- c // never read: the ClientHello goes unanswered
		}
	}()
	defer func() {
		ln.Close()
		for c := range held {
			c.Close()
		}
	}()
	const timeout = time.Second
	e := newEnvConfigs(t, ServerConfig{}, ClientConfig{Config: Config{DialTimeout: timeout}}, echo)
	key := e.key
	key.Addr = netip.MustParseAddrPort(ln.Addr().String())
	took := make(chan time.Duration, 3)
	for range 3 {
		go func() {
			start := time.Now()
			_, err := e.pool.Dial(context.Background(), key, "10.0.0.1:80", nil)
			if err == nil {
				t.Error("Dial to a peer that never finishes TLS succeeded")
			}
			took <- time.Since(start)
		}()
	}
	for range 3 {
		if d := <-took; d > 2*timeout {
			t.Errorf("a Dial returned after %v; want about DialTimeout (%v)", d, timeout)
		}
	}
}
