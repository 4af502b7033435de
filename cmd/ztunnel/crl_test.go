package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/proxy"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/leaktest"
)

// A rewritten CRL_PATH closes the live HBONE connections whose peer it now revokes, on the
// side that judges that peer, and leaves the others carrying bytes. Three dedicated nodes,
// each with its certificates from its own intermediate under one root: clients A and C
// call server B. The root's list first revokes A's intermediate: B closes A's inbound
// connection (reporter destination) and C's goes on. Then it revokes B's intermediate too:
// C closes its pooled outbound connection to B (reporter source).
func TestCRLClosesRevokedConnections(t *testing.T) {
	leaktest.Check(t)
	sub := ""
	for _, s := range []string{"127.0.41.", "127.0.42.", "127.0.43."} {
		if free(s+"3", "15008", "8080") {
			sub = s
			break
		}
	}
	if sub == "" {
		t.Skip("no loopback subnet with 15008 and 8080 free on .3")
	}
	dir := t.TempDir()
	yaml := strings.NewReplacer("127.0.0.2", sub+"2", "127.0.0.3", sub+"3").Replace(mustRead(t, "../../examples/two-nodes.yaml"))
	yaml = strings.Replace(yaml, "workloads:\n", `workloads:
  - uid: Kubernetes//v1/Pod/default/other
    name: other
    namespace: default
    serviceAccount: other
    workloadIps: ["`+sub+`5"]
    protocol: HBONE
    node: node-c
    services: {}
`, 1)
	xdsPath := filepath.Join(dir, "mesh.yaml")
	crlPath := filepath.Join(dir, "ca-crl.pem")
	for p, data := range map[string]string{xdsPath: yaml, crlPath: ""} {
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	root := catest.NewRoot(t, "root")
	inter := map[string]*catest.Root{}
	for _, name := range []string{"a", "b", "c"} {
		inter[name] = root.Intermediate(t, "intermediate-"+name, now.Add(-time.Hour), now.Add(24*time.Hour))
	}
	start := func(name, workload, extra string) *ztunnel {
		m := map[string]string{
			"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": workload, "LOCAL_XDS_PATH": xdsPath,
			"CA_DIR": inter[name].WriteCACerts(t), "CRL_PATH": crlPath,
		}
		if extra != "" {
			m["UNSTABLE_ENABLE_SOCKS5"], m["SOCKS5_ADDR"] = "true", extra
		} else {
			m["INBOUND_ADDR"] = sub + "3:15008"
		}
		n, _ := startNode(t, testConfig(t, m))
		return n
	}
	echo := startEcho(t, sub+"3:8080")
	defer echo.Close()
	b := start("b", "default/server/server", "")
	a := start("a", "default/client/client", "127.0.0.1:0")
	c := start("c", "default/other/other", "127.0.0.1:0")
	connA, connC := dialVia(t, a, sub+"3:8080"), dialVia(t, c, sub+"3:8080")
	defer connA.Close()
	defer connC.Close()
	echoes(t, connA, "A before")
	echoes(t, connC, "C before")

	writeCRL(t, crlPath, root, inter["a"].Cert.SerialNumber)
	waitClosed(t, connA, "A's connection, its intermediate revoked")
	echoes(t, connC, "C beside the revoked A")
	for deadline := time.Now().Add(crlCloseBound); ; time.Sleep(100 * time.Millisecond) { // B judged A under it: signature verified
		lists := b.configDump()["crl"].(map[string]any)["lists"].([]certs.CRLInfo)
		if len(lists) == 1 && lists[0].Issuer == "CN=root" && lists[0].Revoked == 1 && lists[0].Signature == "verified" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node B's /config_dump crl: %+v; want root's list, 1 revoked, signature verified", lists)
		}
	}
	if got := metricValue(t, b, "crl_revoked_certificates", "issuer", "CN=root"); got != 1 {
		t.Errorf("node B: crl_revoked_certificates{issuer=CN=root} = %v, want 1", got)
	}
	if got := metricValue(t, b, "crl_next_update_timestamp_seconds", "issuer", "CN=root"); got < float64(time.Now().Unix()) {
		t.Errorf("node B: crl_next_update_timestamp_seconds{issuer=CN=root} = %v, want the list's nextUpdate, an hour ahead", got)
	}
	if got := crlRejections(t, b, "destination"); got != 1 {
		t.Errorf("node B: istio_crl_policy_rejections_total{reporter=destination} = %v, want 1", got)
	}

	writeCRL(t, crlPath, root, inter["a"].Cert.SerialNumber, inter["b"].Cert.SerialNumber)
	waitClosed(t, connC, "C's connection, its server's intermediate revoked")
	if got := crlRejections(t, c, "source"); got != 1 {
		t.Errorf("node C: istio_crl_policy_rejections_total{reporter=source} = %v, want 1", got)
	}
}

