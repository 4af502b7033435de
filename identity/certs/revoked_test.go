package certs_test

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

// crlPEM is a CRL signed by ca revoking serials, with the given nextUpdate.
func crlPEM(t *testing.T, ca *catest.Root, next time.Time, serials ...*big.Int) []byte {
	t.Helper()
	tmpl := &x509.RevocationList{Number: big.NewInt(time.Now().UnixNano()), ThisUpdate: next.Add(-2 * time.Hour), NextUpdate: next}
	for _, s := range serials {
		tmpl.RevokedCertificateEntries = append(tmpl.RevokedCertificateEntries, x509.RevocationListEntry{SerialNumber: s, RevocationTime: time.Now()})
	}
	der, err := x509.CreateRevocationList(rand.Reader, tmpl, ca.Cert, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der})
}

// Manager.Revoked judges an established connection's peer against the lists in force now: a
// revoked intermediate revokes every leaf under it and no other; a revoked leaf only itself;
// a list past nextUpdate still revokes (and says so); a list whose signature does not verify
// against the CA it names revokes nothing and is reported as invalid.
func TestManagerRevoked(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	now := time.Now()
	interA := g.root.Intermediate(t, "intermediate-a", now.Add(-time.Hour), now.Add(time.Hour))
	interB := g.root.Intermediate(t, "intermediate-b", now.Add(-time.Hour), now.Add(time.Hour))
	underA := interA.Issue(t, idA, now.Add(-time.Minute), now.Add(time.Hour))
	underB := interB.Issue(t, idA, now.Add(-time.Minute), now.Add(time.Hour))
	underB2 := interB.Issue(t, idB, now.Add(-time.Minute), now.Add(time.Hour))
	state := func(iss *tls.Certificate) tls.ConnectionState {
		var cs tls.ConnectionState
		for _, der := range iss.Certificate {
			c, err := x509.ParseCertificate(der)
			if err != nil {
				t.Fatal(err)
			}
			cs.PeerCertificates = append(cs.PeerCertificates, c)
		}
		return cs
	}

	path := filepath.Join(t.TempDir(), "ca-crl.pem")
	os.WriteFile(path, nil, 0o644)
	crl, err := certs.OpenCRL(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	m := certs.New(certs.Config{CRL: crl}, g)
	defer m.Close()
	if _, err := m.Certificate(context.Background(), idB); err != nil { // the bundle Revoked verifies against
		t.Fatal(err)
	}
	if err := m.Revoked(state(&underA.Certificate)); err != nil {
		t.Fatalf("no lists yet: %v", err)
	}

	// The root revokes intermediate A (its list past nextUpdate); B revokes one of its leaves.
	impostor := catest.NewRoot(t, "intermediate-b") // same name as B, another key
	data := append(crlPEM(t, g.root, now.Add(-time.Minute), interA.Cert.SerialNumber), crlPEM(t, interB, now.Add(time.Hour), underB2.Certificate.Leaf.SerialNumber)...)
	data = append(data, crlPEM(t, impostor, now.Add(time.Hour), underB.Certificate.Leaf.SerialNumber)...)
	os.WriteFile(path, data, 0o644)
	changed := make(chan struct{}, 1)
	crl.Watch(func() { changed <- struct{}{} })
	defer crl.Close()
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not call back within 10s of the file's change")
	}

	var re *certs.RevokedError
	if err := m.Revoked(state(&underA.Certificate)); !errors.As(err, &re) || re.Cert.SerialNumber.Cmp(interA.Cert.SerialNumber) != 0 || re.Peer[0].String() != idA.String() {
		t.Fatalf("leaf under revoked intermediate A: %v, want a RevokedError naming A's serial and the peer", err)
	}
	if err := m.Revoked(state(&underB2.Certificate)); !errors.As(err, &re) || re.Cert != nil && re.Cert.SerialNumber.Cmp(underB2.Certificate.Leaf.SerialNumber) != 0 {
		t.Fatalf("leaf B revoked: %v", err)
	}
	if err := m.Revoked(state(&underB.Certificate)); err != nil {
		t.Fatalf("a leaf only the impostor's list names was judged revoked: %v", err)
	}
	info := crl.Info()
	if len(info) != 3 {
		t.Fatalf("Info: %d lists, want 3", len(info))
	}
	if !info[0].Expired || info[0].Signature != "verified" || info[0].Issuer != "CN=root" || info[0].Revoked != 1 {
		t.Errorf("root's list: %+v; want expired, verified, CN=root, one revoked", info[0])
	}
	if info[1].Expired || info[1].Signature != "verified" {
		t.Errorf("B's list: %+v; want in date, verified", info[1])
	}
	if info[2].Signature != "invalid" {
		t.Errorf("impostor's list: %+v; want signature invalid", info[2])
	}

	// CheckCRL finds a bad list of a root the manager holds before any peer meets it.
	fakeRoot := catest.NewRoot(t, "root") // the mesh root's name, another key
	os.WriteFile(path, append(crlPEM(t, fakeRoot, now.Add(time.Hour), underB.Certificate.Leaf.SerialNumber), crlPEM(t, g.root, now.Add(time.Hour))...), 0o644)
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not call back within 10s of the file's change")
	}
	if info := crl.Info(); info[0].Signature != "unchecked" || info[1].Signature != "unchecked" {
		t.Fatalf("before CheckCRL: %+v; want both unchecked", info)
	}
	m.CheckCRL()
	if info := crl.Info(); info[0].Signature != "invalid" || info[1].Signature != "verified" {
		t.Fatalf("after CheckCRL: %+v; want the fake root's invalid, the root's verified", info)
	}
	if err := m.Revoked(state(&underB.Certificate)); err != nil {
		t.Fatalf("a leaf only the fake root's list names was judged revoked: %v", err)
	}
}

