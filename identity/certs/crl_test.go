package certs_test

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

// CRL_PATH: a peer whose certificate the CA's list revokes is refused on both sides of the
// handshake, others pass; a rewritten file is picked up by Watch; a missing or empty file
// revokes nothing; a malformed one refuses to open.
func TestCRL(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	now := time.Now()
	revoked := g.root.Issue(t, idA, now.Add(-time.Minute), now.Add(time.Hour))
	path := filepath.Join(t.TempDir(), "ca-crl.pem")
	if err := os.WriteFile(path, g.root.CRL(t, revoked.Certificate.Leaf.SerialNumber), 0o644); err != nil {
		t.Fatal(err)
	}
	crl, err := certs.OpenCRL(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	crl.Watch(nil)
	defer crl.Close()
	m := certs.New(certs.Config{CRL: crl}, g)
	defer m.Close()
	sc := m.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })
	peer := func(iss tls.Certificate) *tls.Config {
		return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{iss}, InsecureSkipVerify: true, NextProtos: []string{"h2"}}
	}
	r := handshake(t, peer(revoked.Certificate), sc)
	wantErr(t, "server", r.serverErr, "is revoked by the CRL")
	wantReason(t, r.serverErr, certs.FailRevoked)
	fresh := g.root.Issue(t, idA, now.Add(-time.Minute), now.Add(time.Hour))
	if r := handshake(t, peer(fresh.Certificate), sc); r.serverErr != nil || r.clientErr != nil {
		t.Fatalf("a certificate the CRL does not list: %v %v", r.clientErr, r.serverErr)
	}

	// Our client refuses a server whose certificate is revoked.
	srvIss := g.root.Issue(t, idB, now.Add(-time.Minute), now.Add(time.Hour))
	if err := os.WriteFile(path, g.root.CRL(t, revoked.Certificate.Leaf.SerialNumber, srvIss.Certificate.Leaf.SerialNumber), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		srv := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{srvIss.Certificate}, ClientAuth: tls.RequireAnyClientCert, NextProtos: []string{"h2"}}
		r := handshake(t, clientCfg(t, m, idA, idB), srv)
		if r.clientErr != nil && strings.Contains(r.clientErr.Error(), "is revoked by the CRL") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the rewritten CRL was not picked up in 10s: client err %v", r.clientErr)
		}
		time.Sleep(200 * time.Millisecond)
	}

	// Empty revokes nothing; a missing file too; garbage does not open.
	os.WriteFile(path, nil, 0o644)
	if c, err := certs.OpenCRL(path, nil); err != nil {
		t.Errorf("empty CRL file: %v", err)
	} else {
		m2 := certs.New(certs.Config{CRL: c}, g)
		if r := handshake(t, peer(revoked.Certificate), m2.ServerConfig(func(*tls.ClientHelloInfo) (identity.ID, error) { return idB, nil })); r.serverErr != nil {
			t.Errorf("empty CRL refused a peer: %v", r.serverErr)
		}
		m2.Close()
	}
	if _, err := certs.OpenCRL(filepath.Join(t.TempDir(), "absent.pem"), nil); err != nil {
		t.Errorf("missing CRL file: %v; want a warning, not an error", err)
	}
	os.WriteFile(path, []byte("-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n"), 0o644)
	if _, err := certs.OpenCRL(path, nil); err == nil {
		t.Error("a malformed CRL file opened")
	}
}
