package dns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

func wl(uid, ns string, healthy bool, addrs ...string) *state.Workload {
	w := &state.Workload{UID: uid, Name: uid, Healthy: healthy, Capacity: 1, WorkloadMeta: &state.WorkloadMeta{
		Namespace: ns, TrustDomain: "cluster.local", ServiceAccount: "default", CanonicalName: uid + "-app", CanonicalRevision: "v1"}}
	for _, a := range addrs {
		w.Addresses = append(w.Addresses, netip.MustParseAddr(a))
	}
	return w
}

func vips(network string, addrs ...string) []state.NetworkAddress {
	var out []state.NetworkAddress
	for _, a := range addrs {
		out = append(out, state.NetworkAddress{Network: network, Address: netip.MustParseAddr(a)})
	}
	return out
}

// testStore is the mesh the tests query. Clients: client1 (ns1), client2 (ns2), client3 (ns3),
// client4 (ns1, network "other").
func testStore() *state.Store {
	st := state.NewStore()
	// client1 is dual-stack, the others IPv4 only, but client6, IPv6 only.
	c1, c2, c3 := wl("client1", "ns1", true, "10.0.0.1", "fd00:a::1"), wl("client2", "ns2", true, "10.0.0.2"), wl("client3", "ns3", true, "10.0.0.3")
	c4 := wl("client4", "ns1", true, "10.0.0.4")
	c6 := wl("client6", "ns1", true, "fd00:a::6")
	c4.Network = "other"
	h1, h2, h3 := wl("hl-1", "ns1", true, "10.1.1.1", "fd00:1::1"), wl("hl-2", "ns1", true, "10.1.1.2"), wl("hl-3", "ns1", false, "10.1.1.3")
	for _, w := range []*state.Workload{h1, h2, h3} {
		w.Services = map[string]map[uint16]uint16{
			"ns1/headless.ns1.svc.cluster.local": {80: 8080},
			"ns1/hl6.ns1.svc.cluster.local":      {80: 8080},
		}
	}
	svc := func(name, ns, host string, addrs []state.NetworkAddress) *state.Service {
		return &state.Service{Name: name, Namespace: ns, Hostname: host, Addresses: addrs, Ports: map[uint16]uint16{80: 8080}}
	}
	svc1 := svc("svc1", "ns1", "svc1.ns1.svc.cluster.local", append(vips("", "10.96.0.1", "fd00::1"), vips("other", "10.200.0.1")...))
	dup1 := svc("dup", "ns1", "dup.example.com", vips("", "10.1.0.1"))
	dup2 := svc("dup", "ns2", "dup.example.com", vips("", "10.2.0.1"))
	private := svc("private", "ns2", "private.ns2.svc.cluster.local", vips("", "10.3.0.1"))
	private.Visibility = state.VisibilityNamespace
	wild := svc("wild", "ns1", "*.wild.example.com", vips("", "10.4.0.1"))
	v4 := svc("v4", "ns1", "v4.ns1.svc.cluster.local", vips("", "10.5.0.1", "fd00::5"))
	v4.IPFamilies = state.IPFamiliesIPv4Only
	headless := svc("headless", "ns1", "headless.ns1.svc.cluster.local", nil)
	headless.IPFamilies = state.IPFamiliesIPv4Only
	hl6 := svc("hl6", "ns1", "hl6.ns1.svc.cluster.local", nil)
	se := svc("se", "ns1", "se.example.com", nil) // VIP-less, not headless: forwarded
	otherNet := svc("remote", "ns1", "remote.ns1.svc.cluster.local", vips("other", "10.6.0.1"))
	st.Apply(&state.Batch{
		Workloads: []*state.Workload{c1, c2, c3, c4, c6, h1, h2, h3},
		Services:  []*state.Service{svc1, dup1, dup2, private, wild, v4, headless, hl6, se, otherNet},
	})
	return st
}

// upstream is an in-test DNS server on 127.0.0.1 (UDP and TCP on one port).
type upstream struct {
	addr     string
	udp, tcp atomic.Int32
}

