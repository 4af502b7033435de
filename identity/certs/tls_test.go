package certs_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

type result struct {
	clientErr, serverErr error
	client, server       tls.ConnectionState
	sni                  string
}

// handshake runs one TLS handshake over a real loopback TCP connection and returns both
// ends' outcome. In TLS 1.3 the client finishes before the server has judged its
// certificate, so the client also reads once to learn about a server-side rejection.
func handshake(t *testing.T, cc, sc *tls.Config) result {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var r result
	sc = sc.Clone()
	if inner := sc.GetConfigForClient; inner != nil {
		sc.GetConfigForClient = func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			r.sni = h.ServerName
			return inner(h)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		conn, err := ln.Accept()
		if err != nil {
			r.serverErr = err
			return
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		s := tls.Server(conn, sc)
		r.serverErr = s.Handshake()
		r.server = s.ConnectionState()
		if r.serverErr == nil {
			s.Write([]byte("x"))
		}
	}()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	c := tls.Client(conn, cc)
	r.clientErr = c.Handshake()
	if r.clientErr == nil {
		_, r.clientErr = c.Read(make([]byte, 1))
		r.client = c.ConnectionState()
	} else {
		conn.Close()
	}
	<-done
	return r
}

func wantErr(t *testing.T, side string, err error, want string) {
	t.Helper()
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("%s error = %v; want one containing %q", side, err, want)
	}
}

func setup(t *testing.T) (*certs.Manager, *gatedCA, *tls.Config) {
	g := newGated(t, time.Hour)
	m := certs.New(certs.Config{}, g)
	t.Cleanup(func() { m.Close() })
	sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
	return m, g, sc
}

func clientCfg(t *testing.T, m *certs.Manager, src identity.ID, expected ...identity.ID) *tls.Config {
	t.Helper()
	cc, err := m.ClientConfig(context.Background(), src, expected)
	if err != nil {
		t.Fatal(err)
	}
	return cc
}

func TestHandshakeAccepted(t *testing.T) {
	leaktest.Check(t)
	m, _, sc := setup(t)
	r := handshake(t, clientCfg(t, m, idA, idC, idB), sc)
	if r.clientErr != nil || r.serverErr != nil {
		t.Fatalf("client err %v, server err %v", r.clientErr, r.serverErr)
	}
	if peer, err := certs.PeerIdentity(r.server); err != nil || peer != idA {
		t.Errorf("server sees peer %v (%v); want %v", peer, err, idA)
	}
	if peer, _ := certs.PeerIdentity(r.client); peer != idB {
		t.Errorf("client sees peer %v; want %v", peer, idB)
	}
	s := r.server
	// Both ends are gozt's: HTTP/2 from a peer that never sends a KeyUpdate (hbone's
	// NextProtoNoKeyUpdate), which lets the connection move to kernel TLS.
	if s.Version != tls.VersionTLS13 || s.NegotiatedProtocol != "gozt-h2" || s.DidResume ||
		(s.CipherSuite != tls.TLS_AES_128_GCM_SHA256 && s.CipherSuite != tls.TLS_AES_256_GCM_SHA384) {
		t.Errorf("version %x alpn %q suite %s resumed %v; want TLS 1.3, gozt-h2, AES-GCM, fresh",
			s.Version, s.NegotiatedProtocol, tls.CipherSuiteName(s.CipherSuite), s.DidResume)
	}
	if s.CurveID != tls.X25519MLKEM768 {
		t.Errorf("key exchange %v; want X25519MLKEM768", s.CurveID)
	}
	if r.sni != "" {
		t.Errorf("client sent SNI %q; want none", r.sni)
	}
	if n := len(r.server.PeerCertificates); n != 1 {
		t.Errorf("client presented %d certificates; want its leaf", n)
	}
}

func TestHandshakeX25519Fallback(t *testing.T) {
	leaktest.Check(t)
	_, g, sc := setup(t)
	now := time.Now()
	iss := g.root.Issue(t, idA, now, now.Add(time.Hour))
	old := &tls.Config{ // a peer without ML-KEM, like an older Rust ztunnel
		MinVersion: tls.VersionTLS13, CurvePreferences: []tls.CurveID{tls.X25519},
		Certificates: []tls.Certificate{iss.Certificate}, InsecureSkipVerify: true, NextProtos: []string{"h2"},
	}
	r := handshake(t, old, sc)
	if r.clientErr != nil || r.serverErr != nil {
		t.Fatalf("client err %v, server err %v", r.clientErr, r.serverErr)
	}
	if r.server.CurveID != tls.X25519 {
		t.Errorf("key exchange %v; want X25519", r.server.CurveID)
	}
}

