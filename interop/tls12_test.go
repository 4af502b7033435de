//go:build linux

package interop

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
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
				m := &mesh{a: newHost(t, "ta"), b: newHost(t, "tb"), ca: newCA(t)}
				link(t, m.a, m.b, meshPrefix)
				m.ca.serveIn(t, m.b)
				m.config = writeConfig(t, meshConfig)
				env := m.dedicatedEnv(prog, "node-b", "default/server/server")
				env["TLS12_ENABLED"] = enabled
				startNode(t, prog, m.b, env)
				got[enabled][prog] = dialTLS12(t, m, net.JoinHostPort(serverIP, "15008"))
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

// dialTLS12 handshakes with addr from node A's namespace as the client workload, at most TLS
// 1.2, and says what was negotiated ("refused" when the handshake fails).
func dialTLS12(t *testing.T, m *mesh, addr string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := m.a.dial(ctx, addr)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer raw.Close()
	id, _ := identity.Parse(clientID)
	now := time.Now()
	iss := m.ca.root.Issue(t, id, now.Add(-time.Minute), now.Add(time.Hour))
	c := tls.Client(raw, &tls.Config{
		MaxVersion: tls.VersionTLS12, Certificates: []tls.Certificate{iss.Certificate},
		InsecureSkipVerify: true, NextProtos: []string{"h2"},
	})
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if err := c.Handshake(); err != nil {
		t.Logf("handshake: %v", err)
		return "refused"
	}
	// A read of the server's HTTP/2 SETTINGS, after our preface and empty SETTINGS, shows it
	// kept the connection past its certificate check.
	if _, err := c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")); err != nil {
		return "refused after the handshake"
	}
	if _, err := c.Read(make([]byte, 1)); err != nil {
		t.Logf("read after the handshake: %v", err)
		return "refused after the handshake"
	}
	cs := c.ConnectionState()
	return fmt.Sprintf("%s %s alpn %s", tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite), cs.NegotiatedProtocol)
}