func startUpstream(t testing.TB) *upstream {
	t.Helper()
	u := &upstream{}
	pc, ln, err := New(Config{}, nil, nil).listenPair("127.0.0.1", "0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = pc.LocalAddr().String()
	h := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		tcp := false
		if _, ok := w.LocalAddr().(*net.TCPAddr); ok {
			tcp = true
			u.tcp.Add(1)
		} else {
			u.udp.Add(1)
		}
		resp := new(dns.Msg)
		resp.SetReply(req)
		q := req.Question[0]
		switch {
		case q.Name == "external.test." && q.Qtype == dns.TypeA:
			resp.Answer = append(resp.Answer, mustRR(t, "external.test. 60 IN A 192.0.2.10"))
		case q.Name == "external.test." && q.Qtype == dns.TypeTXT:
			resp.Answer = append(resp.Answer, mustRR(t, `external.test. 60 IN TXT "hello"`))
		case strings.HasSuffix(q.Name, "svc1.ns1.svc.cluster.local.") && q.Qtype == dns.TypeSRV:
			// What the cluster DNS (CoreDNS's kubernetes plugin) answers for a named port.
			resp.Authoritative = true
			resp.Answer = append(resp.Answer, mustRR(t, q.Name+" 30 IN SRV 0 100 80 svc1.ns1.svc.cluster.local."))
		case q.Name == "svc1.ns1.svc.cluster.local." && q.Qtype == dns.TypeTXT:
			resp.Answer = append(resp.Answer, mustRR(t, `svc1.ns1.svc.cluster.local. 60 IN TXT "from-upstream"`))
		case q.Name == "slow.test.":
			time.Sleep(300 * time.Millisecond)
			resp.Answer = append(resp.Answer, mustRR(t, "slow.test. 60 IN A 192.0.2.30"))
		case q.Name == "big.test." && !tcp:
			resp.Truncated = true
		case q.Name == "big.test.":
			for i := range 100 {
				resp.Answer = append(resp.Answer, mustRR(t, fmt.Sprintf("big.test. 60 IN A 192.0.2.%d", i)))
			}
		default:
			resp.Rcode = dns.RcodeNameError
		}
		if opt := req.IsEdns0(); opt != nil {
			resp.SetEdns0(4096, opt.Do())
		}
		w.WriteMsg(resp)
	})
	us := &dns.Server{PacketConn: pc, Handler: h}
	ts := &dns.Server{Listener: ln, Handler: h}
	runServers(t, us, ts)
	return u
}

// runServers runs miekg servers until the test ends.
func runServers(t testing.TB, servers ...*dns.Server) {
	t.Helper()
	done := make(chan error, len(servers))
	for _, srv := range servers {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		go func() { done <- srv.ActivateAndServe() }()
		<-started
	}
	t.Cleanup(func() {
		for _, srv := range servers {
			srv.Shutdown()
			<-done
		}
	})
}

// value reads a counter.
func value(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.(prometheus.Counter).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func mustRR(t testing.TB, s string) dns.RR {
	rr, err := dns.NewRR(s)
	if err != nil {
		t.Fatal(err)
	}
	return rr
}

// testPoller, when set (TestPolled), is the Poller of the servers start and
// TestListenServeClose run; nil is a goroutine per socket.
var testPoller netpoll.Poller

type env struct {
	srv  *Server
	addr string
	up   *upstream
	m    *metrics.Metrics
}

// start runs a Server on 127.0.0.1:0 whose client is the workload with uid (or unknown when
// uid is empty), forwarding to a fresh in-test upstream.
func start(t *testing.T, uid string, mod func(*Config)) *env {
	t.Helper()
	st := testStore()
	up := startUpstream(t)
	m := metrics.New(prometheus.NewRegistry(), "test")
	cfg := Config{
		Addr:      "127.0.0.1:0",
		Upstreams: []string{up.addr},
		Source:    func(netip.Addr) *state.Workload { return st.WorkloadByUID(uid) },
		Poller:    testPoller,
	}
	if mod != nil {
		mod(&cfg)
	}
	s := New(cfg, st, m)
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background()) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &env{srv: s, addr: s.Addr().String(), up: up, m: m}
}

func (e *env) query(t *testing.T, network, name string, qtype uint16, edns uint16) *dns.Msg {
	t.Helper()
	req := new(dns.Msg)
	req.SetQuestion(dns.Fqdn(name), qtype)
	if edns != 0 {
		req.SetEdns0(edns, true)
	}
	c := &dns.Client{Net: network, Timeout: 5 * time.Second}
	resp, _, err := c.Exchange(req, e.addr)
	if err != nil {
		t.Fatalf("%s %s %s: %v", network, name, dns.TypeToString[qtype], err)
	}
	return resp
}

// summary renders a response's rcode, flags and sorted answers for comparison.
func summary(resp *dns.Msg) string {
	var rrs []string
	for _, rr := range resp.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			rrs = append(rrs, rr.Hdr.Name+" A "+rr.A.String())
		case *dns.AAAA:
			rrs = append(rrs, rr.Hdr.Name+" AAAA "+rr.AAAA.String())
		case *dns.CNAME:
			rrs = append(rrs, rr.Hdr.Name+" CNAME "+rr.Target)
		default:
			rrs = append(rrs, rr.String())
		}
	}
	slices.Sort(rrs)
	aa := ""
	if resp.Authoritative {
		aa = " aa"
	}
	return dns.RcodeToString[resp.Rcode] + aa + " [" + strings.Join(rrs, "; ") + "]"
}

