package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/metrics/otlp/otlptest"
)

// TestAccessLogOTLPFromEnvironment runs the ztunnel binary with ACCESS_LOG_OTLP_ENDPOINT
// and the SDK's OTEL_EXPORTER_OTLP_* variables, exporting to the OpenTelemetry Collector's
// own receiver behind TLS and a bearer token: the record arrives only if the certificate
// (OTEL_EXPORTER_OTLP_CERTIFICATE) and the header (OTEL_EXPORTER_OTLP_HEADERS) reached the
// exporter, it is flushed at SIGTERM, it carries the node and pod as its resource, and it
// matches the JSON access log's line field by field, scope included.
func TestAccessLogOTLPFromEnvironment(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile := writeServerCert(t, dir)
	col := otlptest.Start(t, otlptest.Options{Token: "s3cret", CertFile: certFile, KeyFile: keyFile})
	bin := buildZtunnel(t)

	echo := startEcho(t, "127.0.0.2:0") // outside the mesh (examples/localhost.yaml has 127.0.0.1): passthrough
	defer echo.Close()
	p := startProc(t, "ztunnel", []string{
		"PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/local/default",
		"LOCAL_XDS_PATH=../../examples/localhost.yaml", "CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(dir, "ca"),
		"ADMIN_ADDR=127.0.0.1:0", "STATS_ADDR=127.0.0.1:0", "READINESS_ADDR=127.0.0.1:0",
		"OUTBOUND_ADDR=off", "INBOUND_PLAINTEXT_ADDR=off", "INBOUND_ADDR=off", "DNS_PROXY_ADDR=off",
		"UNSTABLE_ENABLE_SOCKS5=true", "SOCKS5_ADDR=127.0.0.1:0", "CONNECTION_TERMINATION_DEADLINE=1s",
		"LOG_FORMAT=json", "NODE_NAME=node-a", "POD_NAME=ztunnel-abcde", "POD_NAMESPACE=istio-system",
		"ACCESS_LOG_OTLP_ENDPOINT=" + col.Endpoint,
		"OTEL_EXPORTER_OTLP_CERTIFICATE=" + certFile,
		"OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20s3cret",
	}, bin)
	p.waitOutput(t, `"msg":"ztunnel started"`, 20*time.Second)
	socks := listenerAddr(t, p.Output(), "socks5")

	c := dialSOCKS(t, socks, echo.Addr().String())
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := c.Read(buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo through the node: %q, %v", buf, err)
	}
	c.Close()
	p.waitOutput(t, `"msg":"connection complete"`, 10*time.Second)
	if err := p.stop(); err != nil { // SIGTERM: the exporter flushes what it queued
		t.Fatalf("ztunnel exited: %v", err)
	}

	var line map[string]any
	for _, l := range strings.Split(p.Output(), "\n") {
		if strings.Contains(l, `"msg":"connection complete"`) {
			if err := json.Unmarshal([]byte(l), &line); err != nil {
				t.Fatalf("JSON access log line %q: %v", l, err)
			}
		}
	}
	recs := col.Records(t, 1)
	if len(recs) != 1 {
		t.Fatalf("collector received %d records; want 1 (the connection): %+v", len(recs), recs)
	}
	rec := recs[0]
	for k, want := range map[string]string{"service.name": "ztunnel", "k8s.node.name": "node-a", "k8s.pod.name": "ztunnel-abcde", "k8s.namespace.name": "istio-system"} {
		if rec.Resource[k] != want {
			t.Errorf("resource %s = %v; want %s (all: %v)", k, rec.Resource[k], want, rec.Resource)
		}
	}
	if rec.Scope != "access" || line["scope"] != "access" {
		t.Errorf("instrumentation scope %q, JSON scope %v; want access", rec.Scope, line["scope"])
	}
	otlptest.CompareWithJSON(t, rec, line)
}

// listenerAddr finds name=addr in the "ztunnel started" line's listeners.
func listenerAddr(t *testing.T, out, name string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if !strings.Contains(l, `"msg":"ztunnel started"`) {
			continue
		}
		var rec struct{ Listeners string }
		if err := json.Unmarshal([]byte(l), &rec); err != nil {
			t.Fatal(err)
		}
		for _, f := range strings.Fields(rec.Listeners) {
			if a, ok := strings.CutPrefix(f, name+"="); ok {
				return a
			}
		}
	}
	t.Fatalf("no %s listener in the start line:\n%s", name, out)
	return ""
}

// writeServerCert writes a self-signed certificate for 127.0.0.1 and its key, PEM.
func writeServerCert(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "otel-collector"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "collector.pem"), filepath.Join(dir, "collector-key.pem")
	for path, block := range map[string]*pem.Block{certFile: {Type: "CERTIFICATE", Bytes: der}, keyFile: {Type: "PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return certFile, keyFile
}
