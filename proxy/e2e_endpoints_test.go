package proxy_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/proxy/outlier"
	"github.com/gozt/gozt/xds/state"
)

// echoEndpointYAML is one more endpoint of the example's echo service: workload name on ip.
func echoEndpointYAML(name, ip string) string {
	return fmt.Sprintf(`
  - uid: Kubernetes//v1/Pod/default/%[1]s
    name: %[1]s
    namespace: default
    serviceAccount: server
    workloadIps: [%[2]q]
    protocol: HBONE
    node: node-%[1]s
    services:
      "default/echo.default.svc.cluster.local":
        80: 8080
`, name, ip)
}

// withEndpoints is the example topology with more echo endpoints, inserted before its
// services.
func withEndpoints(yaml string, endpoints ...string) string {
	i := strings.Index(yaml, "\nservices:")
	return yaml[:i] + strings.Join(endpoints, "") + yaml[i:]
}

// dedicatedServer is the config of a node serving workload name (service account server)
// on ip:15008.
func dedicatedServer(name, ip string) proxy.Config {
	return proxy.Config{
		Local:       state.Local{Mode: state.ModeDedicated, Workload: state.WorkloadRef{Namespace: "default", Name: name, ServiceAccount: "server"}},
		InboundAddr: ip + ":15008",
	}
}

// echoOnce connects through node A's SOCKS5 to the echo service and round-trips a line.
func echoOnce(socks string) error {
	c, code, err := socksConnect(socks, "echo.default.svc.cluster.local", 80)
	if err != nil {
		return err
	}
	defer c.Close()
	if code != 0 {
		return fmt.Errorf("socks reply %d", code)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := c.Read(buf); err != nil || string(buf) != "ping\n" {
		return fmt.Errorf("echo: %q, %v", buf, err)
	}
	return nil
}

// TestEndpointRetryAndEjection: the echo service has three endpoints, one healthy (node B),
// one whose node refuses HBONE (it resets every connection), one whose node answers 503
// (its backend is gone). Every one of 1,000 connections succeeds, each failed attempt is
// a counted retry, both bad endpoints are ejected and shown in the detector's dump.
func TestEndpointRetryAndEjection(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t, "8080")
	sub := strings.TrimSuffix(m.serverIP, "3")
	refusingIP, goneIP := sub+"5", sub+"6"
	if !free(refusingIP, []string{"15008"}) || !free(goneIP, []string{"15008", "8080"}) {
		t.Skipf("needs %s:15008 and %s:15008, :8080 free", refusingIP, goneIP)
	}
	m.yaml = withEndpoints(m.yaml, echoEndpointYAML("refusing", refusingIP), echoEndpointYAML("gone", goneIP))
	startBackend(t, m.serverIP+":8080", echo)

	// The refusing node accepts and resets: TLS fails at once. It counts what it refused.
	ln, err := net.Listen("tcp", refusingIP+":15008")
	if err != nil {
		t.Fatal(err)
	}
	var refused atomic.Int64
	var refuser sync.WaitGroup
	refuser.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			refused.Add(1)
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}
	})
	defer func() { ln.Close(); refuser.Wait() }()

	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	gone := startNode(t, "node-gone", m.caDir, m.yaml, dedicatedServer("gone", goneIP))
	outliers := outlier.New(outlier.Config{Base: time.Minute}) // no ejection ends during the test
	cfg := m.clientConfig()
	cfg.ConnectRetries, cfg.Outliers = 2, outliers
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)

	// Three clients at a time: the retry budget's floor (outlier.MinRetries), so every
	// failed first attempt has its retry. More at once, and a burst of failures past the
	// floor is refused a retry, as it should be.
	const conns, workers = 1000, outlier.MinRetries
	var failed atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < conns; i += workers {
				if err := echoOnce(m.a.socks(t)); err != nil {
					if failed.Add(1) <= 3 {
						t.Errorf("connection %d: %v", i, err)
					}
				}
			}
		})
	}
	wg.Wait()
	if n := failed.Load(); n != 0 {
		t.Fatalf("%d of %d connections failed", n, conns)
	}

	echoSvc := map[string]string{"destination_service": "echo.default.svc.cluster.local"}
	answered503 := func() float64 {
		return counter(t, gone.reg, "istio_tcp_connections_failed_total", nil)
	}
	retries := counter(t, m.a.reg, "outbound_connect_retries_total", echoSvc)
	testutil.Eventually(t, "every failed attempt seen by its endpoint", func() bool {
		return float64(refused.Load())+answered503() == retries
	})
	if retries < 2*outlier.DefaultFailures {
		t.Errorf("%v retries; want at least %d (each bad endpoint failed until ejected)", retries, 2*outlier.DefaultFailures)
	}
	if got := counter(t, m.a.reg, "outbound_endpoint_ejections_total", echoSvc); got != 2 {
		t.Errorf("%v ejections; want 2", got)
	}
	dump := outliers.Dump()
	if len(dump) != 2 || dump[0].Workload != "default/gone" || dump[1].Workload != "default/refusing" ||
		dump[0].Service != "default/echo.default.svc.cluster.local" || !dump[0].Until.After(time.Now()) {
		t.Errorf("ejected endpoints %+v; want gone and refusing, for the echo service, ejected now", dump)
	}
	if got := counter(t, m.a.reg, "istio_tcp_connections_failed_total", nil); got != 0 {
		t.Errorf("node A recorded %v failed connections; want none (a retried connection is one success)", got)
	}
	t.Logf("%d connections: %v retries (%d reset by the refusing node, %v answered 503), ejections %+v",
		conns, retries, refused.Load(), answered503(), dump)
}

