package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// Double HBONE: an inner HBONE connection run over a CONNECT stream to a "gateway" that
// forwards the stream's bytes raw to the destination's HBONE listener, as an east-west
// gateway does. The bytes arrive whole, the destination sees the inner CONNECT's
// authority and headers, and the inner connection (and with it the outer stream) ends
// with its one stream.
func TestDialOverGateway(t *testing.T) {
	leaktest.Check(t)
	seen := make(chan *Request, 1)
	dst := newEnv(t, ServerConfig{}, func(r *Request) {
		seen <- r
		echo(r)
	})
	gw := newEnv(t, ServerConfig{}, proxyTo(dst.addr.String()))
	outer := gw.dial(t, "echo.default.svc:80")
	inner, err := gw.pool.DialOver(context.Background(), outer, dst.key, "echo.default.svc:80", http.Header{"X-Forwarded-Network": {"net1"}})
	if err != nil {
		t.Fatalf("DialOver: %v", err)
	}
	r := <-seen
	if r.Authority != "echo.default.svc:80" || r.Header.Get("X-Forwarded-Network") != "net1" {
		t.Errorf("destination saw authority %q, x-forwarded-network %q", r.Authority, r.Header.Get("X-Forwarded-Network"))
	}
	const size = 8 << 20
	go func() {
		io.Copy(inner, io.LimitReader(newPRNG(3), size))
		inner.CloseWrite()
	}()
	h := sha256.New()
	if n, err := io.Copy(h, inner); err != nil || n != size || !bytes.Equal(h.Sum(nil), hashOf(3, size)) {
		t.Fatalf("through the gateway: %d of %d bytes, err %v", n, size, err)
	}
	inner.Close()
	// The inner connection closes once its stream has ended, and closes the outer stream.
	outer.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := outer.Read(make([]byte, 1)); err == nil {
		t.Fatal("outer stream still open after the inner connection's stream ended")
	}
	if gw.serverConns() != 1 || dst.serverConns() != 1 {
		t.Errorf("connections: gateway %d, destination %d; want 1 each", gw.serverConns(), dst.serverConns())
	}
}

// A failed inner handshake closes the outer stream it ran over.
func TestDialOverFailedHandshakeClosesOuter(t *testing.T) {
	leaktest.Check(t)
	backend, stop := tcpEcho(t) // not TLS: the handshake reads its own ClientHello back
	defer stop()
	gw := newEnv(t, ServerConfig{}, proxyTo(backend))
	outer := gw.dial(t, "echo.default.svc:80")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := gw.pool.DialOver(ctx, outer, gw.key, "echo.default.svc:80", nil); err == nil {
		t.Fatal("DialOver over a non-TLS peer succeeded")
	}
	if _, err := outer.Write([]byte("x")); err == nil {
		t.Error("outer stream still writable after the failed inner dial")
	}
}
