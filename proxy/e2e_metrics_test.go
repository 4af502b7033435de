package proxy_test

// End-to-end tests of the two loopback nodes (e2e_test.go): what both nodes report for
// one connection.

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

func TestMetricsBothReporters(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	// The backend reads the whole request, then answers three times as many bytes.
	be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
		n, err := io.Copy(io.Discard, c)
		if err != nil {
			return
		}
		_, _ = c.Write(bytes.Repeat([]byte("r"), int(3*n)))
		_ = c.CloseWrite()
	})
	const conns, req = 3, 1000
	for range conns {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write(bytes.Repeat([]byte("q"), req))
		_ = c.CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || len(got) != 3*req {
			t.Fatalf("response: %d bytes, %v; want %d", len(got), err, 3*req)
		}
	}
	common := map[string]string{
		"source_principal":           "spiffe://" + clientPrinc,
		"destination_principal":      "spiffe://" + serverPrinc,
		"source_workload":            "client",
		"destination_workload":       "server",
		"connection_security_policy": "mutual_tls",
		"response_flags":             "-",
	}
	for _, n := range []*node{m.a, m.b} {
		reporter := "source"
		if n == m.b {
			reporter = "destination"
		}
		labels := map[string]string{"reporter": reporter}
		for k, v := range common {
			labels[k] = v
		}
		testutil.Eventually(t, n.name+" closes", func() bool { return counter(t, n.reg, "istio_tcp_connections_closed_total", labels) == conns })
		for name, want := range map[string]float64{
			"istio_tcp_connections_opened_total": conns,
			"istio_tcp_received_bytes_total":     conns * req,     // client to server
			"istio_tcp_sent_bytes_total":         conns * 3 * req, // server to client
			"istio_tcp_connections_failed_total": 0,
		} {
			if got := counter(t, n.reg, name, labels); got != want {
				t.Errorf("%s %s%v = %v, want %v\n%s", n.name, name, labels, got, want, dumpCounters(n.reg))
			}
		}
		// Only its own reporter on each node.
		other := map[string]string{"reporter": map[string]string{"source": "destination", "destination": "source"}[reporter]}
		if got := counter(t, n.reg, "istio_tcp_connections_opened_total", other); got != 0 {
			t.Errorf("%s recorded %v connections as %s", n.name, got, other["reporter"])
		}
		if got := counter(t, n.reg, "istio_tcp_sockets_open", nil); got != 0 {
			t.Errorf("%s: istio_tcp_sockets_open = %v after every connection closed", n.name, got)
		}
	}
}
