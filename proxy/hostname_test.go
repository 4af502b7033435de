package proxy_test

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	zdns "github.com/gozt/gozt/dns"
	"github.com/gozt/gozt/internal/logtest"
)

// A workload with a hostname and no address (a ServiceEntry with DNS resolution), picked
// as a service's endpoint, is dialed at the address its name resolves to through a real
// nameserver on loopback; istio_on_demand_dns_total counts each connection with the Rust
// ztunnel's labels; the second connection is served from the cache (one query); a name that
// does not resolve fails the connection with an error naming it.
func TestHostnameOnlyWorkload(t *testing.T) {
	m := newMesh(t)
	ns := startTestNameserver(t, map[string]string{"vm.example.com.": m.serverIP})
	resolver, err := zdns.NewResolver(zdns.ResolverConfig{Upstreams: []string{ns.addr}})
	if err != nil {
		t.Fatal(err)
	}
	be := startBackend(t, m.serverIP+":0", echo)
	m.yaml = strings.Replace(m.yaml, "workloads:\n", fmt.Sprintf(`workloads:
  - uid: Kubernetes/networking.istio.io/ServiceEntry/default/vm/vm.example.com
    name: vm
    namespace: default
    hostname: vm.example.com
    protocol: NONE
    services:
      "default/vm.example.com":
        80: %d
  - uid: Kubernetes/networking.istio.io/ServiceEntry/default/gone/missing.example.com
    name: gone
    namespace: default
    hostname: missing.example.com
    protocol: NONE
    services:
      "default/missing.example.com":
        80: %d
`, be.port(), be.port()), 1)
	m.yaml = strings.Replace(m.yaml, "services:\n  - name: echo", `services:
  - name: vm
    namespace: default
    hostname: vm.example.com
    vips: ["/127.10.0.2"]
    ports:
      80: 0
  - name: gone
    namespace: default
    hostname: missing.example.com
    vips: ["/127.10.0.3"]
    ports:
      80: 0
  - name: echo`, 1)
	rec := &logtest.Recorder{}
	cfg := m.clientConfig()
	cfg.Resolver, cfg.Logger = resolver, rec.Logger()
	m.b = startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	m.a = startNode(t, "node-a", m.caDir, m.yaml, cfg)

	for i := range 2 {
		c, code, err := socksConnect(m.a.socks(t), "127.10.0.2", 80)
		if err != nil {
			t.Fatalf("connection %d to the hostname-only service: reply %d, %v", i+1, code, err)
		}
		msg := fmt.Sprintf("hello %d", i)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write([]byte(msg))
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("connection %d: echo %q, %v", i+1, buf, err)
		}
		c.Close()
	}
	if be.accepted.Load() != 2 {
		t.Errorf("the backend at the resolved address accepted %d connections, want 2", be.accepted.Load())
	}
	if n := ns.count("vm.example.com.", dns.TypeA); n != 1 {
		t.Errorf("nameserver saw %d A queries for two connections; want 1 (the second from the cache)", n)
	}
	want := map[string]string{
		"hostname": "vm.example.com", "source_workload": "client", "source_workload_namespace": "default",
		"source_principal": "spiffe://" + clientPrinc, "source_canonical_revision": "unknown",
	}
	if got := counter(t, m.a.reg, "istio_on_demand_dns_total", want); got != 2 {
		t.Errorf("istio_on_demand_dns_total%v = %v, want 2", want, got)
	}

	if _, code, err := socksConnect(m.a.socks(t), "127.10.0.3", 80); err == nil {
		t.Fatal("a connection to a workload whose hostname does not resolve succeeded")
	} else if code == 0 {
		t.Fatalf("no SOCKS5 failure reply: %v", err)
	}
	var found bool
	for range 50 {
		for _, l := range rec.Lines(slog.LevelDebug) {
			if strings.Contains(l, "missing.example.com") && strings.Contains(l, "NXDOMAIN") {
				found = true
			}
		}
		if found {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !found {
		t.Errorf("no log line names the unresolvable hostname and NXDOMAIN:\n%s", strings.Join(rec.Lines(slog.LevelDebug), "\n"))
	}
}

// testNameserver answers A queries for its names on loopback (UDP), NXDOMAIN for others,
// and counts the queries.
type testNameserver struct {
	addr string
	mu   sync.Mutex
	seen map[string]int
}

func (ns *testNameserver) count(name string, qtype uint16) int {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return ns.seen[name+" "+dns.TypeToString[qtype]]
}

func startTestNameserver(t *testing.T, names map[string]string) *testNameserver {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ns := &testNameserver{addr: pc.LocalAddr().String(), seen: map[string]int{}}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		q := req.Question[0]
		ns.mu.Lock()
		ns.seen[q.Name+" "+dns.TypeToString[q.Qtype]]++
		ns.mu.Unlock()
		resp := new(dns.Msg)
		resp.SetReply(req)
		if ip, ok := names[q.Name]; !ok {
			resp.Rcode = dns.RcodeNameError
		} else if q.Qtype == dns.TypeA {
			rr, _ := dns.NewRR(q.Name + " 60 IN A " + ip)
			resp.Answer = append(resp.Answer, rr)
		}
		w.WriteMsg(resp)
	})}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	done := make(chan struct{})
	go func() { defer close(done); srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { srv.Shutdown(); <-done })
	return ns
}
