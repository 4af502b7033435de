package hbone

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/gozt/gozt/hbone/internal/testcert"
	"github.com/gozt/gozt/identity"
)

const (
	clientID = "spiffe://cluster.local/ns/default/sa/client"
	serverID = "spiffe://cluster.local/ns/default/sa/server"
)

var (
	caOnce sync.Once
	ca     *testcert.CA
	srvTLS *tls.Config
	cliTLS *tls.Config
)

// xnetTLS is the client config as an x/net HTTP/2 client (Istio's Go HBONE) has it: ALPN
// "h2" only, so it gets HTTP/2 from a peer that may send KeyUpdates, in user-space TLS.
func xnetTLS() *tls.Config {
	testCA()
	c := cliTLS.Clone()
	c.NextProtos = []string{"h2"}
	return c
}

func testCA() *testcert.CA {
	caOnce.Do(func() {
		ca = testcert.NewCA()
		srvTLS = ca.ServerConfig(serverID)
		cliTLS = ca.ClientConfig(clientID)
	})
	return ca
}

// env is a real loopback HBONE server and a client pool pointed at it.
type env struct {
	t    testing.TB
	srv  *Server
	ln   net.Listener
	pool *Pool
	key  Key
	addr netip.AddrPort

	mu    sync.Mutex
	dials int        // TCP connections the server accepted
	raws  []net.Conn // those connections, for abrupt-close tests
}

func newEnv(t testing.TB, cfg ServerConfig, h Handler) *env {
	t.Helper()
	return newEnvConfigs(t, cfg, ClientConfig{Config: cfg.Config}, h)
}

// newEnvConfigs is newEnv with the pool's configuration apart from the server's.
func newEnvConfigs(t testing.TB, cfg ServerConfig, poolCfg ClientConfig, h Handler) *env {
	t.Helper()
	testCA()
	return newEnvTLS(t, cfg, poolCfg, h, srvTLS)
}

// newEnvTLS is newEnvConfigs with the server's TLS config given.
func newEnvTLS(t testing.TB, cfg ServerConfig, poolCfg ClientConfig, h Handler, serverTLS *tls.Config) *env {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, srv: NewServer(cfg, h), ln: ln}
	e.addr = netip.MustParseAddrPort(ln.Addr().String())
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var cwg sync.WaitGroup
		defer cwg.Wait()
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.dials++
			e.raws = append(e.raws, raw)
			e.mu.Unlock()
			cwg.Add(1)
			go func() {
				defer cwg.Done()
				e.srv.ServeTLS(ctx, raw, serverTLS)
			}()
		}
	}()
	e.pool = NewPool(poolCfg, func(ctx context.Context, k Key) (*tls.Config, error) { return cliTLS, nil })
	e.key = NewKey(identity.MustParse(clientID), []identity.ID{identity.MustParse(serverID)}, e.addr, netip.Addr{})
	t.Cleanup(func() {
		e.pool.Close()
		ln.Close()
		e.srv.Close()
		cancel()
		wg.Wait()
	})
	return e
}

// serveEach accepts on ln until it is closed, serving each connection with serve on a
// goroutine of its own; at t's cleanup it closes ln and srv, ends serve's ctx and waits
// for the accept loop and every serve.
func serveEach(t testing.TB, ln net.Listener, srv *Server, serve func(ctx context.Context, raw net.Conn)) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { serve(ctx, raw) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		srv.Close()
		cancel()
		wg.Wait()
	})
}

func (e *env) serverConns() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.dials
}

func (e *env) dial(t testing.TB, authority string) *Stream {
	t.Helper()
	s, err := e.pool.Dial(context.Background(), e.key, authority, nil)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	return s
}

// echo accepts and copies the stream back to itself, half-closing on EOF.
func echo(r *Request) {
	s, err := r.Accept(nil)
	if err != nil {
		return
	}
	defer s.Close()
	io.Copy(s, s)
	s.CloseWrite()
	io.Copy(io.Discard, s)
}

// discard accepts and reads the stream until it ends, sending nothing.
func discard(r *Request) {
	s, err := r.Accept(nil)
	if err != nil {
		return
	}
	defer s.Close()
	io.Copy(io.Discard, s)
}

var (
	e0 netip.AddrPort
	z0 netip.Addr
)

// bothWays runs f twice as subtests, with the package switch *flag true (named on) and
// false (named off), restoring it afterwards.
func bothWays(t *testing.T, flag *bool, on, off string, f func(t *testing.T)) {
	for _, v := range []bool{true, false} {
		name := off
		if v {
			name = on
		}
		t.Run(name, func(t *testing.T) {
			defer func(old bool) { *flag = old }(*flag)
			*flag = v
			f(t)
		})
	}
}

func mustID(s string) identity.ID { return identity.MustParse(s) }

func ids(ss ...string) []identity.ID {
	var out []identity.ID
	for _, s := range ss {
		out = append(out, identity.MustParse(s))
	}
	return out
}
