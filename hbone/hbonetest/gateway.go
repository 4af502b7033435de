// Package hbonetest has HBONE peers for tests: an east-west gateway.
package hbonetest

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
)

// Gateway is an east-west gateway as Istio's serves double HBONE: an mTLS HBONE server that
// routes each CONNECT by its authority (service-hostname:port) to a destination's HBONE
// listener and forwards the stream's bytes raw both ways. It never opens the inner TLS:
// the destination authenticates the client, not the gateway.
type Gateway struct {
	ln     net.Listener
	srv    *hbone.Server
	cfg    GatewayConfig
	cancel context.CancelFunc
	wg     sync.WaitGroup // the accept loop and each connection's ServeTLS

	// Forwarded counts the streams forwarded; requests (guarded by mu) holds every CONNECT
	// received, in order.
	Forwarded atomic.Int64
	mu        sync.Mutex
	requests  []Seen
}

// Seen is one CONNECT the gateway received.
type Seen struct {
	Authority string
	Peer      identity.ID
	Header    http.Header
}

// GatewayConfig is what a Gateway serves with.
type GatewayConfig struct {
	// TLS is the gateway's server side (its certificate; it must ask for client ones).
	TLS *tls.Config
	// Route maps a CONNECT's authority to the HBONE address to forward to; unknown
	// authorities get 503.
	Route func(authority string) (netip.AddrPort, bool)
	// Dial connects to a destination (nil: net.Dialer), e.g. inside a network namespace.
	Dial func(ctx context.Context, addr string) (net.Conn, error)
}

// ServeGateway serves a gateway on ln until Close.
func ServeGateway(ln net.Listener, cfg GatewayConfig) *Gateway {
	ctx, cancel := context.WithCancel(context.Background())
	g := &Gateway{ln: ln, cfg: cfg, cancel: cancel}
	if g.cfg.Dial == nil {
		var d net.Dialer
		g.cfg.Dial = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	}
	g.srv = hbone.NewServer(hbone.ServerConfig{}, g.forward)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			g.wg.Add(1)
			go func() {
				defer g.wg.Done()
				g.srv.ServeTLS(ctx, raw, cfg.TLS)
			}()
		}
	}()
	return g
}

// Addr is the gateway's listening address.
func (g *Gateway) Addr() netip.AddrPort { return netip.MustParseAddrPort(g.ln.Addr().String()) }

// Requests returns the CONNECTs received so far.
func (g *Gateway) Requests() []Seen {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]Seen(nil), g.requests...)
}

// Close stops the gateway, closes its connections and waits for them.
func (g *Gateway) Close() error {
	err := g.ln.Close()
	g.srv.Close()
	g.cancel()
	g.wg.Wait()
	return err
}

// forward is the gateway's handler: 503 for an unknown authority or an unreachable
// destination, else 200 and a raw copy both ways with half-close.
func (g *Gateway) forward(r *hbone.Request) {
	g.mu.Lock()
	g.requests = append(g.requests, Seen{Authority: r.Authority, Peer: r.Peer, Header: r.Header})
	g.mu.Unlock()
	to, ok := g.cfg.Route(r.Authority)
	if !ok {
		r.Reject(http.StatusServiceUnavailable)
		return
	}
	up, err := g.cfg.Dial(r.Context(), to.String())
	if err != nil {
		r.Reject(http.StatusServiceUnavailable)
		return
	}
	defer up.Close()
	s, err := r.Accept(nil)
	if err != nil {
		return
	}
	defer s.Close()
	g.Forwarded.Add(1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := io.Copy(up, s); err != nil {
			up.Close() // a reset stream: end the other direction too
			return
		}
		if cw, ok := up.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
	}()
	if _, err := io.Copy(s, up); err != nil {
		s.Close()
	} else {
		s.CloseWrite()
	}
	<-done
}