// The chart mounts the istio-ca-crl ConfigMap (optional) at CRL_PATH's directory: absent, the
// directory is empty; present, ca-crl.pem is a symlink through ..data, which the kubelet
// swaps atomically to a new timestamped directory on each update. Both are followed.
func TestCRLConfigMapLayout(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	dir := t.TempDir()
	path := filepath.Join(dir, "ca-crl.pem")
	crl, err := certs.OpenCRL(path, nil) // the ConfigMap does not exist yet
	if err != nil {
		t.Fatalf("optional ConfigMap absent: %v; want a warning", err)
	}
	changed := make(chan struct{}, 4)
	crl.Watch(func() { changed <- struct{}{} })
	defer crl.Close()
	publish := func(gen string, serials ...*big.Int) {
		ts := filepath.Join(dir, "..2026_"+gen)
		if err := os.Mkdir(ts, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(ts, "ca-crl.pem"), crlPEM(t, g.root, time.Now().Add(time.Hour), serials...), 0o644); err != nil {
			t.Fatal(err)
		}
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Lstat(path); err != nil {
			if err := os.Symlink("..data/ca-crl.pem", path); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-changed:
		case <-time.After(10 * time.Second):
			t.Fatalf("ConfigMap update %s not picked up in 10s", gen)
		}
	}
	publish("1", big.NewInt(7))
	if info := crl.Info(); len(info) != 1 || info[0].Revoked != 1 {
		t.Fatalf("after the ConfigMap appeared: %+v", info)
	}
	publish("2", big.NewInt(7), big.NewInt(8))
	if info := crl.Info(); len(info) != 1 || info[0].Revoked != 2 {
		t.Fatalf("after the ..data swap: %+v", info)
	}

	// A malformed update is refused: the lists before stay in force, no callback.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
		t.Fatal("a malformed CRL file was taken as a change")
	case <-time.After(5 * time.Second): // two polls
	}
	if info := crl.Info(); len(info) != 1 || info[0].Revoked != 2 {
		t.Fatalf("after a malformed update: %+v; want the list before", info)
	}
	if err := crl.Refused(); err == nil || !strings.Contains(err.Error(), "does not decode") {
		t.Fatalf("Refused after a malformed update: %v", err)
	}
	os.Remove(path) // back to the ConfigMap's symlink
	publish("3", big.NewInt(9))
	if err := crl.Refused(); err != nil {
		t.Fatalf("Refused after a good update: %v", err)
	}
}

