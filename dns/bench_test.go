package dns

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// benchStore is testStore plus 10k unrelated services, so lookups see a realistic index.
func benchStore() *state.Store {
	st := testStore()
	var svcs []*state.Service
	for i := range 10000 {
		svcs = append(svcs, &state.Service{Name: fmt.Sprint("s", i), Namespace: "bulk",
			Hostname:  fmt.Sprintf("s%d.bulk.svc.cluster.local", i),
			Addresses: vips("", netip.AddrFrom4([4]byte{10, 100, byte(i >> 8), byte(i)}).String())})
	}
	st.Apply(&state.Batch{Services: svcs})
	return st
}

func benchServer(b *testing.B) *Server {
	st := benchStore()
	client := st.WorkloadByUID("client1")
	return New(Config{Upstreams: []string{"127.0.0.1:1"}, Source: func(netip.Addr) *state.Workload { return client }},
		st, metrics.New(prometheus.NewRegistry(), "bench"))
}

// BenchmarkAnswer is the handler's work for authoritative A answers (no socket), packed into
// a reused buffer; BenchmarkBaselinePack is the floor: building and packing the same reply
// with miekg/dns alone.
func BenchmarkAnswer(b *testing.B) {
	for _, name := range []string{"svc1.ns1.svc.cluster.local.", "svc1.", "svc1.ns1.svc.cluster.local.ns1.svc.cluster.local."} {
		b.Run(name, func(b *testing.B) {
			s := benchServer(b)
			req := new(dns.Msg)
			req.SetQuestion(name, dns.TypeA)
			client := netip.MustParseAddr("10.0.0.1")
			buf := make([]byte, 0, 512)
			b.ReportAllocs()
			for b.Loop() {
				resp := s.respond(context.Background(), req, client, "udp")
				resp.Truncate(512)
				if _, err := resp.PackBuffer(buf); err != nil || len(resp.Answer) == 0 {
					b.Fatal(err, resp)
				}
			}
		})
	}
}

func BenchmarkBaselinePack(b *testing.B) {
	req := new(dns.Msg)
	req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
	ip := netip.MustParseAddr("10.96.0.1")
	buf := make([]byte, 0, 512)
	b.ReportAllocs()
	for b.Loop() {
		resp := new(dns.Msg)
		resp.SetReply(req)
		resp.Answer = append(resp.Answer, &dns.A{
			Hdr: dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: TTL},
			A:   ip.AsSlice(),
		})
		resp.Truncate(512)
		if _, err := resp.PackBuffer(buf); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUDP is one query/answer over loopback UDP through the proxy; the baseline is a
// bare miekg server replying with a fixed answer, measured the same way.
func BenchmarkUDP(b *testing.B) {
	run := func(b *testing.B, addr string) {
		c, err := net.Dial("udp", addr)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		co := &dns.Conn{Conn: c}
		req := new(dns.Msg)
		req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
		b.ReportAllocs()
		for b.Loop() {
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if err := co.WriteMsg(req); err != nil {
				b.Fatal(err)
			}
			resp, err := co.ReadMsg()
			if err != nil || len(resp.Answer) != 1 {
				b.Fatal(err, resp)
			}
		}
	}
	b.Run("proxy", func(b *testing.B) {
		st := benchStore()
		client := st.WorkloadByUID("client1")
		s := New(Config{Addr: "127.0.0.1:0", Upstreams: []string{"127.0.0.1:1"},
			Source: func(netip.Addr) *state.Workload { return client }}, st, metrics.New(prometheus.NewRegistry(), "bench"))
		if err := s.Listen(); err != nil {
			b.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- s.Serve(context.Background()) }()
		defer func() { s.Close(); <-done }()
		run(b, s.Addr().String())
	})
	b.Run("baseline-static", func(b *testing.B) {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		ip := netip.MustParseAddr("10.96.0.1")
		srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
			resp := new(dns.Msg)
			resp.SetReply(req)
			resp.Answer = append(resp.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: TTL},
				A:   ip.AsSlice(),
			})
			w.WriteMsg(resp)
		})}
		runServers(b, srv)
		run(b, pc.LocalAddr().String())
	})
}