// A peer limited to NIST curves (a FIPS build of either ztunnel without ML-KEM) gets P-256,
// as from the Rust ztunnel, whose rustls offers P-256 and P-384 after X25519.
func TestHandshakeNISTFallback(t *testing.T) {
	leaktest.Check(t)
	_, g, sc := setup(t)
	now := time.Now()
	for _, curve := range []tls.CurveID{tls.CurveP256, tls.CurveP384} {
		nist := &tls.Config{
			MinVersion: tls.VersionTLS13, CurvePreferences: []tls.CurveID{curve},
			Certificates: []tls.Certificate{g.root.Issue(t, idA, now, now.Add(time.Hour)).Certificate}, InsecureSkipVerify: true, NextProtos: []string{"h2"},
		}
		r := handshake(t, nist, sc)
		if r.clientErr != nil || r.serverErr != nil || r.server.CurveID != curve {
			t.Errorf("peer offering %v: client err %v, server err %v, key exchange %v", curve, r.clientErr, r.serverErr, r.server.CurveID)
		}
	}
}

func TestHandshakePQCOnly(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	m := certs.New(certs.Config{PQCOnly: true}, g)
	defer m.Close()
	sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
	if r := handshake(t, clientCfg(t, m, idA, idB), sc); r.clientErr != nil || r.serverErr != nil || r.server.CurveID != tls.X25519MLKEM768 {
		t.Fatalf("pqc handshake: %v %v %v", r.clientErr, r.serverErr, r.server.CurveID)
	}
	now := time.Now()
	old := &tls.Config{
		MinVersion: tls.VersionTLS13, CurvePreferences: []tls.CurveID{tls.X25519},
		Certificates: []tls.Certificate{g.root.Issue(t, idA, now, now.Add(time.Hour)).Certificate}, InsecureSkipVerify: true,
	}
	r := handshake(t, old, sc)
	wantErr(t, "server", r.serverErr, "no key exchanges supported")
}

// TLS12_ENABLED: a peer limited to TLS 1.2 is served with an ECDHE AES-GCM suite, and the
// mesh's own handshakes stay TLS 1.3; without it that peer is refused.
func TestHandshakeTLS12(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	now := time.Now()
	old := func() *tls.Config { // a FIPS-limited peer: TLS 1.2 at most
		return &tls.Config{
			MaxVersion: tls.VersionTLS12, Certificates: []tls.Certificate{g.root.Issue(t, idA, now, now.Add(time.Hour)).Certificate},
			InsecureSkipVerify: true, NextProtos: []string{"h2"},
		}
	}
	for _, enabled := range []bool{false, true} {
		m := certs.New(certs.Config{TLS12: enabled}, g)
		sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
		r := handshake(t, old(), sc)
		if !enabled {
			wantErr(t, "server", r.serverErr, "unsupported versions")
			m.Close()
			continue
		}
		if r.clientErr != nil || r.serverErr != nil {
			t.Fatalf("TLS 1.2 peer: client err %v, server err %v", r.clientErr, r.serverErr)
		}
		if s := r.server; s.Version != tls.VersionTLS12 || s.NegotiatedProtocol != "h2" ||
			(s.CipherSuite != tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 && s.CipherSuite != tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384) {
			t.Errorf("version %x alpn %q suite %s; want TLS 1.2, h2, ECDHE-ECDSA AES-GCM", s.Version, s.NegotiatedProtocol, tls.CipherSuiteName(s.CipherSuite))
		}
		if peer, err := certs.PeerIdentity(r.server); err != nil || peer != idA {
			t.Errorf("server sees peer %v (%v); want %v", peer, err, idA)
		}
		// Our own client against a server limited to 1.2, and between two of ours: 1.3.
		srv12 := sc.Clone()
		srv12.MaxVersion = tls.VersionTLS12
		inner := srv12.GetConfigForClient
		srv12.GetConfigForClient = func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			c, err := inner(h)
			if c != nil {
				c = c.Clone()
				c.MaxVersion = tls.VersionTLS12
			}
			return c, err
		}
		if r := handshake(t, clientCfg(t, m, idA, idB), srv12); r.clientErr != nil || r.serverErr != nil || r.client.Version != tls.VersionTLS12 {
			t.Errorf("client to a TLS 1.2 server: %v %v version %x", r.clientErr, r.serverErr, r.client.Version)
		}
		if r := handshake(t, clientCfg(t, m, idA, idB), sc); r.clientErr != nil || r.server.Version != tls.VersionTLS13 {
			t.Errorf("mesh handshake with TLS12 on: %v, version %x; want 1.3", r.clientErr, r.server.Version)
		}
		m.Close()
	}
}

