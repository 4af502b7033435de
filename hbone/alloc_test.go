package hbone

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// roundAllocs measures allocations per round: a 16 KiB DATA frame each way through both
// peers (write, frame reader, stream buffer, read, echo), after warming up.
func roundAllocs(t *testing.T, rw io.ReadWriter) float64 {
	out := make([]byte, 16<<10)
	in := make([]byte, 16<<10)
	round := func() {
		if _, err := rw.Write(out); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(rw, in); err != nil {
			t.Fatal(err)
		}
	}
	for range 300 { // warm pools, windows, framer buffers
		round()
	}
	return testing.AllocsPerRun(500, round)
}

// Our HTTP/2 layer on plain TCP (h2c, as ServeConn allows) must not allocate per DATA
// frame, on either side.
func TestZeroAllocsPerDataFrame(t *testing.T) {
	if testing.CoverMode() != "" || raceEnabled {
		t.Skip("allocation counts need a build without -race and -cover")
	}
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(ServerConfig{}, echo)
	served := make(chan struct{})
	go func() {
		defer close(served)
		c, err := ln.Accept()
		if err == nil {
			srv.ServeConn(context.Background(), c)
		}
	}()
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	pool := NewPool(ClientConfig{}, nil)
	c, err := pool.startConn(context.Background(), Key{}, nc, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.tryReserve(true)
	s, err := c.open(context.Background(), pool.deadline(context.Background()), "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := roundAllocs(t, s); got != 0 {
		t.Errorf("%v allocations per DATA frame round trip, want 0", got)
	}
	s.Close()
	pool.Close()
	srv.Close()
	ln.Close()
	<-served
}

// Over TLS, crypto/tls itself allocates per record read (an atLeastReader in
// readFromUntil); HBONE must add nothing to what a plain crypto/tls echo costs.
func TestAllocsOverTLSMatchPlainTLS(t *testing.T) {
	if testing.CoverMode() != "" || raceEnabled {
		t.Skip("allocation counts need a build without -race and -cover")
	}
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	hb := roundAllocs(t, s)

	cc, sc := tlsPair(t)
	go io.Copy(sc, sc)
	base := roundAllocs(t, cc)
	cc.Close()
	sc.Close()
	t.Logf("allocs per 16 KiB round trip: plain crypto/tls %v, HBONE over TLS %v", base, hb)
	if hb > base {
		t.Errorf("HBONE over TLS: %v allocations per round trip, plain crypto/tls %v", hb, base)
	}
}

// tlsPair is a connected loopback crypto/tls client/server pair (handshake done).
func tlsPair(t testing.TB) (*tls.Conn, *tls.Conn) {
	testCA()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ch := make(chan *tls.Conn, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			ch <- nil
			return
		}
		sc := tls.Server(raw, srvTLS)
		sc.Handshake()
		ch <- sc
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cc := tls.Client(raw, cliTLS)
	if err := cc.Handshake(); err != nil {
		t.Fatal(err)
	}
	return cc, <-ch
}
