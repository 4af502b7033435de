package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// testConfig is a node with every listener on an ephemeral loopback port.
func testConfig(t testing.TB, extra map[string]string) *config {
	t.Helper()
	m := map[string]string{
		"PROXY_MODE": "node", // in-pod mode (the default, shared) needs a node agent
		"ADMIN_ADDR": "127.0.0.1:0", "STATS_ADDR": "127.0.0.1:0", "READINESS_ADDR": "127.0.0.1:0",
		"OUTBOUND_ADDR": "off", "INBOUND_PLAINTEXT_ADDR": "off", "INBOUND_ADDR": "off", "DNS_PROXY_ADDR": "off",
		"CONNECTION_TERMINATION_DEADLINE": "2s",
		"LOCAL_XDS_PATH":                  "../../examples/localhost.yaml",
		"CA_PROVIDER":                     "builtin",
		"CA_DIR":                          t.TempDir(),
	}
	for k, v := range extra {
		m[k] = v
	}
	c, err := loadConfig(env(m), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// startNode runs a node until the test ends and returns it once its listeners are bound.
func startNode(t testing.TB, cfg *config) (*ztunnel, <-chan error) {
	t.Helper()
	n, _, done := startStoppableNode(t, cfg)
	return n, done
}

// startStoppableNode is startNode that also returns a stop function, which makes the node
// drain and exit as SIGTERM does; the channel then yields run's result.
func startStoppableNode(t testing.TB, cfg *config) (*ztunnel, context.CancelFunc, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan *ztunnel, 1)
	done := make(chan error, 1)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		done <- run(ctx, cfg, mustLogLevels(t), func(n *ztunnel) { started <- n })
	}()
	t.Cleanup(func() { cancel(); <-stopped })
	select {
	case n := <-started:
		return n, cancel, done
	case err := <-done:
		t.Fatalf("node did not start: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("node did not start in 20s")
	}
	return nil, nil, nil
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestAdminReadinessStats(t *testing.T) {
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	n, done := startNode(t, testConfig(t, nil))
	admin := "http://" + n.addrs["ADMIN_ADDR"].String()

	if code, body := get(t, admin+"/"); code != 200 || !strings.Contains(body, "/config_dump") {
		t.Errorf("admin index: %d %q", code, body)
	}
	if code, body := get(t, admin+"/config_dump"); code != 200 || !strings.Contains(body, `"version"`) {
		t.Errorf("config_dump: %d %q", code, body)
	}
	if code, _ := get(t, admin+"/logging"); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /logging = %d; want 405", code)
	}
	resp, err := http.Post(admin+"/logging?level=debug", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), "debug") || n.logLevel.def.Level() != slog.LevelDebug {
		t.Errorf("POST /logging?level=debug: %q, level now %v", b, n.logLevel.def.Level())
	}

	ready := "http://" + n.addrs["READINESS_ADDR"].String() + "/healthz/ready"
	if code, body := get(t, ready); code != 200 || body != "ready\n" {
		t.Errorf("ready: %d %q", code, body)
	}
	n.ready.add("state manager")
	if code, body := get(t, ready); code != 500 || !strings.Contains(body, "pending: state manager") {
		t.Errorf("not ready: %d %q", code, body)
	}
	n.ready.done("state manager")

	if code, _ := get(t, "http://"+n.addrs["STATS_ADDR"].String()+"/stats/prometheus"); code != 200 {
		t.Errorf("stats: %d", code)
	}

	resp, err = http.Post(admin+"/quitquitquit", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after quitquitquit: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("node did not stop after /quitquitquit")
	}
}

// TestReadinessNamesCertificateError: a built-in CA whose certificate has expired keeps the
// node unready, and /healthz/ready says so with the error, not only the task's name.
func TestReadinessNamesCertificateError(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	now := time.Now()
	expired := root.Intermediate(t, "expired intermediate", now.Add(-2*time.Hour), now.Add(-time.Minute))
	n, _ := startNode(t, testConfig(t, map[string]string{
		"CA_DIR": expired.WriteCACerts(t), "INBOUND_ADDR": "127.0.0.1:0",
		"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/local/default",
	}))
	want := "certificates: certs: spiffe://cluster.local/ns/default/sa/default"
	code, body := waitReady(t, n, want)
	if code != 500 || !strings.Contains(body, "pending: certificates\n") || !strings.Contains(body, want) ||
		!strings.Contains(body, "CA chain expired at "+expired.Cert.NotAfter.UTC().Format(time.RFC3339)) {
		t.Fatalf("readiness with an expired CA: %d %q; want 500 with the certificate's error", code, body)
	}
}

// TestDrainServesHTTPUntilProxiesDrain: the drain is run's cleanup stack, last first. While
// the node's proxy drains a live connection, its stats server still answers (its cleanup
// sits below the proxy's); once the connection ends the drain goes on at once, not at
// CONNECTION_TERMINATION_DEADLINE, and run returns with the HTTP servers closed.
func TestDrainServesHTTPUntilProxiesDrain(t *testing.T) {
	leaktest.Check(t)
	http.DefaultClient.Transport = &http.Transport{DisableKeepAlives: true}
	echo := startEcho(t, "127.0.0.9:0") // outside the mesh: passthrough
	defer echo.Close()
	n, stop, done := startStoppableNode(t, testConfig(t, map[string]string{
		"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/local/default",
		"UNSTABLE_ENABLE_SOCKS5": "true", "SOCKS5_ADDR": "127.0.0.1:0",
		"CONNECTION_TERMINATION_DEADLINE": "1m",
	}))
	live := dialVia(t, n, echo.Addr().String())
	defer live.Close()
	echoes(t, live, "before the drain")

	stop()
	socks := n.addrs["SOCKS5_ADDR"].String()
	testutil.Eventually(t, "the SOCKS5 listener to close as the drain begins", func() bool {
		c, err := net.Dial("tcp", socks)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	stats := "http://" + n.addrs["STATS_ADDR"].String() + "/stats/prometheus"
	if code, _ := get(t, stats); code != 200 {
		t.Errorf("stats during the drain: %d; want 200 while the proxy drains", code)
	}
	echoes(t, live, "during the drain")
	select {
	case err := <-done:
		t.Fatalf("run returned (%v) with a connection still live, long before the drain deadline", err)
	default:
	}

	live.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("run did not return once the last connection had ended")
	}
	if resp, err := http.Get(stats); err == nil {
		resp.Body.Close()
		t.Error("the stats server still answers after run returned")
	}
}
