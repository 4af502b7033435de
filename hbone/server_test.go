package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
)

// Serve on a listener that yields *tls.Conn (the handshake runs in ServeConn, no
// coalescing layer): peer identity, echo, then Close ends Serve.
func TestServeTLSListener(t *testing.T) {
	leaktest.Check(t)
	testCA()
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	peers := make(chan identity.ID, 1)
	srv := NewServer(ServerConfig{}, func(r *Request) {
		peers <- r.Peer
		echo(r)
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, tls.NewListener(raw, srvTLS)) }()
	pool := NewPool(ClientConfig{}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	key := NewKey(identity.MustParse(clientID), nil, netip.MustParseAddrPort(raw.Addr().String()), netip.Addr{})
	s, err := pool.Dial(context.Background(), key, "[fd00::1]:443", nil)
	if err != nil {
		t.Fatal(err)
	}
	if p := <-peers; p.String() != clientID {
		t.Errorf("peer %q, want %q", p, clientID)
	}
	s.Write([]byte("over tls.Conn"))
	s.CloseWrite()
	got, err := io.ReadAll(s)
	if string(got) != "over tls.Conn" || err != nil {
		t.Errorf("echo: %q %v", got, err)
	}
	s.Close()
	srv.Close()
	srv.Close() // idempotent
	if err := <-served; err != nil {
		t.Errorf("Serve = %v after Close", err)
	}
}

// A peer that accepts TCP but never speaks TLS: the dial times out with the hint about
// NetworkPolicy.
func TestDialTimeoutMessage(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			io.Copy(io.Discard, c)
			c.Close()
		}
	}()
	testCA()
	pool := NewPool(ClientConfig{Config: Config{DialTimeout: 100 * time.Millisecond}}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	key := NewKey(identity.ID{}, nil, netip.MustParseAddrPort(ln.Addr().String()), netip.Addr{})
	_, err = pool.Dial(context.Background(), key, "10.0.0.1:80", nil)
	if err == nil || !strings.Contains(err.Error(), "maybe a NetworkPolicy is blocking HBONE port 15008") {
		t.Fatalf("Dial = %v, want the NetworkPolicy hint", err)
	}
}

// A canceled context ends a Dial waiting for the CONNECT answer; the stream is reset.
func TestDialContextCanceledWhileWaiting(t *testing.T) {
	leaktest.Check(t)
	release := make(chan struct{})
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		<-release
		r.Reject(503)
	})
	defer close(release)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := e.pool.Dial(ctx, e.key, "10.0.0.1:80", nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial = %v, want deadline exceeded", err)
	}
}

func TestPoolCloseIdempotentAndFinal(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	e.pool.Close()
	e.pool.Close()
	if _, err := s.Read(make([]byte, 1)); !errors.Is(err, ErrConnClosed) {
		t.Errorf("Read after Pool.Close = %v, want ErrConnClosed", err)
	}
	if _, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil); err == nil {
		t.Error("Dial after Close succeeded")
	}
	s.Close()
}

// Shutdown gives open streams until its context ends, then closes everything.
func TestShutdownForcesAfterDeadline(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := e.srv.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown = %v, want deadline exceeded", err)
	}
	if _, err := io.ReadAll(s); !errors.Is(err, ErrConnClosed) {
		t.Errorf("Read after forced shutdown = %v, want ErrConnClosed", err)
	}
}
