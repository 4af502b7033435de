package dns

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/xds/state"
)

func TestAliases(t *testing.T) {
	s := New(Config{}, state.NewStore(), nil)
	client := &state.Workload{WorkloadMeta: &state.WorkloadMeta{Namespace: "ns1"}}
	for _, tt := range []struct {
		name string
		want []alias
	}{
		{"name", []alias{{"name", ""}, {"name.ns1.svc.cluster.local", ""}}},
		{"name.ns2", []alias{{"name.ns2", ""}, {"name.ns2.svc.cluster.local", ""}, {"name.ns2.ns1.svc.cluster.local", ""}}},
		{"name.ns2.svc", []alias{{"name.ns2.svc", ""}, {"name.ns2.svc.cluster.local", ""}, {"name.ns2.svc.svc.cluster.local", ""}}},
		{"name.ns2.other", []alias{{"name.ns2.other", ""}, {"name.ns2.other.svc.cluster.local", ""}}},
		{"pod.sub.ns.svc", []alias{{"pod.sub.ns.svc", ""}, {"pod.sub.ns.svc.cluster.local", ""}}},
		{"pod.sub.ns.other", []alias{{"pod.sub.ns.other", ""}}},
		{"name.ns2.svc.cluster.local", []alias{{"name.ns2.svc.cluster.local", ""},
			{"name.ns2", "name.ns2"}, {"name.ns2.ns1.svc.cluster.local", "name.ns2"},
			{"name.ns2.svc", "name.ns2.svc"}, {"name.ns2.svc.svc.cluster.local", "name.ns2.svc"}}},
		{"x.ns1.svc.cluster.local", []alias{{"x.ns1.svc.cluster.local", ""}, {"x", "x"},
			{"x.ns1", "x.ns1"}, {"x.ns1.ns1.svc.cluster.local", "x.ns1"}, {"x.ns1.svc", "x.ns1.svc"},
			{"x.ns1.svc.svc.cluster.local", "x.ns1.svc"}}},
		{"cluster.local", []alias{{"cluster.local", ""}, {"cluster.local.svc.cluster.local", ""}, {"cluster.local.ns1.svc.cluster.local", ""}}},
	} {
		var got []alias
		s.eachAlias(client, tt.name, func(a alias) bool { got = append(got, a); return true })
		if !slices.Equal(got, tt.want) {
			t.Errorf("aliases(%q):\n got %v\nwant %v", tt.name, got, tt.want)
		}
	}
}

func TestTrimDomain(t *testing.T) {
	for _, tt := range []struct {
		name, domain, want string
		ok                 bool
	}{
		{"a.b.c", "b.c", "a", true},
		{"a.b.c", "a.b.c", "", false},
		{"ab.c", "b.c", "", false},
		{"a.b.c", "", "", false},
		{"x.a.b.c", "b.c", "x.a", true},
	} {
		got, ok := trimDomain(tt.name, tt.domain)
		if got != tt.want || ok != tt.ok {
			t.Errorf("trimDomain(%q, %q) = %q, %v; want %q, %v", tt.name, tt.domain, got, ok, tt.want, tt.ok)
		}
	}
}

// logRecorder keeps debug records.
type logRecorder struct{ recs []slog.Record }

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.recs = append(r.recs, rec)
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

func TestQueryLog(t *testing.T) {
	st := testStore()
	rec := &logRecorder{}
	s := New(Config{Logger: slog.New(rec), Source: func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }}, st, nil)
	req := new(dns.Msg)
	req.SetQuestion("headless.ns1.svc.cluster.local.", dns.TypeA)
	s.respond(context.Background(), req, netip.MustParseAddr("10.0.0.1"), "udp")
	if len(rec.recs) != 1 {
		t.Fatalf("%d records; want 1", len(rec.recs))
	}
	got := map[string]string{}
	rec.recs[0].Attrs(func(a slog.Attr) bool {
		got[a.Key] = a.Value.String()
		return true
	})
	want := map[string]string{"src.workload": "client1", "src.namespace": "ns1", "query": "A",
		"domain": "headless.ns1.svc.cluster.local.", "result": "success", "endpoints": "2"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("log %s = %q; want %q (record %v)", k, got[k], v, got)
		}
	}
	if rec.recs[0].Level != slog.LevelDebug {
		t.Errorf("level %v; want DEBUG", rec.recs[0].Level)
	}
}

func TestNotAQuery(t *testing.T) {
	s := New(Config{}, state.NewStore(), nil)
	req := new(dns.Msg)
	req.SetQuestion("a.", dns.TypeA)
	req.Opcode = dns.OpcodeUpdate
	if resp := s.respond(context.Background(), req, netip.Addr{}, "udp"); resp.Rcode != dns.RcodeNotImplemented {
		t.Errorf("update: rcode %s; want NOTIMP", dns.RcodeToString[resp.Rcode])
	}
	req = new(dns.Msg)
	if resp := s.respond(context.Background(), req, netip.Addr{}, "udp"); resp.Rcode != dns.RcodeFormatError {
		t.Errorf("no question: rcode %s; want FORMERR", dns.RcodeToString[resp.Rcode])
	}
}