func TestAnswers(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	const s1 = "svc1.ns1.svc.cluster.local."
	tests := []struct {
		name  string
		qtype uint16
		want  string
	}{
		{"svc1.ns1.svc.cluster.local", dns.TypeA, "NOERROR aa [" + s1 + " A 10.96.0.1]"},
		{"SVC1.Ns1.svc.cluster.local", dns.TypeA, "NOERROR aa [SVC1.Ns1.svc.cluster.local. A 10.96.0.1]"},
		{"svc1.ns1.svc.cluster.local", dns.TypeAAAA, "NOERROR aa [" + s1 + " AAAA fd00::1]"},
		// Kubernetes expansions by label count.
		{"svc1", dns.TypeA, "NOERROR aa [svc1. A 10.96.0.1]"},
		{"svc1.ns1", dns.TypeA, "NOERROR aa [svc1.ns1. A 10.96.0.1]"},
		{"svc1.ns1.svc", dns.TypeA, "NOERROR aa [svc1.ns1.svc. A 10.96.0.1]"},
		// A search domain appended by the client's resolver is stripped: CNAME to the real name.
		{"svc1.ns1.svc.cluster.local.ns1.svc.cluster.local", dns.TypeA,
			"NOERROR aa [" + s1 + " A 10.96.0.1; svc1.ns1.svc.cluster.local.ns1.svc.cluster.local. CNAME " + s1 + "]"},
		{"svc1.ns1.svc.cluster.local.cluster.local", dns.TypeA,
			"NOERROR aa [" + s1 + " A 10.96.0.1; svc1.ns1.svc.cluster.local.cluster.local. CNAME " + s1 + "]"},
		{"svc1.ns1.svc.svc.cluster.local", dns.TypeA,
			"NOERROR aa [svc1.ns1.svc. A 10.96.0.1; svc1.ns1.svc.svc.cluster.local. CNAME svc1.ns1.svc.]"},
		// Wildcard: no CNAME.
		{"foo.wild.example.com", dns.TypeA, "NOERROR aa [foo.wild.example.com. A 10.4.0.1]"},
		{"a.b.wild.example.com", dns.TypeA, "NOERROR aa [a.b.wild.example.com. A 10.4.0.1]"},
		{"foo.wild.example.com.ns1.svc.cluster.local", dns.TypeA,
			"NOERROR aa [foo.wild.example.com.ns1.svc.cluster.local. A 10.4.0.1]"},
		// Namespace preference between two services of one hostname.
		{"dup.example.com", dns.TypeA, "NOERROR aa [dup.example.com. A 10.1.0.1]"},
		// Headless: one address per healthy endpoint; ip_families=IPv4 gives an empty AAAA.
		{"headless.ns1.svc.cluster.local", dns.TypeA,
			"NOERROR aa [headless.ns1.svc.cluster.local. A 10.1.1.1; headless.ns1.svc.cluster.local. A 10.1.1.2]"},
		{"headless", dns.TypeAAAA, "NOERROR aa []"},
		{"hl6.ns1.svc.cluster.local", dns.TypeAAAA, "NOERROR aa [hl6.ns1.svc.cluster.local. AAAA fd00:1::1]"},
		// ip_families on a VIP service; found but no records -> NOERROR, empty.
		{"v4.ns1.svc.cluster.local", dns.TypeA, "NOERROR aa [v4.ns1.svc.cluster.local. A 10.5.0.1]"},
		{"v4.ns1.svc.cluster.local", dns.TypeAAAA, "NOERROR aa []"},
		{"remote.ns1.svc.cluster.local", dns.TypeA, "NOERROR aa []"},
		// Namespace visibility: ns2-only service is not answered for ns1; upstream says NXDOMAIN.
		{"private.ns2.svc.cluster.local", dns.TypeA, "NXDOMAIN []"},
		// VIP-less service outside .svc.<domain>: forwarded.
		{"se.example.com", dns.TypeA, "NXDOMAIN []"},
		// Other record types of mesh names, and unknown names: forwarded.
		{"svc1.ns1.svc.cluster.local", dns.TypeTXT, `NOERROR [svc1.ns1.svc.cluster.local.	60	IN	TXT	"from-upstream"]`},
		{"external.test", dns.TypeA, "NOERROR [external.test. A 192.0.2.10]"},
		{"external.test", dns.TypeTXT, `NOERROR [external.test.	60	IN	TXT	"hello"]`},
		{"unknown.test", dns.TypeA, "NXDOMAIN []"},
	}
	for _, network := range []string{"udp", "tcp"} {
		for _, tt := range tests {
			resp := e.query(t, network, tt.name, tt.qtype, 0)
			if got := summary(resp); got != tt.want {
				t.Errorf("%s %s %s:\n got %s\nwant %s", network, tt.name, dns.TypeToString[tt.qtype], got, tt.want)
			}
			for _, rr := range resp.Answer {
				if resp.Authoritative && rr.Header().Ttl != TTL {
					t.Errorf("%s %s: TTL %d; want %d", network, tt.name, rr.Header().Ttl, TTL)
				}
			}
		}
	}
	if n := e.up.tcp.Load(); n != 0 {
		t.Errorf("upstream got %d TCP queries without truncation; want 0", n)
	}
}