func TestHandshakeRejected(t *testing.T) {
	leaktest.Check(t)
	m, g, sc := setup(t)
	now := time.Now()
	other := catest.NewRoot(t, "other")
	raw := func(certs ...tls.Certificate) *tls.Config {
		return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: certs, InsecureSkipVerify: true, NextProtos: []string{"h2"}}
	}
	otherTD := identity.MustParse("spiffe://other.td/ns/a/sa/alice")
	tls12 := raw(g.root.Issue(t, idA, now, now.Add(time.Hour)).Certificate)
	tls12.MinVersion, tls12.MaxVersion = tls.VersionTLS12, tls.VersionTLS12

	t.Run("wrong SAN", func(t *testing.T) {
		r := handshake(t, clientCfg(t, m, idA, idC), sc)
		wantErr(t, "client", r.clientErr, "server identity is "+idB.String()+", expected one of ["+idC.String()+"]")
	})
	t.Run("other trust domain", func(t *testing.T) {
		r := handshake(t, clientCfg(t, m, otherTD, idB), sc)
		wantErr(t, "server", r.serverErr, `client `+otherTD.String()+` is not in trust domain "cluster.local"`)
		wantErr(t, "client", r.clientErr, "bad certificate")
		wantReason(t, r.serverErr, certs.FailTrustDomain)
		wantReason(t, r.clientErr, certs.FailPeerAlert)
	})
	t.Run("expired client leaf", func(t *testing.T) {
		r := handshake(t, raw(g.root.Issue(t, idA, now.Add(-2*time.Hour), now.Add(-time.Hour)).Certificate), sc)
		wantErr(t, "server", r.serverErr, "expired")
		wantReason(t, r.serverErr, certs.FailExpired)
	})
	t.Run("client leaf from another root", func(t *testing.T) {
		r := handshake(t, raw(other.Issue(t, idA, now, now.Add(time.Hour)).Certificate), sc)
		wantErr(t, "server", r.serverErr, "unknown authority")
		wantReason(t, r.serverErr, certs.FailUnknownCA)
	})
	t.Run("no client certificate", func(t *testing.T) {
		r := handshake(t, raw(), sc)
		wantErr(t, "server", r.serverErr, "didn't provide a certificate")
		wantErr(t, "client", r.clientErr, "certificate required")
		wantReason(t, r.serverErr, certs.FailNoClientCert)
	})
	t.Run("TLS 1.2 client", func(t *testing.T) {
		r := handshake(t, tls12, sc)
		wantErr(t, "server", r.serverErr, "unsupported versions")
		wantReason(t, r.serverErr, certs.FailProtocol)
	})
	t.Run("server from another root", func(t *testing.T) {
		bad := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{other.Issue(t, idB, now, now.Add(time.Hour)).Certificate}}
		r := handshake(t, clientCfg(t, m, idA, idB), bad)
		wantErr(t, "client", r.clientErr, "unknown authority")
	})
	t.Run("expired server leaf", func(t *testing.T) {
		bad := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{g.root.Issue(t, idB, now.Add(-2*time.Hour), now.Add(-time.Hour)).Certificate}}
		r := handshake(t, clientCfg(t, m, idA, idB), bad)
		wantErr(t, "client", r.clientErr, "expired")
	})
	t.Run("no local identity", func(t *testing.T) {
		sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return identity.ID{}, net.ErrClosed })
		r := handshake(t, clientCfg(t, m, idA, idB), sc)
		wantErr(t, "server", r.serverErr, "no local identity")
		wantReason(t, r.serverErr, certs.FailNoLocalIdentity)
	})
}

// wantReason checks HandshakeFailure's reason for a handshake's error.
func wantReason(t *testing.T, err error, want string) {
	t.Helper()
	if got := certs.HandshakeFailure(err); got != want {
		t.Errorf("HandshakeFailure(%v) = %q; want %q", err, got, want)
	}
}

