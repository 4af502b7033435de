package proxy_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/proxy/outlier"
)

// withDeadPort adds to the example topology a service, dead.default.svc.cluster.local,
// served by the server workload on port 9090, where nothing listens: node B answers its
// CONNECTs 503.
func withDeadPort(yaml string) string {
	const echoPorts = `      "default/echo.default.svc.cluster.local":
        80: 8080
`
	yaml = strings.Replace(yaml, echoPorts, echoPorts+`      "default/dead.default.svc.cluster.local":
        80: 9090
`, 1)
	return yaml + `  - name: dead
    namespace: default
    hostname: dead.default.svc.cluster.local
    vips: ["/127.10.0.2"]
    ports:
      80: 9090
`
}

// connectFails connects through socks to host:80 and fails the test if that worked.
func connectFails(t *testing.T, socks, host string) {
	t.Helper()
	c, code, err := socksConnect(socks, host, 80)
	if c != nil {
		c.Close()
	}
	if err == nil && code == 0 {
		t.Fatalf("connection to %s succeeded; want it to fail", host)
	}
}

// ejections formats the detector's dump as workload:port for service.
func ejections(d *outlier.Detector) []string {
	var out []string
	for _, e := range d.Dump() {
		out = append(out, fmt.Sprintf("%s:%d for %s", e.Workload, e.Port, e.Service))
	}
	return out
}

// TestEjectionKeyedByPort: the server pod serves the echo service on 8080 and the dead
// service on 9090, where nothing listens. Failed connects to the dead service eject the pod
// on 9090 only; connections to it on 8080 succeed and leave that ejection in place.
func TestEjectionKeyedByPort(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t, "8080", "9090")
	m.yaml = withDeadPort(m.yaml)
	startBackend(t, m.serverIP+":8080", echo)
	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	outliers := outlier.New(outlier.Config{Base: time.Minute}) // no ejection ends during the test
	cfg := m.clientConfig()
	cfg.ConnectRetries, cfg.Outliers = 2, outliers
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)

	for range outlier.DefaultFailures {
		connectFails(t, m.a.socks(t), "dead.default.svc.cluster.local")
	}
	want := "default/server:9090 for default/dead.default.svc.cluster.local"
	if got := ejections(outliers); len(got) != 1 || got[0] != want {
		t.Fatalf("ejected %q; want %q", got, want)
	}
	for range 3 {
		if err := echoOnce(m.a.socks(t)); err != nil {
			t.Fatal(err)
		}
	}
	if got := ejections(outliers); len(got) != 1 || got[0] != want {
		t.Fatalf("after connections on 8080, ejected %q; want %q still", got, want)
	}
}

// failingCerts is a CertSource whose client certificates fail while fail is set, as when
// the CA cannot be reached.
type failingCerts struct {
	proxy.CertSource
	fail atomic.Bool
}

func (f *failingCerts) ClientConfig(ctx context.Context, src identity.ID, expected []identity.ID) (*tls.Config, error) {
	if f.fail.Load() {
		return nil, errors.New("certs: fetch: the CA is unreachable (test)")
	}
	return f.CertSource.ClientConfig(ctx, src, expected)
}

// TestLocalFailuresNotHeldAgainstEndpoints: connects that fail for want of node A's own
// certificate, and those node B refuses because node A's identity has used up its budget
// of streams there (REFUSED_STREAM), leave no record against the endpoint; the first are
// not retried either (another endpoint would fail the same).
func TestLocalFailuresNotHeldAgainstEndpoints(t *testing.T) {
	leaktest.Check(t)
	m := newMesh(t, "8080")
	startBackend(t, m.serverIP+":8080", echo)
	bcfg := m.serverConfig()
	bcfg.HBONEServer.Admission.PeerStreams = 1
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	outliers := outlier.New(outlier.Config{})
	cfg := m.clientConfig()
	cfg.ConnectRetries, cfg.Outliers = 2, outliers
	certs := &failingCerts{}
	certs.fail.Store(true)
	m.a = startNodeWith(t, "node-a", m.caDir, m.yaml, cfg, quiet, func(s proxy.CertSource) proxy.CertSource {
		certs.CertSource = s
		return certs
	})
	echoSvc := map[string]string{"destination_service": "echo.default.svc.cluster.local"}

	for range outlier.DefaultFailures + 1 {
		connectFails(t, m.a.socks(t), "echo.default.svc.cluster.local")
	}
	if got := counter(t, m.a.reg, "outbound_connect_retries_total", echoSvc); got != 0 {
		t.Errorf("%v retries after node A's certificate failed; want none", got)
	}
	if outliers.Any() {
		t.Errorf("node A's certificate failing left records against the endpoint: ejected %q", ejections(outliers))
	}

	// With a certificate, one connection holds node B's only stream for node A's identity;
	// the next ones are refused.
	certs.fail.Store(false)
	held, code, err := socksConnect(m.a.socks(t), "echo.default.svc.cluster.local", 80)
	if err != nil || code != 0 {
		t.Fatalf("first connection: code %d, %v", code, err)
	}
	defer held.Close()
	for range outlier.DefaultFailures + 1 {
		connectFails(t, m.a.socks(t), "echo.default.svc.cluster.local")
	}
	if outliers.Any() {
		t.Errorf("streams refused by node B's budget left records against the endpoint: ejected %q", ejections(outliers))
	}
}