// TestRollingReplacement replaces the echo service's three endpoints one by one under load
// (three looping clients) the way a rolling update does: the new pod is up and known first, then the old one goes
// away, and the control plane tells node A only after some connections were sent to it.
// Today (no retries, no ejection) some of those connections fail; with retries none does.
func TestRollingReplacement(t *testing.T) {
	leaktest.Check(t)
	for _, tc := range []struct {
		name    string
		retries int
		eject   bool
	}{{"today", 0, false}, {"retries and ejection", 2, true}} {
		t.Run(tc.name, func(t *testing.T) {
			failed, attempts := rollEndpoints(t, tc.retries, tc.eject)
			t.Logf("%s: %d of %d connections failed during the roll", tc.name, failed, attempts)
			if tc.retries == 0 && failed == 0 {
				t.Errorf("no connection failed without retries: the test did not send any to a gone endpoint")
			}
			if tc.retries > 0 && failed != 0 {
				t.Errorf("%d connections failed with retries; want none", failed)
			}
		})
	}
}

// rollEndpoints runs the roll of TestRollingReplacement and returns the failed and total
// connections of the load.
func rollEndpoints(t *testing.T, retries int, eject bool) (failed, attempts int64) {
	m := newMesh(t)
	sub := strings.TrimSuffix(m.serverIP, "3")
	ip := func(i int) string { return fmt.Sprintf("%s%d", sub, 10+i) }
	for i := range 6 {
		if !free(ip(i), []string{"15008", "8080"}) {
			t.Skipf("needs %s:15008 and :8080 free", ip(i))
		}
	}
	// The example's server is left out: the service's endpoints are pods 0..5, 0..2 first.
	yaml := strings.Replace(m.yaml, `"default/echo.default.svc.cluster.local":`, `"default/unused.default.svc.cluster.local":`, 1)
	var eps []string
	for i := range 6 {
		eps = append(eps, echoEndpointYAML(fmt.Sprintf("pod%d", i), ip(i)))
	}
	all := parseBatch(t, withEndpoints(yaml, eps...))
	pod := func(i int) *state.Workload {
		for _, w := range all.Workloads {
			if w.Name == fmt.Sprintf("pod%d", i) {
				return w
			}
		}
		t.Fatalf("no pod%d", i)
		return nil
	}
	type endpoint struct {
		n *node
		b *backend
	}
	start := func(i int) endpoint {
		return endpoint{startNode(t, fmt.Sprintf("node-pod%d", i), m.caDir, withEndpoints(yaml, eps...), dedicatedServer(fmt.Sprintf("pod%d", i), ip(i))),
			startBackend(t, ip(i)+":8080", echo)}
	}
	live := map[int]endpoint{}
	for i := range 3 {
		live[i] = start(i)
	}
	cfg := m.clientConfig()
	cfg.ConnectRetries = retries
	if eject {
		cfg.Outliers = outlier.New(outlier.Config{})
	}
	// Node A knows pods 0..2 only.
	initial := &state.Batch{Services: all.Services, Workloads: []*state.Workload{pod(0), pod(1), pod(2)}}
	for _, w := range all.Workloads {
		if !strings.HasPrefix(w.Name, "pod") {
			initial.Workloads = append(initial.Workloads, w)
		}
	}
	m.a = startNode(t, "node-a", m.caDir, "workloads: []\n", cfg)
	m.a.store.Apply(initial)

	var nFailed, nAttempts atomic.Int64
	stop := make(chan struct{})
	var load sync.WaitGroup
	for range outlier.MinRetries { // the retry budget's floor: every failed attempt is retried
		load.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				nAttempts.Add(1)
				if err := echoOnce(m.a.socks(t)); err != nil {
					nFailed.Add(1)
				}
			}
		})
	}
	stopLoad := sync.OnceFunc(func() { close(stop); load.Wait() })
	defer stopLoad() // when a check fails midway
	for i := range 3 {
		// The new pod is up and known, then the old one goes away; node A hears of it
		// only after 30 more connections.
		live[i+3] = start(i + 3)
		m.a.store.Apply(&state.Batch{Workloads: []*state.Workload{pod(i + 3)}})
		old := live[i]
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := old.n.shutdown(ctx); err != nil {
			t.Errorf("pod%d: shutdown: %v", i, err)
		}
		cancel()
		old.b.Close()
		delete(live, i)
		seen := nAttempts.Load()
		testutil.Eventually(t, "30 connections while node A still routes to the gone pod", func() bool { return nAttempts.Load() >= seen+30 })
		m.a.store.Apply(&state.Batch{RemoveAddresses: []string{pod(i).UID}})
	}
	stopLoad()
	return nFailed.Load(), nAttempts.Load()
}
