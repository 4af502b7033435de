package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// download answers a stream with "dl" as its authority's host with 8 MiB, more than a
// stream window, so a client that does not read holds its whole window; other streams
// are echoed.
func download(r *Request) {
	if r.Authority != "dl:80" {
		echo(r)
		return
	}
	s, err := r.Accept(nil)
	if err != nil {
		return
	}
	defer s.Close()
	io.Copy(s, io.LimitReader(newPRNG(1), 8<<20))
	s.CloseWrite()
	io.Copy(io.Discard, s)
}

// stallStreams opens n downloads on the pool and never reads them, and waits until the
// pool's connections that carry them are congested.
func stallStreams(t *testing.T, e *env, n int) []*Stream {
	t.Helper()
	var out []*Stream
	for range n {
		out = append(out, e.dial(t, "dl:80"))
	}
	testutil.Eventually(t, "the stalled downloads to fill their connections' windows", func() bool {
		e.pool.mu.Lock()
		defer e.pool.mu.Unlock()
		kp := e.pool.keys[e.key]
		if kp == nil {
			return false
		}
		for _, c := range kp.conns {
			c.mu.Lock()
			busy := c.active > 0 && !c.congestedLocked()
			c.mu.Unlock()
			if busy {
				return false
			}
		}
		return true
	})
	return out
}

// echoBulk sends size bytes through an echo stream and checks they come back intact.
func echoBulk(t *testing.T, s *Stream, size int64) {
	t.Helper()
	s.SetDeadline(time.Now().Add(20 * time.Second))
	go func() {
		io.Copy(s, io.LimitReader(newPRNG(9), size))
		s.CloseWrite()
	}()
	h := sha256.New()
	if n, err := io.Copy(h, s); err != nil || n != size || !bytes.Equal(h.Sum(nil), hashOf(9, size)) {
		t.Fatalf("echo through a new stream: %d of %d bytes, err %v", n, size, err)
	}
}

// Four downloads nobody reads hold a connection's whole 16 MiB window. A new stream on the
// same key must not wait behind them: it gets a connection of its own and carries more
// than a whole connection window (which it could not, were it blocked there).
func TestStalledStreamsDoNotBlockNewOnes(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, download)
	stalled := stallStreams(t, e, 4)
	s := e.dial(t, "10.0.0.1:80")
	echoBulk(t, s, 32<<20)
	s.Close()
	if n := e.serverConns(); n != 2 {
		t.Errorf("server saw %d connections, want 2 (the congested one and one for the new stream)", n)
	}
	// Once the stalled readers catch up the first connection is used again.
	for _, st := range stalled {
		go io.Copy(io.Discard, st)
	}
	e.pool.mu.Lock()
	first := e.pool.keys[e.key].conns[0]
	e.pool.mu.Unlock()
	testutil.Eventually(t, "the first connection to drain", func() bool {
		first.mu.Lock()
		defer first.mu.Unlock()
		return !first.congestedLocked()
	})
	for _, st := range stalled {
		st.Close()
	}
	s2 := e.dial(t, "10.0.0.1:80")
	defer s2.Close()
	if s2.c != first {
		t.Error("a new stream did not go back to the first connection once it had drained")
	}
}

// Congestion dials at most maxCongestionDials extra connections per key; past that new
// streams share a congested connection again, which bounds what stalled streams can hold.
func TestCongestedConnectionsCapped(t *testing.T) {
	leaktest.Check(t)
	defer func(old int) { maxCongestionDials = old }(maxCongestionDials)
	maxCongestionDials = 1
	e := newEnv(t, ServerConfig{}, download)
	stalled := stallStreams(t, e, 4)                    // congest conn 1
	stalled = append(stalled, stallStreams(t, e, 4)...) // then conn 2
	defer func() {
		for _, s := range stalled {
			s.Close()
		}
	}()
	if n := e.serverConns(); n != 2 {
		t.Fatalf("server saw %d connections after 8 stalled downloads, want 2", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := e.pool.Dial(ctx, e.key, "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if n := e.serverConns(); n != 2 {
		t.Errorf("server saw %d connections, want 2: past the cap a congested one is shared", n)
	}
}