func TestClientNamespace(t *testing.T) {
	leaktest.Check(t)
	e2 := start(t, "client2", nil)
	e3 := start(t, "client3", nil)
	for _, tt := range []struct {
		e          *env
		name, want string
	}{
		{e2, "dup.example.com", "NOERROR aa [dup.example.com. A 10.2.0.1]"},
		{e2, "private.ns2.svc.cluster.local", "NOERROR aa [private.ns2.svc.cluster.local. A 10.3.0.1]"},
		{e2, "private", "NOERROR aa [private. A 10.3.0.1]"},
		{e2, "svc1", "NXDOMAIN []"}, // svc1.ns2.svc.cluster.local does not exist
		{e2, "svc1.ns1", "NOERROR aa [svc1.ns1. A 10.96.0.1]"},
		{e3, "private.ns2.svc.cluster.local", "NXDOMAIN []"},
		{e3, "private.ns2", "NXDOMAIN []"},
	} {
		if got := summary(tt.e.query(t, "udp", tt.name, dns.TypeA, 0)); got != tt.want {
			t.Errorf("%s (client %s): got %s; want %s", tt.name, tt.e.srv.cfg.Source(netip.Addr{}).Namespace, got, tt.want)
		}
	}
	// ns3 sees one of the two public dup services, never nothing.
	if got := summary(e3.query(t, "udp", "dup.example.com", dns.TypeA, 0)); got != "NOERROR aa [dup.example.com. A 10.1.0.1]" &&
		got != "NOERROR aa [dup.example.com. A 10.2.0.1]" {
		t.Errorf("dup.example.com from ns3: %s", got)
	}
}

func TestClientNetwork(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client4", nil)
	for _, tt := range []struct {
		name  string
		qtype uint16
		want  string
	}{
		{"svc1", dns.TypeA, "NOERROR aa [svc1. A 10.200.0.1]"},
		{"svc1", dns.TypeAAAA, "NOERROR aa []"},
		{"remote", dns.TypeA, "NOERROR aa [remote. A 10.6.0.1]"},
		{"headless", dns.TypeA, "NOERROR aa [headless. A 10.1.1.1; headless. A 10.1.1.2]"},
	} {
		if got := summary(e.query(t, "udp", tt.name, tt.qtype, 0)); got != tt.want {
			t.Errorf("%s %s from network other: got %s; want %s", tt.name, dns.TypeToString[tt.qtype], got, tt.want)
		}
	}
}

func TestDedicatedSearchDomains(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", func(c *Config) {
		c.FixedSearch = true
		c.SearchDomains = []string{"corp.example."}
	})
	for _, tt := range []struct{ name, want string }{
		{"svc1.ns1.svc.cluster.local.corp.example", "NOERROR aa [svc1.ns1.svc.cluster.local. A 10.96.0.1; svc1.ns1.svc.cluster.local.corp.example. CNAME svc1.ns1.svc.cluster.local.]"},
		{"svc1.ns1.corp.example", "NOERROR aa [svc1.ns1. A 10.96.0.1; svc1.ns1.corp.example. CNAME svc1.ns1.]"},
		// Shared-mode domains are not in this client's list.
		{"svc1.ns1.svc.cluster.local.ns1.svc.cluster.local", "NXDOMAIN []"},
	} {
		if got := summary(e.query(t, "udp", tt.name, dns.TypeA, 0)); got != tt.want {
			t.Errorf("%s:\n got %s\nwant %s", tt.name, got, tt.want)
		}
	}
}

func TestDedicatedResolvConf(t *testing.T) {
	leaktest.Check(t)
	dir := t.TempDir()
	rc := filepath.Join(dir, "resolv.conf")
	if err := os.WriteFile(rc, []byte("nameserver 127.0.0.1\nnameserver ::1\nsearch a.example b.example.\noptions ndots:5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s := New(Config{Addr: "127.0.0.1:0", ResolvConf: rc, FixedSearch: true}, state.NewStore(), nil)
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if want := []string{"127.0.0.1:53", "[::1]:53"}; !slices.Equal(s.upstreams, want) {
		t.Errorf("upstreams %v; want %v", s.upstreams, want)
	}
	if want := []string{"a.example", "b.example"}; !slices.Equal(s.search, want) {
		t.Errorf("search %v; want %v", s.search, want)
	}

	bad := New(Config{Addr: "127.0.0.1:0", ResolvConf: filepath.Join(dir, "missing")}, state.NewStore(), nil)
	err := bad.Listen()
	if err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("Listen with a missing resolv.conf: %v; want an error naming it", err)
	}
	bad.Close()
}

func TestDisableIPv6(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", func(c *Config) { c.DisableIPv6 = true })
	if got := summary(e.query(t, "udp", "svc1.ns1.svc.cluster.local", dns.TypeAAAA, 0)); got != "NOERROR aa []" {
		t.Errorf("AAAA with IPv6 disabled: %s", got)
	}
	if got := summary(e.query(t, "udp", "svc1.ns1.svc.cluster.local", dns.TypeA, 0)); got != "NOERROR aa [svc1.ns1.svc.cluster.local. A 10.96.0.1]" {
		t.Errorf("A with IPv6 disabled: %s", got)
	}
}

func TestUnknownSourceServfail(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "", nil)
	for _, network := range []string{"udp", "tcp"} {
		for _, name := range []string{"svc1.ns1.svc.cluster.local", "external.test"} {
			if got := summary(e.query(t, network, name, dns.TypeA, 0)); got != "SERVFAIL []" {
				t.Errorf("%s %s from unknown source: %s; want SERVFAIL", network, name, got)
			}
		}
	}
	if n := e.up.udp.Load() + e.up.tcp.Load(); n != 0 {
		t.Errorf("upstream got %d queries for an unknown source; want 0", n)
	}
	if got := value(t, e.m.DNSRequests.WithLabelValues("a", "udp", "unknown", "unknown")); got != 2 {
		t.Errorf("dns requests (unknown source, udp) = %v; want 2", got)
	}
}