// TestTCPTimeout checks both halves of the TCP request timeout: a client that sends nothing
// is dropped, and a request whose upstream never answers gets SERVFAIL, both after
// tcpTimeout (shortened here) rather than UpstreamTimeout.
func TestTCPTimeout(t *testing.T) {
	leaktest.Check(t)
	defer func(d time.Duration) { tcpTimeout = d }(tcpTimeout)
	tcpTimeout = 300 * time.Millisecond
	black, err := net.ListenPacket("udp", "127.0.0.1:0") // reads nothing, answers nothing
	if err != nil {
		t.Fatal(err)
	}
	defer black.Close()
	e := start(t, "client1", func(c *Config) {
		c.Upstreams = []string{black.LocalAddr().String()}
		c.UpstreamTimeout = time.Minute
	})

	t0 := time.Now()
	if got := summary(e.query(t, "tcp", "external.test", dns.TypeA, 0)); got != "SERVFAIL []" {
		t.Errorf("TCP query to a silent upstream: %s; want SERVFAIL", got)
	}
	if d := time.Since(t0); d < tcpTimeout || d > 10*tcpTimeout {
		t.Errorf("SERVFAIL after %v; want about %v", d, tcpTimeout)
	}

	c, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	t0 = time.Now()
	n, err := c.Read(make([]byte, 1))
	if err == nil || n != 0 || time.Since(t0) > 10*tcpTimeout {
		t.Errorf("idle TCP client: read %d, %v after %v; want the server to close it", n, err, time.Since(t0))
	}
}

// TestHeadlessTruncated: many endpoints over UDP without EDNS are truncated, not dropped.
func TestHeadlessTruncated(t *testing.T) {
	leaktest.Check(t)
	st := state.NewStore()
	client := wl("client1", "ns1", true, "10.0.0.1")
	ws := []*state.Workload{client}
	for i := range 100 {
		w := wl("big-"+string(rune('a'+i/26))+string(rune('a'+i%26)), "ns1", true, netip.AddrFrom4([4]byte{10, 9, byte(i / 250), byte(i%250 + 1)}).String())
		w.Services = map[string]map[uint16]uint16{"ns1/big.ns1.svc.cluster.local": {80: 80}}
		ws = append(ws, w)
	}
	st.Apply(&state.Batch{Workloads: ws, Services: []*state.Service{{Name: "big", Namespace: "ns1", Hostname: "big.ns1.svc.cluster.local"}}})
	s := New(Config{Source: func(netip.Addr) *state.Workload { return client }}, st, nil)
	req := new(dns.Msg)
	req.SetQuestion("big.ns1.svc.cluster.local.", dns.TypeA)
	resp := s.respond(context.Background(), req, netip.Addr{}, "udp")
	if len(resp.Answer) != 100 {
		t.Fatalf("%d answers; want 100", len(resp.Answer))
	}
	resp.Truncate(udpSize(req))
	b, err := resp.Pack()
	if err != nil || len(b) > 512 || !resp.Truncated {
		t.Errorf("truncated to %d bytes, tc=%v, err %v; want <= 512 with TC", len(b), resp.Truncated, err)
	}
}

func FuzzHandler(f *testing.F) {
	st := testStore()
	up := startUpstream(f)
	s := New(Config{Upstreams: []string{up.addr}, UpstreamTimeout: 200 * time.Millisecond,
		Source: func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }}, st, nil)
	if err := s.loadResolvConf(); err != nil {
		f.Fatal(err)
	}
	for _, name := range []string{"svc1.", "svc1.ns1.svc.cluster.local.ns1.svc.cluster.local.", "foo.wild.example.com.",
		"headless.ns1.svc.cluster.local.", "external.test.", "big.test.", "."} {
		for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA, dns.TypeTXT} {
			m := new(dns.Msg)
			m.SetQuestion(name, qt)
			m.SetEdns0(1232, true)
			b, _ := m.Pack()
			f.Add(b)
		}
	}
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, 40))
	f.Fuzz(func(t *testing.T, data []byte) {
		req := new(dns.Msg)
		if err := req.Unpack(data); err != nil {
			return // the server drops what it cannot parse
		}
		for _, proto := range []string{"udp", "tcp"} {
			resp := s.respond(context.Background(), req, netip.MustParseAddr("10.0.0.1"), proto)
			if resp == nil {
				t.Fatal("nil response")
			}
			if resp.Id != req.Id {
				t.Fatalf("response id %d; want %d", resp.Id, req.Id)
			}
			if proto == "udp" {
				resp.Truncate(udpSize(req))
			}
			if _, err := resp.Pack(); err != nil {
				t.Fatalf("response does not pack: %v\n%v", err, resp)
			}
		}
	})
}
