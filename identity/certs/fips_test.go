package certs_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

func rsaKey(t *testing.T, bits int) crypto.Signer {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, bits)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestFIPSMode runs the mesh's handshakes in FIPS 140-3 mode (a child process with
// GODEBUG=fips140=on; testutil.InFIPSMode says why that is valid): what a FIPS node
// negotiates, and which certificate keys it accepts. Both ends run in the child, so a peer
// offering only what the mode refuses (X25519 alone, ChaCha20 alone) cannot be one of them:
// crypto/tls would filter its offer too. cmd/ztunnel's TestFIPSNodes has such peers.
func TestFIPSMode(t *testing.T) {
	if !testutil.InFIPSMode(t) {
		return
	}
	leaktest.Check(t)
	m, g, sc := setup(t)
	peer := func(max uint16, cert tls.Certificate, curves ...tls.CurveID) *tls.Config {
		return &tls.Config{MaxVersion: max, CurvePreferences: curves, Certificates: []tls.Certificate{cert},
			InsecureSkipVerify: true, NextProtos: []string{"h2"}}
	}
	now := time.Now()
	meshCert := func() tls.Certificate { return g.root.Issue(t, idA, now, now.Add(time.Hour)).Certificate }

	t.Run("mesh handshake", func(t *testing.T) {
		r := handshake(t, clientCfg(t, m, idA, idB), sc)
		if r.clientErr != nil || r.serverErr != nil {
			t.Fatalf("client err %v, server err %v", r.clientErr, r.serverErr)
		}
		if s := r.server; s.Version != tls.VersionTLS13 || s.CurveID != tls.X25519MLKEM768 ||
			(s.CipherSuite != tls.TLS_AES_128_GCM_SHA256 && s.CipherSuite != tls.TLS_AES_256_GCM_SHA384) {
			t.Errorf("negotiated %s %s %v; want TLS 1.3, AES-GCM, X25519MLKEM768", tls.VersionName(s.Version), tls.CipherSuiteName(s.CipherSuite), s.CurveID)
		}
	})
	// A peer without ML-KEM (an older Rust ztunnel) gets P-256, where a default node would
	// choose X25519 (TestHandshakeX25519Fallback).
	t.Run("peer without ML-KEM", func(t *testing.T) {
		r := handshake(t, peer(tls.VersionTLS13, meshCert(), tls.X25519, tls.CurveP256), sc)
		if r.clientErr != nil || r.serverErr != nil || r.server.CurveID != tls.CurveP256 {
			t.Fatalf("client err %v, server err %v, key exchange %v; want P-256", r.clientErr, r.serverErr, r.server.CurveID)
		}
	})
	// TLS12_ENABLED in FIPS mode: ECDHE on P-256 (X25519MLKEM768 is TLS 1.3's alone).
	t.Run("TLS 1.2", func(t *testing.T) {
		m12 := certs.New(certs.Config{TLS12: true}, g)
		defer m12.Close()
		sc12 := m12.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
		r := handshake(t, peer(tls.VersionTLS12, meshCert()), sc12)
		if r.clientErr != nil || r.serverErr != nil {
			t.Fatalf("client err %v, server err %v", r.clientErr, r.serverErr)
		}
		if s := r.server; s.Version != tls.VersionTLS12 || s.CurveID != tls.CurveP256 ||
			(s.CipherSuite != tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 && s.CipherSuite != tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384) {
			t.Errorf("negotiated %s %s %v; want TLS 1.2, ECDHE-ECDSA AES-GCM, P-256", tls.VersionName(s.Version), tls.CipherSuiteName(s.CipherSuite), s.CurveID)
		}
	})
	// Certificate keys: crypto/tls's rule, which the mesh's own verification applies.
	for _, c := range []struct {
		name string
		key  crypto.Signer
		ok   bool
	}{
		{"RSA 1024", rsaKey(t, 1024), false},
		{"RSA 2048", rsaKey(t, 2048), true},
		{"ECDSA P-384", ecKey(t, elliptic.P384()), true},
		{"Ed25519", edKey(t), true},
	} {
		t.Run("client key "+c.name, func(t *testing.T) {
			r := handshake(t, peer(tls.VersionTLS13, g.root.IssueKey(t, idA, c.key).Certificate), sc)
			if c.ok {
				if r.clientErr != nil || r.serverErr != nil {
					t.Fatalf("client err %v, server err %v", r.clientErr, r.serverErr)
				}
				return
			}
			wantErr(t, "server", r.serverErr, "FIPS 140-3 mode: peer certificate \""+idA.String()+"\" has a 1024-bit RSA key")
			wantReason(t, r.serverErr, certs.FailNotApproved)
		})
	}
	t.Run("server key RSA 1024", func(t *testing.T) {
		srv := &tls.Config{Certificates: []tls.Certificate{g.root.IssueKey(t, idB, rsaKey(t, 1024)).Certificate}}
		r := handshake(t, clientCfg(t, m, idA, idB), srv)
		wantErr(t, "client", r.clientErr, "which FIPS 140-3 does not approve")
	})
}

func edKey(t *testing.T) crypto.Signer {
	_, k, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func ecKey(t *testing.T, c elliptic.Curve) crypto.Signer {
	k, err := ecdsa.GenerateKey(c, rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