func TestEDNSEcho(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	for _, tt := range []struct {
		name     string
		edns     uint16
		wantSize uint16
	}{
		{"svc1.ns1.svc.cluster.local", 1232, 1232},
		{"svc1.ns1.svc.cluster.local", 100, 512}, // payload below 512 counts as 512
		{"external.test", 1232, 4096},            // forwarded: the upstream's OPT
	} {
		resp := e.query(t, "udp", tt.name, dns.TypeA, tt.edns)
		opt := resp.IsEdns0()
		if opt == nil {
			t.Errorf("%s edns %d: no OPT in the response", tt.name, tt.edns)
			continue
		}
		if opt.UDPSize() != tt.wantSize || !opt.Do() {
			t.Errorf("%s edns %d: OPT size %d do %v; want %d true", tt.name, tt.edns, opt.UDPSize(), opt.Do(), tt.wantSize)
		}
	}
	// A UDP query larger than 512 bytes (EDNS padding) is read whole.
	req := new(dns.Msg)
	req.SetQuestion("svc1.", dns.TypeA)
	req.SetEdns0(1232, false)
	req.IsEdns0().Option = append(req.IsEdns0().Option, &dns.EDNS0_PADDING{Padding: make([]byte, 900)})
	resp, _, err := (&dns.Client{Net: "udp", Timeout: 5 * time.Second}).Exchange(req, e.addr)
	if err != nil || len(resp.Answer) != 1 {
		t.Errorf("padded 900-byte query: %v %v", resp, err)
	}
	if resp := e.query(t, "udp", "svc1.ns1.svc.cluster.local", dns.TypeA, 0); resp.IsEdns0() != nil {
		t.Errorf("OPT in the answer to a query without EDNS")
	}
}

func TestTruncation(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	// The upstream truncates over UDP: the proxy retries over TCP, then fits the answer to
	// what the client accepts.
	resp := e.query(t, "udp", "big.test", dns.TypeA, 0)
	if !resp.Truncated || len(resp.Answer) >= 100 {
		t.Errorf("UDP without EDNS: tc=%v answers=%d; want truncated", resp.Truncated, len(resp.Answer))
	}
	if resp := e.query(t, "udp", "big.test", dns.TypeA, 4096); resp.Truncated || len(resp.Answer) != 100 {
		t.Errorf("UDP with EDNS 4096: tc=%v answers=%d; want 100", resp.Truncated, len(resp.Answer))
	}
	if resp := e.query(t, "tcp", "big.test", dns.TypeA, 0); resp.Truncated || len(resp.Answer) != 100 {
		t.Errorf("TCP: tc=%v answers=%d; want 100", resp.Truncated, len(resp.Answer))
	}
	if got := e.up.tcp.Load(); got != 3 {
		t.Errorf("upstream TCP queries = %d; want 3 (one retry per query)", got)
	}
	// miekg's client retries a truncated UDP answer over TCP on its own only when asked;
	// check that the truncated UDP message still parses with the question intact.
	if len(resp.Question) != 1 || resp.Question[0].Name != "big.test." {
		t.Errorf("truncated response question %v", resp.Question)
	}
}

func TestForwardFailure(t *testing.T) {
	leaktest.Check(t)
	// A port nobody answers on: UDP gets ICMP unreachable (or a timeout).
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := pc.LocalAddr().String()
	pc.Close()
	e := start(t, "client1", func(c *Config) {
		c.Upstreams = append([]string{dead}, c.Upstreams...) // the second one answers
		c.UpstreamTimeout = 500 * time.Millisecond
	})
	if got := summary(e.query(t, "udp", "external.test", dns.TypeA, 0)); got != "NOERROR [external.test. A 192.0.2.10]" {
		t.Errorf("with a dead first upstream: %s", got)
	}
	e = start(t, "client1", func(c *Config) {
		c.Upstreams = []string{dead}
		c.UpstreamTimeout = 500 * time.Millisecond
	})
	if got := summary(e.query(t, "tcp", "external.test", dns.TypeA, 0)); got != "SERVFAIL []" {
		t.Errorf("with only a dead upstream: %s; want SERVFAIL", got)
	}
	// Mesh answers do not depend on the upstream.
	if got := summary(e.query(t, "udp", "svc1", dns.TypeA, 0)); got != "NOERROR aa [svc1. A 10.96.0.1]" {
		t.Errorf("mesh name with a dead upstream: %s", got)
	}
	lv := []string{"a", "tcp", "client1-app", "v1"}
	if got := value(t, e.m.DNSUpstreamFailures.WithLabelValues(lv...)); got != 1 {
		t.Errorf("upstream failures = %v; want 1", got)
	}
}

