package proxy_test

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/logtest"
	"github.com/gozt/gozt/internal/testutil"
)

// TestInboundHandshakeFailures: failed TLS handshakes on 15008 are counted by reason; a
// client without a certificate and one that does not speak TLS each get a WARN naming the
// peer and the reason, once per reason however often it retries within the interval; a
// client that connects and leaves is counted but not warned about.
func TestInboundHandshakeFailures(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t)
	var rec logtest.Recorder
	cfg := m.serverConfig()
	cfg.Logger = rec.Logger()
	cfg.HandshakeFailure = certs.HandshakeFailure
	b := startNode(t, "node-b", m.caDir, m.yaml, cfg)
	addr := m.serverIP + ":15008"

	noCert := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13}
	for range 3 {
		c, err := tls.Dial("tcp", addr, noCert)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || !strings.Contains(err.Error(), "certificate required") {
			t.Errorf("client without a certificate read %v; want the server's certificate_required alert", err)
		}
		c.Close()
	}
	junk, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	junk.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	junk.SetDeadline(time.Now().Add(10 * time.Second))
	junk.Read(make([]byte, 64)) // the server's alert or its close
	junk.Close()
	gone, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	gone.Close()

	want := map[string]float64{certs.FailNoClientCert: 3, certs.FailProtocol: 1, certs.FailPeerClosed: 1}
	testutil.EventuallyNil(t, func() error {
		for reason, n := range want {
			if got := counter(t, b.reg, "hbone_tls_handshake_failures_total", map[string]string{"reason": reason}); got != n {
				return fmt.Errorf("hbone_tls_handshake_failures_total{reason=%q} = %v; want %v", reason, got, n)
			}
		}
		return nil
	})
	var lines []string
	for _, l := range rec.Lines(slog.LevelWarn) {
		if strings.Contains(l, "handshake failed") {
			lines = append(lines, l)
		}
	}
	if len(lines) != 2 {
		t.Fatalf("WARN lines %q; want one per reason: no_client_certificate, protocol", lines)
	}
	for i, reason := range []string{certs.FailNoClientCert, certs.FailProtocol} {
		if !strings.Contains(lines[i], "reason="+reason) || !strings.Contains(lines[i], "peer=127.") {
			t.Errorf("line %q; want the peer's address and reason=%s", lines[i], reason)
		}
	}
}
