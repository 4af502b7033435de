package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	mdns "github.com/miekg/dns"
	"golang.org/x/net/proxy"

	"github.com/gozt/gozt/internal/leaktest"
)

// defaultsYAML: the node's workload (IPv4 only), a dual-stack service, and a service whose
// one endpoint istiod calls unhealthy (not ready, or terminating), plain TCP on 127.0.0.7.
const defaultsYAML = `
workloads:
  - uid: Kubernetes//v1/Pod/default/local
    name: local
    namespace: default
    serviceAccount: default
    trustDomain: cluster.local
    workloadIps: ["127.0.0.1"]
    protocol: HBONE
    services: {}
  - uid: Kubernetes//v1/Pod/default/sick
    name: sick
    namespace: default
    serviceAccount: sick
    trustDomain: cluster.local
    workloadIps: ["127.0.0.7"]
    protocol: TCP
    status: Unhealthy
    services:
      "default/sick.default.svc.cluster.local":
        80: 8080
services:
  - name: dual
    namespace: default
    hostname: dual.default.svc.cluster.local
    vips: ["/127.10.0.2", "/fd00:10::2"]
    ports:
      80: 8080
  - name: sick
    namespace: default
    hostname: sick.default.svc.cluster.local
    vips: ["/127.10.0.3"]
    ports:
      80: 8080
`

// TestDefaultsAnswerAsRust: with no gozt-only variable set but the listeners' addresses and
// the CA, the node answers as the Rust ztunnel does in the rows of docs/CONFIGURATION.md's
// differences that one node can show: a service whose only endpoint is unhealthy gets no
// connection (although the endpoint accepts), and an IPv4-only workload asking AAAA for a
// dual-stack service gets the service's IPv6 address.
func TestDefaultsAnswerAsRust(t *testing.T) {
	leaktest.Check(t)
	dir := t.TempDir()
	xdsPath := filepath.Join(dir, "workloads.yaml")
	if err := os.WriteFile(xdsPath, []byte(defaultsYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	m := map[string]string{
		"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/local/default", "LOCAL_XDS_PATH": xdsPath,
		"UNSTABLE_ENABLE_SOCKS5": "true", "CONNECTION_TERMINATION_DEADLINE": "1s",
		// gozt-only, but where to listen and whose certificates, not how to answer:
		"CA_PROVIDER": "builtin", "CA_DIR": filepath.Join(dir, "ca"),
		"ADMIN_ADDR": "127.0.0.1:0", "STATS_ADDR": "127.0.0.1:0", "READINESS_ADDR": "127.0.0.1:0",
		"OUTBOUND_ADDR": "off", "INBOUND_PLAINTEXT_ADDR": "off", "INBOUND_ADDR": "127.0.0.1:0",
		"SOCKS5_ADDR": "127.0.0.1:0", "DNS_PROXY_ADDR": "127.0.0.1:0",
	}
	for _, s := range allSettings() {
		if _, set := m[s.env]; set && s.goztOnly && !strings.HasSuffix(s.env, "_ADDR") && !slices.Contains([]string{"CA_PROVIDER", "CA_DIR"}, s.env) {
			t.Fatalf("the test sets the gozt-only %s", s.env)
		}
	}
	cfg, err := loadConfig(env(m), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	backend := startEcho(t, "127.0.0.7:8080") // the unhealthy endpoint, which would answer
	defer backend.Close()
	n, _ := startNode(t, cfg)

	t.Run("unhealthy endpoints", func(t *testing.T) {
		d, err := proxy.SOCKS5("tcp", n.addrs["SOCKS5_ADDR"].String(), nil, &net.Dialer{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		c, err := d.(proxy.ContextDialer).DialContext(context.Background(), "tcp", "127.10.0.3:80")
		if err == nil {
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			_, werr := c.Write([]byte("x"))
			buf := make([]byte, 1)
			_, rerr := c.Read(buf)
			t.Fatalf("SOCKS5 to sick's VIP: connected (write %v, read %q %v); want refused: its only endpoint is unhealthy", werr, buf, rerr)
		}
		t.Logf("refused: %v", err)
	})

	t.Run("AAAA for an IPv4-only workload", func(t *testing.T) {
		q := new(mdns.Msg)
		q.SetQuestion("dual.default.svc.cluster.local.", mdns.TypeAAAA)
		resp, _, err := new(mdns.Client).Exchange(q, n.addrs["DNS_PROXY_ADDR"].String())
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Answer) != 1 {
			t.Fatalf("AAAA dual: %d answers; want the service's IPv6 VIP: %v", len(resp.Answer), resp)
		}
		if a, ok := resp.Answer[0].(*mdns.AAAA); !ok || a.AAAA.String() != "fd00:10::2" {
			t.Fatalf("AAAA dual: %v; want fd00:10::2", resp.Answer[0])
		}
	})
}