func TestMetrics(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	e.query(t, "udp", "svc1", dns.TypeA, 0)
	e.query(t, "udp", "external.test", dns.TypeA, 0)
	e.query(t, "tcp", "external.test", dns.TypeAAAA, 0)
	udpA := []string{"a", "udp", "client1-app", "v1"}
	tcpAAAA := []string{"aaaa", "tcp", "client1-app", "v1"}
	for _, tt := range []struct {
		what string
		c    prometheus.Collector
		want float64
	}{
		{"requests udp a", e.m.DNSRequests.WithLabelValues(udpA...), 2},
		{"requests tcp aaaa", e.m.DNSRequests.WithLabelValues(tcpAAAA...), 1},
		{"upstream udp a", e.m.DNSUpstreamRequests.WithLabelValues(udpA...), 1},
		{"upstream tcp aaaa", e.m.DNSUpstreamRequests.WithLabelValues(tcpAAAA...), 1},
		{"failures udp a", e.m.DNSUpstreamFailures.WithLabelValues(udpA...), 0},
	} {
		if got := value(t, tt.c); got != tt.want {
			t.Errorf("%s = %v; want %v", tt.what, got, tt.want)
		}
	}
	var h dto.Metric
	if err := e.m.DNSUpstreamDuration.WithLabelValues(udpA...).(prometheus.Histogram).Write(&h); err != nil {
		t.Fatal(err)
	}
	if n := h.GetHistogram().GetSampleCount(); n != 1 {
		t.Errorf("upstream duration samples (udp a) = %d; want 1", n)
	}
}

func TestShuffled(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	seen := map[string]bool{}
	for range 40 {
		resp := e.query(t, "udp", "headless.ns1.svc.cluster.local", dns.TypeA, 0)
		if len(resp.Answer) != 2 {
			t.Fatalf("answers %v", resp.Answer)
		}
		seen[resp.Answer[0].(*dns.A).A.String()] = true
	}
	if len(seen) != 2 {
		t.Errorf("first answer over 40 queries was always %v; want shuffled", seen)
	}
}