// TestHandshakePicksUpRotation: one ClientConfig and one ServerConfig, kept across a
// certificate change, present the new leaves on the next handshake.
func TestHandshakePicksUpRotation(t *testing.T) {
	leaktest.Check(t)
	m, _, sc := setup(t)
	cc := clientCfg(t, m, idA, idB)
	r1 := handshake(t, cc, sc)
	m.Forget(idA)
	m.Forget(idB)
	r2 := handshake(t, cc, sc)
	if r1.serverErr != nil || r2.serverErr != nil || r1.clientErr != nil || r2.clientErr != nil {
		t.Fatalf("handshake errors: %v %v %v %v", r1.clientErr, r1.serverErr, r2.clientErr, r2.serverErr)
	}
	if r1.server.PeerCertificates[0].Equal(r2.server.PeerCertificates[0]) {
		t.Error("client presented the old leaf after its certificate changed")
	}
	if r1.client.PeerCertificates[0].Equal(r2.client.PeerCertificates[0]) {
		t.Error("server presented the old leaf after its certificate changed")
	}
}

func TestClientConfigErrors(t *testing.T) {
	m, g, _ := setup(t)
	if _, err := m.ClientConfig(context.Background(), idA, nil); err == nil {
		t.Error("client config with no expected identity accepted")
	}
	g.set(errDown, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := m.ClientConfig(ctx, idC, []identity.ID{idB}); err == nil || !strings.Contains(err.Error(), errDown.Error()) {
		t.Errorf("err = %v; want the CA error", err)
	}
}

// BenchmarkHandshake measures full mTLS handshakes over loopback (client and server in this
// process) with the builders, against a baseline of static crypto/tls configs doing the same
// mutual authentication with the same certificates and key exchange.
func BenchmarkHandshake(b *testing.B) {
	g := &gatedCA{root: catest.NewRoot(b, "root"), ttl: time.Hour}
	m := certs.New(certs.Config{}, g)
	defer m.Close()
	cc, err := m.ClientConfig(context.Background(), idA, []identity.ID{idB})
	if err != nil {
		b.Fatal(err)
	}
	sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
	now := time.Now()
	ci, si := g.root.Issue(b, idA, now, now.Add(time.Hour)), g.root.Issue(b, idB, now, now.Add(time.Hour))
	pool := x509.NewCertPool()
	pool.AddCert(g.root.Cert)
	baseC := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{ci.Certificate},
		InsecureSkipVerify: true, SessionTicketsDisabled: true, NextProtos: []string{"h2"},
		// The same chain check crypto/tls would do, without a host name (there is none).
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool})
			return err
		}}
	baseS := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{si.Certificate}, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, SessionTicketsDisabled: true, NextProtos: []string{"h2"}}
	for _, bc := range []struct {
		name   string
		cc, sc *tls.Config
	}{{"baseline-static", baseC, baseS}, {"builders", cc, sc}} {
		b.Run(bc.name, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					s := tls.Server(c, bc.sc)
					if err := s.Handshake(); err == nil {
						s.Write([]byte("x"))
					}
					s.Close()
				}
			}()
			buf := make([]byte, 1)
			for b.Loop() {
				c, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				tc := tls.Client(c, bc.cc)
				if _, err := tc.Read(buf); err != nil {
					b.Fatal(err)
				}
				tc.Close()
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "handshakes/s")
			ln.Close()
			<-done
		})
	}
}

// TestHandshakeFailureTransport: what a client that is not speaking TLS, leaves or
// stalls mid-handshake makes the server's handshake fail with is told apart from a
// certificate's failure.
func TestHandshakeFailureTransport(t *testing.T) {
	leaktest.Check(t)
	_, _, sc := setup(t)
	for _, c := range []struct {
		name   string
		client func(net.Conn)
		want   string
	}{
		{"not TLS", func(c net.Conn) { c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")) }, certs.FailProtocol},
		{"closed", func(c net.Conn) { c.Close() }, certs.FailPeerClosed},
		{"stalled", func(net.Conn) {}, certs.FailTimeout},
	} {
		t.Run(c.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			cl, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			conn, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			c.client(cl)
			conn.SetDeadline(time.Now().Add(200 * time.Millisecond))
			err = tls.Server(conn, sc).Handshake()
			wantReason(t, err, c.want)
		})
	}
}
