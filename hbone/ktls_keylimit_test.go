//go:build linux

package hbone

import (
	"errors"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// TestKernelTLSKeyLimit: a server on kernel TLS counts the records it receives (the
// kernel here follows no KeyUpdate) and drains at KeyDrainRecords: the client's pool puts
// the next stream on a fresh connection and the stream open across the drain carries on.
// When the peer's KeyUpdate then comes (asked for here; rustls sends one at its limit),
// the stream that outlived the drain fails loudly, OnKeyLimit counts it, and the stream
// on the fresh connection is untouched.
func TestKernelTLSKeyLimit(t *testing.T) {
	leaktest.Check(t)
	start := time.Now()
	defer func() { t.Logf("%v", time.Since(start)) }()
	if !kernelHasTLS(t) {
		t.Skip("no kernel TLS here: run `make test-ktls`")
	}
	ev := newKeyEvents()
	var infos tlsInfos
	scfg := Config{KeyDrainRecords: 64, OnKeyLimit: ev.on, OnTLS: infos.add}
	ccfg := Config{KeyDrainRecords: -1, KeyMaxRecords: -1, DisableKernelTLS: true}
	conns := make(chan *conn, 4)
	e := newEnvConfigs(t, ServerConfig{Config: scfg}, ClientConfig{Config: ccfg}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		conns <- s.c
		defer s.Close()
		io.Copy(s, s)
		s.CloseWrite()
	})
	s1 := e.dial(t, "10.0.0.1:80")
	defer s1.Close()
	if err := pingPong(t, s1, 10, 'a'); err != nil {
		t.Fatal(err)
	}
	sc1 := <-conns
	if sc1.kt.conn == nil {
		t.Fatalf("the server's connection is not on kernel TLS: %+v", infos.take())
	}
	if err := pingPong(t, s1, 200, 'b'); err != nil {
		t.Fatal(err)
	}
	t.Logf("%v: 210 messages", time.Since(start))
	l := ev.wait(t, "drain")
	if !l.Kernel || !l.Server || l.RX < 64 || l.Streams != 1 {
		t.Errorf("OnKeyLimit heard %+v; want the kernel TLS server, RX >= 64, 1 stream", l)
	}
	s2 := carriesOnAfterDrain(t, e, s1)
	defer s2.Close()
	// The peer's KeyUpdate: the stream that outlived the drain fails, loudly.
	t.Logf("%v: drained, fresh connection, 20 more messages", time.Since(start))
	requestKeyUpdate(t, sc1)
	l = ev.wait(t, "peer_key_update")
	if l.Streams != 1 || !l.Kernel {
		t.Errorf("OnKeyLimit heard %+v; want 1 stream lost on kernel TLS", l)
	}
	err := pingPong(t, s1, 1, 'e')
	if !errors.Is(err, ErrConnClosed) {
		t.Fatalf("the stream that outlived the drain, after the peer's KeyUpdate: %v; want ErrConnClosed", err)
	}
	t.Logf("%v: KeyUpdate", time.Since(start))
	if err := pingPong(t, s2, 5, 'f'); err != nil {
		t.Fatalf("the stream on the fresh connection: %v", err)
	}
}

// TestKernelTLSPeerKeyUpdate: testPeerKeyUpdate with the pool on kernel TLS. A peer that
// may send KeyUpdates (ALPN "h2", as the Rust ztunnel) keeps the connection in user space,
// where every KeyUpdate is followed and no byte is lost; one that promised not to
// (NextProtoNoKeyUpdate) and sends one anyway gets kernel TLS, which follows none: the
// stream fails loudly and the pool moves on.
func TestKernelTLSPeerKeyUpdate(t *testing.T) {
	leaktest.Check(t)
	if !kernelHasTLS(t) {
		t.Skip("no kernel TLS here: run `make test-ktls`")
	}
	t.Run("peer may update keys", func(t *testing.T) { testPeerKeyUpdate(t, true, "h2") })
	t.Run("peer broke its promise", func(t *testing.T) { testPeerKeyUpdate(t, true, NextProtoNoKeyUpdate, "h2") })
}