func TestListenServeClose(t *testing.T) {
	leaktest.Check(t)
	st := testStore()
	s := New(Config{Addr: "localhost:0", Upstreams: []string{"127.0.0.1:1"}, Poller: testPoller,
		Source: func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }}, st, nil)
	if err := s.Serve(context.Background()); err == nil {
		t.Error("Serve before Listen succeeded")
	}
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	if err := s.Listen(); err == nil {
		t.Error("second Listen succeeded")
	}
	port := s.Addr().(*net.UDPAddr).Port
	// "localhost" binds both loopbacks on one port, when the host has ::1.
	addrs := []string{fmt.Sprintf("127.0.0.1:%d", port)}
	if ln, err := net.Listen("tcp", "[::1]:0"); err == nil {
		ln.Close()
		addrs = append(addrs, fmt.Sprintf("[::1]:%d", port))
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx) }()
	for _, a := range addrs {
		for _, network := range []string{"udp", "tcp"} {
			req := new(dns.Msg)
			req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
			resp, _, err := (&dns.Client{Net: network, Timeout: 5 * time.Second}).Exchange(req, a)
			if err != nil || len(resp.Answer) != 1 {
				t.Errorf("%s %s: %v %v", network, a, resp, err)
			}
		}
	}
	// An idle TCP client must not hold up the stop. Its one answered query shows the server
	// has accepted it and is waiting for the next.
	idle, err := net.Dial("tcp", addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	idle.SetDeadline(time.Now().Add(5 * time.Second)) // as the Exchanges above
	co := &dns.Conn{Conn: idle}
	req := new(dns.Msg)
	req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
	if err := co.WriteMsg(req); err != nil {
		t.Fatal(err)
	}
	if _, err := co.ReadMsg(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	cancel()
	if err := <-served; err != nil {
		t.Errorf("Serve after ctx end: %v", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("stop took %v with an idle TCP client", d)
	}
	s.Close()
	s.Close()
	if err := s.Serve(context.Background()); err == nil {
		t.Error("Serve after Close succeeded")
	}
	if _, err := net.ListenPacket("udp", addrs[0]); err != nil {
		t.Errorf("UDP port still bound after Close: %v", err)
	}
}

func TestListenError(t *testing.T) {
	leaktest.Check(t)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	addr := pc.LocalAddr().String()
	s := New(Config{Addr: addr, Upstreams: []string{"127.0.0.1:1"}}, state.NewStore(), nil)
	defer s.Close()
	err = s.Listen()
	if err == nil || !strings.Contains(err.Error(), addr) || !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("Listen on a bound port: %v; want an error naming %s", err, addr)
	}
}

func TestCloseBeforeServe(t *testing.T) {
	leaktest.Check(t)
	s := New(Config{Addr: "127.0.0.1:0", Upstreams: []string{"127.0.0.1:1"}}, state.NewStore(), nil)
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	addr := s.Addr().String()
	s.Close()
	if _, err := net.ListenPacket("udp", addr); err != nil {
		t.Errorf("UDP port still bound after Close: %v", err)
	}
}

func TestDig(t *testing.T) {
	leaktest.Check(t)
	dig, err := exec.LookPath("dig")
	if err != nil {
		t.Skip("dig not installed (Debian package bind9-dnsutils)")
	}
	e := start(t, "client1", nil)
	_, port, _ := net.SplitHostPort(e.addr)
	for _, tt := range []struct{ args, want string }{
		{"svc1.ns1.svc.cluster.local A", "10.96.0.1"},
		{"svc1 A", "10.96.0.1"},
		{"svc1.ns1.svc.cluster.local AAAA", "fd00::1"},
		{"external.test A", "192.0.2.10"},
		{"external.test A +tcp", "192.0.2.10"},
	} {
		args := append([]string{"@127.0.0.1", "-p", port, "+short", "+time=5", "+tries=1"}, strings.Fields(tt.args)...)
		out, err := exec.Command(dig, args...).CombinedOutput()
		if err != nil {
			t.Errorf("dig %s: %v\n%s", tt.args, err, out)
			continue
		}
		if got := strings.TrimSpace(string(out)); got != tt.want {
			t.Errorf("dig %s = %q; want %q", tt.args, got, tt.want)
		}
	}
}

// With OwnFamilies a client gets addresses only of a family it has an address of: an
// IPv4-only pod an empty AAAA answer for a dual-stack service, an IPv6-only pod an empty A
// answer, each NOERROR and authoritative, as dig reads them; by default it gets both.
func TestClientFamilies(t *testing.T) {
	leaktest.Check(t)
	dig, err := exec.LookPath("dig")
	if err != nil {
		t.Skip("dig not installed (Debian package bind9-dnsutils)")
	}
	const name = "svc1.ns1.svc.cluster.local"
	for _, tt := range []struct {
		client      string
		own         bool
		qtype, want string // want: the answer section, "" for none
	}{
		{"client2", true, "A", name + ".\t30\tIN\tA\t10.96.0.1"},
		{"client2", true, "AAAA", ""},
		{"client2", false, "AAAA", name + ".\t30\tIN\tAAAA\tfd00::1"},
		{"client6", true, "A", ""},
		{"client6", true, "AAAA", name + ".\t30\tIN\tAAAA\tfd00::1"},
		{"client6", false, "A", name + ".\t30\tIN\tA\t10.96.0.1"},
		{"client1", true, "AAAA", name + ".\t30\tIN\tAAAA\tfd00::1"},
	} {
		t.Run(fmt.Sprintf("%s/%s/own=%v", tt.client, tt.qtype, tt.own), func(t *testing.T) {
			e := start(t, tt.client, func(c *Config) { c.OwnFamilies = tt.own })
			_, port, _ := net.SplitHostPort(e.addr)
			out, err := exec.Command(dig, "@127.0.0.1", "-p", port, "+time=5", "+tries=1", "+noall", "+comments", "+answer", name, tt.qtype).CombinedOutput()
			if err != nil {
				t.Fatalf("dig: %v\n%s", err, out)
			}
			text := string(out)
			if !strings.Contains(text, "status: NOERROR") || !strings.Contains(text, "flags: qr aa rd ra") {
				t.Errorf("dig %s %s: header %q; want NOERROR, authoritative", name, tt.qtype, text)
			}
			var answers []string
			inAnswer := false
			for _, line := range strings.Split(text, "\n") {
				switch {
				case strings.HasPrefix(line, ";; ANSWER SECTION:"):
					inAnswer = true
				case inAnswer && line != "" && !strings.HasPrefix(line, ";"):
					answers = append(answers, strings.Join(strings.Fields(line), "\t"))
				}
			}
			if got := strings.Join(answers, "\n"); got != tt.want {
				t.Errorf("dig %s %s as %s: answer %q; want %q", name, tt.qtype, tt.client, got, tt.want)
			}
		})
	}
}

// SRV records (_port._proto.service names, the service's named ports) are not in the
// workload API, so the DNS proxy cannot answer them: an SRV query is forwarded, for a mesh
// service's name too, and the client gets the upstream's (the cluster DNS's) answer, not an
// empty authoritative one of ours (docs/CONFIGURATION.md, "DNS proxy").
func TestSRVForwarded(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	for i, name := range []string{"_http._tcp.svc1.ns1.svc.cluster.local.", "svc1.ns1.svc.cluster.local."} {
		resp := e.query(t, "udp", name, dns.TypeSRV, 0)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("SRV %s: %v; want the upstream's one SRV answer", name, resp)
		}
		srv, ok := resp.Answer[0].(*dns.SRV)
		if !ok || srv.Hdr.Name != name || srv.Port != 80 || srv.Target != "svc1.ns1.svc.cluster.local." {
			t.Errorf("SRV %s: answer %v; want the upstream's SRV 0 100 80 svc1.ns1.svc.cluster.local.", name, resp.Answer[0])
		}
		if got := e.up.udp.Load(); got != int32(i+1) {
			t.Errorf("SRV %s: the upstream saw %d queries; want %d (forwarded)", name, got, i+1)
		}
	}
}

