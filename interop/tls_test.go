//go:build linux

package interop

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
)

// TestTLS12 dials each program's 15008 with a peer limited to TLS 1.2 (a FIPS proxy's
// stance), with and without TLS12_ENABLED=true, and compares what each negotiates: both
// refuse it by default, both take it with an ECDHE AES-GCM suite when enabled.
func TestTLS12(t *testing.T) {
	requirePeers(t)
	got := map[string]map[string]string{} // setting -> program -> outcome
	for _, enabled := range []string{"false", "true"} {
		got[enabled] = map[string]string{}
		for _, prog := range []string{gozt, rs} {
			t.Run(prog+"/TLS12_ENABLED="+enabled, func(t *testing.T) {
				m := newHosts(t)
				env := m.dedicatedEnv(prog, "node-b", "default/server/server")
				env["TLS12_ENABLED"] = enabled
				startNode(t, prog, m.b, env)
				got[enabled][prog] = dialTLS(t, m, net.JoinHostPort(serverIP, "15008"), tls.VersionTLS12, m.clientCert(t))
			})
		}
	}
	if t.Failed() {
		return
	}
	for enabled, byProg := range got {
		t.Logf("TLS12_ENABLED=%s: gozt %s; rs %s", enabled, byProg[gozt], byProg[rs])
		if byProg[gozt] != byProg[rs] {
			t.Errorf("TLS12_ENABLED=%s: gozt %s, rs %s; want the same", enabled, byProg[gozt], byProg[rs])
		}
	}
	if got["false"][gozt] != "refused" || got["true"][gozt] == "refused" {
		t.Errorf("gozt: %v; want refused without TLS12_ENABLED and TLS 1.2 with it", got)
	}
}

// clientCert is a certificate for the client workload from the mesh's CA, issued by the test
// (so that its serial is known).
func (m *mesh) clientCert(t *testing.T) tls.Certificate {
	id, _ := identity.Parse(clientID)
	now := time.Now()
	return m.ca.root.Issue(t, id, now.Add(-time.Minute), now.Add(time.Hour)).Certificate
}

// dialTLS handshakes with addr from node A's namespace presenting cert, at most TLS version
// maxVersion, and says what was negotiated ("refused" when the handshake fails).
func dialTLS(t *testing.T, m *mesh, addr string, maxVersion uint16, cert tls.Certificate) string {
	return dialTLSConfig(t, m, addr, &tls.Config{
		MaxVersion: maxVersion, Certificates: []tls.Certificate{cert},
		InsecureSkipVerify: true, NextProtos: []string{"h2"},
	})
}

// dialTLSConfig is dialTLS with the client's whole config.
func dialTLSConfig(t *testing.T, m *mesh, addr string, cfg *tls.Config) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := m.a.dial(ctx, addr)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer raw.Close()
	c := tls.Client(raw, cfg)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.Handshake(); err != nil {
		t.Logf("handshake: %v", err)
		return "refused"
	}

	// A read of the server's HTTP/2 SETTINGS, after our preface and empty SETTINGS, shows it
	// kept the connection past its certificate check (in TLS 1.3 the server judges the
	// client's certificate after the client's side of the handshake is done).
	if _, err := c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")); err != nil {
		return "refused after the handshake"
	}
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Logf("read after the handshake: %v", err)
		return "refused after the handshake"
	}
	cs := c.ConnectionState()
	return fmt.Sprintf("%s %s %s alpn %s", tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite), cs.CurveID, cs.NegotiatedProtocol)
}

// TestFIPSOffer dials the Rust ztunnel's 15008 with what a FIPS gozt offers (X25519MLKEM768,
// P-256, P-384 and TLS 1.3's AES-GCM suites: crypto/tls in FIPS 140-3 mode offers nothing
// else) and with what a FIPS gozt without ML-KEM would, and says what the Rust ztunnel
// picks: an approved group, both times. TestFlows runs the FIPS gozt itself beside it.
func TestFIPSOffer(t *testing.T) {
	requirePeers(t)
	m := newHosts(t)
	startNode(t, rs, m.b, m.dedicatedEnv(rs, "node-b", "default/server/server"))
	for _, curves := range [][]tls.CurveID{{tls.X25519MLKEM768, tls.CurveP256, tls.CurveP384}, {tls.CurveP256, tls.CurveP384}} {
		got := dialTLSConfig(t, m, net.JoinHostPort(serverIP, "15008"), &tls.Config{
			MinVersion: tls.VersionTLS13, CurvePreferences: curves, Certificates: []tls.Certificate{m.clientCert(t)},
			InsecureSkipVerify: true, NextProtos: []string{"h2"},
		})
		t.Logf("offering %v: the Rust ztunnel negotiates %s", curves, got)
		if !strings.Contains(got, " "+curves[0].String()+" ") {
			t.Errorf("offering %v: %s; want %v", curves, got, curves[0])
		}
	}
}

// TestCRL gives each program as node B a CRL_PATH that revokes one client certificate of the
// mesh's CA and dials its 15008 with that certificate and with another: both programs refuse
// the revoked one and accept the other.
func TestCRL(t *testing.T) {
	requirePeers(t)
	got := map[string]map[string]string{} // certificate -> program -> outcome
	for _, prog := range []string{gozt, rs} {
		t.Run(prog, func(t *testing.T) {
			m := newHosts(t)
			revoked, other := m.clientCert(t), m.clientCert(t)
			crl := filepath.Join(t.TempDir(), "ca-crl.pem")
			if err := os.WriteFile(crl, m.ca.root.CRL(t, revoked.Leaf.SerialNumber), 0o644); err != nil {
				t.Fatal(err)
			}
			env := m.dedicatedEnv(prog, "node-b", "default/server/server")
			env["CRL_PATH"] = crl
			startNode(t, prog, m.b, env)
			for name, cert := range map[string]tls.Certificate{"revoked": revoked, "other": other} {
				if got[name] == nil {
					got[name] = map[string]string{}
				}
				got[name][prog] = dialTLS(t, m, net.JoinHostPort(serverIP, "15008"), tls.VersionTLS13, cert)
			}
		})
	}
	if t.Failed() {
		return
	}
	for name, byProg := range got {
		t.Logf("%s certificate: gozt %s; rs %s", name, byProg[gozt], byProg[rs])
	}
	for _, prog := range []string{gozt, rs} {
		if !strings.HasPrefix(got["revoked"][prog], "refused") || strings.HasPrefix(got["other"][prog], "refused") {
			t.Errorf("%s: revoked %q, other %q; want the revoked refused and the other accepted", prog, got["revoked"][prog], got["other"][prog])
		}
	}
}