// writeCRL replaces path with a list signed by ca revoking serials, as a ConfigMap update does.
func writeCRL(t *testing.T, path string, ca *catest.Root, serials ...*big.Int) {
	t.Helper()
	tmpl := &x509.RevocationList{Number: big.NewInt(time.Now().UnixNano()), ThisUpdate: time.Now().Add(-time.Minute), NextUpdate: time.Now().Add(time.Hour)}
	for _, s := range serials {
		tmpl.RevokedCertificateEntries = append(tmpl.RevokedCertificateEntries, x509.RevocationListEntry{SerialNumber: s, RevocationTime: time.Now()})
	}
	der, err := x509.CreateRevocationList(rand.Reader, tmpl, ca.Cert, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".new"
	if err := os.WriteFile(tmp, pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// crlCloseBound is how long after the rewrite a revoked peer's connection may live: the
// file is polled every 2 s.
const crlCloseBound = 6 * time.Second

func waitClosed(t *testing.T, c net.Conn, what string) {
	t.Helper()
	start := time.Now()
	c.SetReadDeadline(start.Add(crlCloseBound))
	n, err := c.Read(make([]byte, 1))
	if n != 0 || err == nil || isTimeout(err) {
		t.Fatalf("%s: still open %v after the CRL was rewritten (read %d, %v)", what, crlCloseBound, n, err)
	}
	t.Logf("%s: closed %v after the rewrite", what, time.Since(start).Round(time.Millisecond))
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

func echoes(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("%s: write: %v", msg, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("%s: echo %q, %v", msg, buf, err)
	}
	c.SetDeadline(time.Time{})
}

func dialVia(t *testing.T, n *ztunnel, dst string) net.Conn {
	t.Helper()
	return dialSOCKS(t, n.addrs["SOCKS5_ADDR"].String(), dst)
}

// dialSOCKS connects to dst through the SOCKS5 listener at socks.
func dialSOCKS(t *testing.T, socks, dst string) net.Conn {
	t.Helper()
	d, err := proxy.SOCKS5("tcp", socks, nil, &net.Dialer{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c, err := d.(proxy.ContextDialer).DialContext(context.Background(), "tcp", dst)
	if err != nil {
		t.Fatalf("SOCKS5 to %s: %v", dst, err)
	}
	return c
}

func crlRejections(t *testing.T, n *ztunnel, reporter string) float64 {
	t.Helper()
	return metricValue(t, n, "istio_crl_policy_rejections_total", "reporter", reporter)
}

// metricValue is the value of the series of family name whose label is value (0 if none).
func metricValue(t *testing.T, n *ztunnel, name, label, value string) float64 {
	t.Helper()
	mfs, err := n.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue() + m.GetGauge().GetValue()
				}
			}
		}
	}
	return 0
}

func free(ip string, ports ...string) bool {
	for _, p := range ports {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, p))
		if err != nil {
			return false
		}
		ln.Close()
	}
	return true
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// startEcho serves an echo on addr until closed.
func startEcho(t *testing.T, addr string) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln
}

// A connection whose peer a reloaded list names but whose chain no longer verifies against
// the roots the node holds (they rotated since its handshake) is kept open and counted in
// istio_crl_untracked_connections_total, the Rust ztunnel's crl_untracked_connections.
func TestCRLUntrackedConnections(t *testing.T) {
	dir := t.TempDir()
	n := newZtunnel(testConfig(t, nil), mustLogLevels(t))
	builtin, err := ca.NewBuiltin(filepath.Join(dir, "ca"), time.Hour) // the roots held now
	if err != nil {
		t.Fatal(err)
	}
	old := catest.NewRoot(t, "old-root") // the peer's, rotated away
	inter := old.Intermediate(t, "old-intermediate", time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	peer := inter.Issue(t, identity.MustParse("spiffe://cluster.local/ns/default/sa/client"), time.Now().Add(-time.Minute), time.Now().Add(time.Hour))
	crlPath := filepath.Join(dir, "ca-crl.pem")
	writeCRL(t, crlPath, old, inter.Cert.SerialNumber)
	crl, err := certs.OpenCRL(crlPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer crl.Close()
	n.certs = certs.New(certs.Config{CRL: crl}, builtin)
	defer n.certs.Close()
	if _, err := n.certs.Certificate(context.Background(), identity.MustParse("spiffe://cluster.local/ns/default/sa/server")); err != nil {
		t.Fatal(err)
	}
	var cs tls.ConnectionState
	for _, der := range peer.Certificate.Certificate {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		cs.PeerCertificates = append(cs.PeerCertificates, c)
	}
	if err := n.revokedPeer(true, cs); err != nil {
		t.Errorf("a connection that cannot be judged was closed: %v", err)
	}
	if got := metricValue(t, n, "istio_crl_untracked_connections_total", "reporter", "destination"); got != 1 {
		t.Errorf("istio_crl_untracked_connections_total{reporter=destination} = %v; want 1", got)
	}
	if got := crlRejections(t, n, "destination"); got != 0 {
		t.Errorf("istio_crl_policy_rejections_total{reporter=destination} = %v; want 0", got)
	}
}