// TestConcurrentQueries runs queries over both transports while the store changes under them.
func TestConcurrentQueries(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	st := e.srv.store
	churn := func(i int) {
		st.Apply(&state.Batch{Services: []*state.Service{{Name: "churn", Namespace: "ns1",
			Hostname: "churn.ns1.svc.cluster.local", Addresses: vips("", fmt.Sprintf("10.7.0.%d", i%200+1))}}})
	}
	churn(0)
	stop := make(chan struct{})
	updated := make(chan struct{})
	go func() {
		defer close(updated)
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			churn(i)
			time.Sleep(time.Millisecond)
		}
	}()
	errs := make(chan error, 8)
	for g := range 8 {
		go func() {
			network := []string{"udp", "tcp"}[g%2]
			c := &dns.Client{Net: network, Timeout: 5 * time.Second}
			for i := range 25 {
				name := []string{"svc1.", "churn.", "external.test."}[i%3]
				req := new(dns.Msg)
				req.SetQuestion(name, dns.TypeA)
				resp, _, err := c.Exchange(req, e.addr)
				if err == nil && (resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1) {
					err = fmt.Errorf("%s %s: %s", network, name, summary(resp))
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	close(stop)
	<-updated
}

// TestListenFactory: Config.Listen and ListenPacket open every socket (a pod's netns in
// in-pod mode); "localhost" asks for both loopbacks, and a failing ::1 (a pod without IPv6
// on lo, istio/ztunnel#1707) leaves the IPv4 pair serving.
func TestListenFactory(t *testing.T) {
	leaktest.Check(t)
	var mu sync.Mutex
	var calls []string
	var lc net.ListenConfig
	cfg := Config{
		Addr: "localhost:0", Upstreams: []string{"127.0.0.1:1"},
		Listen: func(ctx context.Context, network, address string) (net.Listener, error) {
			mu.Lock()
			calls = append(calls, network+" "+address)
			mu.Unlock()
			if strings.HasPrefix(address, "[::1]") {
				return nil, errors.New("no IPv6 loopback")
			}
			return lc.Listen(ctx, network, address)
		},
		ListenPacket: func(ctx context.Context, network, address string) (net.PacketConn, error) {
			mu.Lock()
			calls = append(calls, network+" "+address)
			mu.Unlock()
			return lc.ListenPacket(ctx, network, address)
		},
	}
	s := New(cfg, state.NewStore(), nil)
	defer s.Close()
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	port := s.Addr().(*net.UDPAddr).Port
	want := fmt.Sprintf("udp 127.0.0.1:0, tcp 127.0.0.1:%d, udp [::1]:%d, tcp [::1]:%d", port, port, port)
	mu.Lock()
	got := strings.Join(calls, ", ")
	mu.Unlock()
	// Listen retries with a new port when the UDP port it got is taken for TCP (another
	// process may hold it): earlier attempts may come first, each a udp :0 and its tcp.
	if !strings.HasSuffix(got, want) || !strings.HasPrefix(got, "udp 127.0.0.1:0, tcp 127.0.0.1:") {
		t.Errorf("factory calls: %s; want (after any retries) %s", got, want)
	}
}

// A pod's DNS proxy (WorkloadWait) answers a query from a client whose workload reaches the
// store while the query waits, and answers SERVFAIL once the wait is over without it.
func TestUnknownSourceWaits(t *testing.T) {
	leaktest.Check(t)
	// The wait is long enough for a loaded machine to run the late Apply within it.
	e := start(t, "late", func(c *Config) { c.WorkloadWait = 30 * time.Second })
	go func() {
		time.Sleep(300 * time.Millisecond)
		e.srv.store.Apply(&state.Batch{Workloads: []*state.Workload{wl("late", "ns1", true, "10.0.0.9")}})
	}()
	began := time.Now()
	if got := summary(e.query(t, "udp", "svc1.ns1.svc.cluster.local", dns.TypeA, 0)); !strings.HasPrefix(got, "NOERROR aa [svc1.ns1.svc.cluster.local. A 10.96.0.1") {
		t.Errorf("query while the workload arrives: %s", got)
	}
	if d := time.Since(began); d < 250*time.Millisecond {
		t.Errorf("answered in %v, before the workload arrived", d)
	}

	never := start(t, "never", func(c *Config) { c.WorkloadWait = 200 * time.Millisecond })
	began = time.Now()
	if got := summary(never.query(t, "udp", "svc1.ns1.svc.cluster.local", dns.TypeA, 0)); got != "SERVFAIL []" {
		t.Errorf("query from a client that never arrives: %s; want SERVFAIL", got)
	}
	if d := time.Since(began); d < 200*time.Millisecond || d > 10*time.Second {
		t.Errorf("SERVFAIL after %v; want after the 200ms wait (and not much later)", d)
	}
}

// Shutdown answers the queries already taken, a forward to a slow upstream included, before
// it releases the sockets (a draining pod's proxy); Close aborts them.
func TestShutdownAnswersQueriesInFlight(t *testing.T) {
	leaktest.Check(t)
	e := start(t, "client1", nil)
	got := make(chan string, 1)
	go func() {
		req := new(dns.Msg)
		req.SetQuestion("slow.test.", dns.TypeA)
		resp, _, err := (&dns.Client{Net: "udp", Timeout: 5 * time.Second}).Exchange(req, e.addr)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- summary(resp)
	}()
	testutil.Eventually(t, "the query to reach the upstream", func() bool { return e.up.udp.Load() >= 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if g := <-got; g != "NOERROR [slow.test. A 192.0.2.30]" {
		t.Errorf("query in flight at Shutdown: %s; want the upstream's answer", g)
	}
	if c, err := net.Dial("tcp", e.addr); err == nil {
		c.Close()
		t.Error("TCP socket still accepting after Shutdown")
	}
}
