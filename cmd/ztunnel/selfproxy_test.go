//go:build linux

package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// The self-proxy topology: ztunnel's pod and a meshed Prometheus's pod, joined by a veth
// pair.
const (
	selfZtunnelIP = "10.33.0.2" // istio-system/ztunnel-abcde, sa ztunnel, on node-a
	selfPromIP    = "10.33.0.1" // monitoring/prometheus, sa prometheus, on node-b
)

// selfWorkloads is the local config of the self-proxy test: ztunnel's own workload, the
// Prometheus pod, and a policy denying ztunnel's readiness port to anyone.
const selfWorkloads = `
workloads:
  - uid: Kubernetes//v1/Pod/istio-system/ztunnel-abcde
    name: ztunnel-abcde
    namespace: istio-system
    serviceAccount: ztunnel
    workloadIps: ["` + selfZtunnelIP + `"]
    node: node-a
    services: {}
  - uid: Kubernetes//v1/Pod/monitoring/prometheus
    name: prometheus
    namespace: monitoring
    serviceAccount: prometheus
    workloadIps: ["` + selfPromIP + `"]
    protocol: HBONE
    node: node-b
    services: {}
policies:
  - name: deny-readiness
    namespace: istio-system
    scope: Namespace
    action: Deny
    rules:
      - - - destinationPorts: [15021]
`

// TestNetnsSelfProxy: the built ztunnel, in-pod mode in a network namespace of its own with
// POD_NAME, POD_NAMESPACE and SERVICE_ACCOUNT set as the chart sets them, serves HBONE on
// its own 15008 as its own workload. A meshed client in another namespace (an HBONE pool
// with a workload certificate of the same trust domain) fetches /stats/prometheus through
// it, with the peer checked to be ztunnel's identity; the targets the Rust ztunnel refuses
// (its capture ports: 503; an address that is not the one dialed: 400) are refused, and
// ztunnel's authorization policies apply (401).
func TestNetnsSelfProxy(t *testing.T) {
	netnstest.Require(t, "curl")
	bin := buildZtunnel(t)
	ztNS, promNS := netnstest.New(t, "self-zt"), netnstest.New(t, "self-prom")
	netnstest.Link(t, promNS, selfPromIP+"/24", ztNS, selfZtunnelIP+"/24")
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "workloads.yaml"), []byte(selfWorkloads), 0o644); err != nil {
		t.Fatal(err)
	}
	// The CA both sides share: created here, read by ztunnel at start.
	builtin, err := ca.NewBuiltin(filepath.Join(dir, "ca"), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	zt := startProc(t, "ztunnel in "+ztNS.Name, []string{
		"PROXY_MODE=shared", "NODE_NAME=node-a", "INPOD_UDS=" + agent.Path,
		"LOCAL_XDS_PATH=" + filepath.Join(dir, "workloads.yaml"),
		"CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(dir, "ca"),
		"POD_NAME=ztunnel-abcde", "POD_NAMESPACE=istio-system", "SERVICE_ACCOUNT=ztunnel",
		"CONNECTION_TERMINATION_DEADLINE=1s",
	}, "ip", "netns", "exec", ztNS.Name, bin)
	if nack := agent.Accept().Send(inpodtest.SnapshotReq()); nack != "" {
		t.Fatalf("snapshot: NACK %q", nack)
	}
	zt.waitUntil(t, "ready", 20*time.Second, func() error {
		out, err := ztNS.Exec("curl", "-fsS", "-m", "1", "http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			return errors.New(string(out))
		}
		return nil
	})

	promID := identity.MustParse("spiffe://cluster.local/ns/monitoring/sa/prometheus")
	ztID := identity.MustParse("spiffe://cluster.local/ns/istio-system/sa/ztunnel")
	mgr := certs.New(certs.Config{}, builtin)
	defer mgr.Close()
	promHandle, err := netns.Open("/var/run/netns/" + promNS.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer promHandle.Close()
	pool := hbone.NewPool(hbone.ClientConfig{Dial: netns.Sockets{NS: promHandle}.Dial}, func(ctx context.Context, k hbone.Key) (*tls.Config, error) {
		return mgr.ClientConfig(ctx, k.Src, k.Expected())
	})
	defer pool.Close()
	key := hbone.NewKey(promID, []identity.ID{ztID}, netip.MustParseAddrPort(selfZtunnelIP+":15008"), netip.Addr{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	t.Run("stats over HBONE", func(t *testing.T) {
		s, err := pool.Dial(ctx, key, selfZtunnelIP+":15020", nil)
		if err != nil {
			t.Fatalf("CONNECT %s:15020 through the self-proxy: %v\n%s", selfZtunnelIP, err, zt.Output())
		}
		defer s.Close()
		fmt.Fprintf(s, "GET /stats/prometheus HTTP/1.1\r\nHost: %s:15020\r\nConnection: close\r\n\r\n", selfZtunnelIP)
		resp, err := http.ReadResponse(bufio.NewReader(s), nil)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || !strings.Contains(string(body), "# TYPE istio_build gauge") {
			t.Fatalf("GET /stats/prometheus over HBONE: %d %v %.300s", resp.StatusCode, err, body)
		}
		// ztunnel recorded it as the destination, ztunnel's workload, named by its certificate.
		waitMetric(t, ztNS, "ztunnel", "istio_tcp_connections_opened_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls",
			"source_principal": promID.String(), "destination_principal": ztID.String(), "destination_workload": "ztunnel-abcde",
		}, 1)
	})

	for _, tc := range []struct {
		name, target string
		code         int
	}{
		{"ztunnel's own HBONE port", selfZtunnelIP + ":15008", http.StatusServiceUnavailable},
		{"ztunnel's outbound capture port", selfZtunnelIP + ":15001", http.StatusServiceUnavailable},
		{"ztunnel's inbound capture port", selfZtunnelIP + ":15006", http.StatusServiceUnavailable},
		{"another address than ztunnel's", selfPromIP + ":15020", http.StatusBadRequest},
		{"a port its policy denies", selfZtunnelIP + ":15021", http.StatusUnauthorized},
	} {
		t.Run("refused: "+tc.name, func(t *testing.T) {
			s, err := pool.Dial(ctx, key, tc.target, nil)
			if err == nil {
				s.Close()
			}
			var se *hbone.StatusError
			if !errors.As(err, &se) || se.Code != tc.code {
				t.Errorf("CONNECT %s: %v; want %d", tc.target, err, tc.code)
			}
		})
	}
}