// What a CRL reload costs per live connection: a peer no list names (the first look
// answers) against one whose intermediate is listed (its chain is verified, then checked).
func BenchmarkRevoked(b *testing.B) {
	g := &gatedCA{root: catest.NewRoot(b, "root"), ttl: time.Hour}
	now := time.Now()
	inter := g.root.Intermediate(b, "intermediate", now.Add(-time.Hour), now.Add(time.Hour))
	listed := inter.Issue(b, idA, now.Add(-time.Minute), now.Add(time.Hour))
	other := g.root.Issue(b, idA, now.Add(-time.Minute), now.Add(time.Hour))
	path := filepath.Join(b.TempDir(), "ca-crl.pem")
	der, err := x509.CreateRevocationList(rand.Reader, &x509.RevocationList{Number: big.NewInt(1), ThisUpdate: now, NextUpdate: now.Add(time.Hour),
		RevokedCertificateEntries: []x509.RevocationListEntry{{SerialNumber: inter.Cert.SerialNumber, RevocationTime: now}}}, g.root.Cert, g.root.Key)
	if err != nil {
		b.Fatal(err)
	}
	os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der}), 0o644)
	crl, err := certs.OpenCRL(path, nil)
	if err != nil {
		b.Fatal(err)
	}
	m := certs.New(certs.Config{CRL: crl}, g)
	defer m.Close()
	if _, err := m.Certificate(context.Background(), idB); err != nil {
		b.Fatal(err)
	}
	state := func(iss *tls.Certificate) tls.ConnectionState {
		var cs tls.ConnectionState
		for _, d := range iss.Certificate {
			c, _ := x509.ParseCertificate(d)
			cs.PeerCertificates = append(cs.PeerCertificates, c)
		}
		return cs
	}
	for _, bc := range []struct {
		name    string
		cs      tls.ConnectionState
		revoked bool
	}{{"unlisted", state(&other.Certificate), false}, {"listed", state(&listed.Certificate), true}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if err := m.Revoked(bc.cs); (err != nil) != bc.revoked {
					b.Fatal(err)
				}
			}
		})
	}
}

// A peer a list names whose chain does not verify against the roots the manager holds (its
// root rotated away since the handshake) cannot be judged: ErrNotJudged, not a revocation,
// and not silence, so the caller can count it (crl_untracked_connections).
func TestManagerRevokedNotJudged(t *testing.T) {
	leaktest.Check(t)
	g := newGated(t, time.Hour)
	now := time.Now()
	old := catest.NewRoot(t, "old-root") // a root the manager no longer holds
	peer := old.Intermediate(t, "old-intermediate", now.Add(-time.Hour), now.Add(time.Hour)).Issue(t, idA, now.Add(-time.Minute), now.Add(time.Hour))
	var cs tls.ConnectionState
	for _, der := range peer.Certificate.Certificate {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		cs.PeerCertificates = append(cs.PeerCertificates, c)
	}
	path := filepath.Join(t.TempDir(), "ca-crl.pem")
	if err := os.WriteFile(path, crlPEM(t, old, now.Add(time.Hour), cs.PeerCertificates[1].SerialNumber), 0o644); err != nil {
		t.Fatal(err)
	}
	crl, err := certs.OpenCRL(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer crl.Close()
	m := certs.New(certs.Config{CRL: crl}, g)
	defer m.Close()
	if _, err := m.Certificate(context.Background(), idB); err != nil { // the bundle held: g's root only
		t.Fatal(err)
	}
	if err := m.Revoked(cs); !errors.Is(err, certs.ErrNotJudged) {
		t.Fatalf("a listed peer under a root no longer held: %v; want ErrNotJudged", err)
	}
}
