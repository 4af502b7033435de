//go:build linux

package dns

import (
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/xds/state"
)

// TestPolled runs the serving tests again with a node-wide poller (in-pod mode's) waiting on
// the sockets instead of a goroutine per socket.
func TestPolled(t *testing.T) {
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	testPoller = p
	defer func() { testPoller = nil }()
	for name, test := range map[string]func(*testing.T){
		"Answers": TestAnswers, "ClientNamespace": TestClientNamespace, "ClientNetwork": TestClientNetwork,
		"DisableIPv6": TestDisableIPv6, "UnknownSourceServfail": TestUnknownSourceServfail,
		"EDNSEcho": TestEDNSEcho, "Truncation": TestTruncation, "ForwardFailure": TestForwardFailure,
		"Metrics": TestMetrics, "ListenServeClose": TestListenServeClose, "Dig": TestDig,
		"ConcurrentQueries": TestConcurrentQueries, "UnknownSourceWaits": TestUnknownSourceWaits,
		"Malformed": testMalformed, "ShutdownAnswersQueriesInFlight": TestShutdownAnswersQueriesInFlight,
	} {
		t.Run(name, test)
	}
}

// miekgHandler answers through miekg/dns's server with s's answers: the reference
// testMalformed holds Serve's own reading and framing to.
type miekgHandler struct{ s *Server }

func (h miekgHandler) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	proto := "udp"
	if _, ok := w.LocalAddr().(*net.TCPAddr); ok {
		proto = "tcp"
	}
	var client netip.Addr
	switch a := w.RemoteAddr().(type) {
	case *net.UDPAddr:
		client = a.AddrPort().Addr().Unmap()
	case *net.TCPAddr:
		client = a.AddrPort().Addr().Unmap()
	}
	w.WriteMsg(h.s.reply(req, client, proto))
}

// testMalformed: what is not a well-formed query gets the answer miekg/dns's server gives
// it, byte for byte, with a goroutine per socket and with testPoller (TestPolled's epoll poller).
func testMalformed(t *testing.T) {
	st := testStore()
	src := func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }
	cfg := Config{Addr: "127.0.0.1:0", Upstreams: []string{"127.0.0.1:1"}, Source: src}
	run := func(poller netpoll.Poller) string {
		cfg := cfg
		cfg.Poller = poller
		s := New(cfg, st, nil)
		if err := s.Listen(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- s.Serve(context.Background()) }()
		t.Cleanup(func() { s.Close(); <-done })
		return s.Addr().String()
	}
	ref := New(cfg, st, nil)
	t.Cleanup(func() { ref.Close() })
	pc, ln, err := ref.listenPair("127.0.0.1", "0")
	if err != nil {
		t.Fatal(err)
	}
	h := miekgHandler{ref}
	// As Serve read before it did so itself: a 4 KiB UDP buffer, TCP reads bounded by tcpTimeout.
	runServers(t, &dns.Server{PacketConn: pc, Handler: h, UDPSize: udpReadSize},
		&dns.Server{Listener: ln, Handler: h, ReadTimeout: ref.tcpTimeout, IdleTimeout: func() time.Duration { return ref.tcpTimeout }})
	miekg := pc.LocalAddr().String()
	servers := map[string]string{"goroutine per socket": run(nil), "epoll": run(testPoller)}
	q := func(mod func(*dns.Msg)) []byte {
		m := new(dns.Msg)
		m.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
		m.Id = 4242
		mod(m)
		b, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	good := q(func(*dns.Msg) {})
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"well formed", good},
		{"response", q(func(m *dns.Msg) { m.Response = true })},
		{"update", q(func(m *dns.Msg) { m.Opcode = dns.OpcodeUpdate })},
		{"two questions", q(func(m *dns.Msg) { m.Question = append(m.Question, m.Question[0]) })},
		{"truncated question", good[:len(good)-3]},
		{"header only", good[:12]},
		{"short", good[:5]},
		// Cut to the 4 KiB read over UDP, whole over TCP.
		{"longer than 4 KiB", q(func(m *dns.Msg) {
			m.SetEdns0(4096, false)
			opt := m.IsEdns0()
			opt.Option = append(opt.Option, &dns.EDNS0_PADDING{Padding: make([]byte, 5000)})
		})},
	} {
		for _, network := range []string{"udp", "tcp"} {
			want, wantErr := exchangeRaw(t, network, miekg, tc.msg)
			for name, addr := range servers {
				got, gotErr := exchangeRaw(t, network, addr, tc.msg)
				if string(got) != string(want) || (gotErr == nil) != (wantErr == nil) {
					t.Errorf("%s over %s, %s: got %x (%v); miekg/dns's server %x (%v)", tc.name, network, name, got, gotErr, want, wantErr)
				}
			}
		}
	}
}

// exchangeRaw sends msg and returns the raw answer, or an error when none comes in 300 ms.
func exchangeRaw(t *testing.T, network, addr string, msg []byte) ([]byte, error) {
	t.Helper()
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	co := &dns.Conn{Conn: c}
	if _, err := co.Write(msg); err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	if network == "udp" {
		n, err := c.Read(buf)
		return buf[:n], err
	}
	n, err := co.Read(buf)
	return buf[:n], err
}

// testPollers are the two Pollers a Server runs with: nil, a goroutine per socket, and p.
func testPollers(p netpoll.Poller) []struct {
	name   string
	poller netpoll.Poller
} {
	return []struct {
		name   string
		poller netpoll.Poller
	}{{"goroutine per socket", nil}, {"epoll", p}}
}

// A DNS proxy bound to a wildcard answers a query from the address it was sent to: a stub
// resolver's connected UDP socket, as the client's here, drops an answer from any other, and
// the kernel would send the answer to a query for 127.0.0.2 from 127.0.0.1. On an IPv4
// socket (IP_PKTINFO) and a dual-stack one (IPV6_PKTINFO, v4-mapped for IPv4 clients).
func TestWildcardAnswersFromDestination(t *testing.T) {
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var lc net.ListenConfig
	udp4 := func(ctx context.Context, _, address string) (net.PacketConn, error) {
		return lc.ListenPacket(ctx, "udp4", address)
	}
	for _, tc := range []struct {
		name         string
		addr         string
		listenPacket func(ctx context.Context, network, address string) (net.PacketConn, error)
		dsts         []string
	}{
		{"0.0.0.0 dual-stack", "0.0.0.0:0", nil, []string{"127.0.0.2"}}, // Go binds "udp" 0.0.0.0 as [::]
		{"0.0.0.0 udp4", "0.0.0.0:0", udp4, []string{"127.0.0.2"}},
		{"[::]", "[::]:0", nil, []string{"127.0.0.2", "::1"}},
	} {
		for _, pp := range testPollers(p) {
			t.Run(tc.name+"/"+pp.name, func(t *testing.T) {
				if tc.addr == "[::]:0" {
					ln, err := net.Listen("tcp", "[::1]:0")
					if err != nil {
						t.Skipf("no IPv6 loopback (::1) to ask at: %v", err)
					}
					ln.Close()
				}
				leaktest.Check(t)
				st := testStore()
				s := New(Config{Addr: tc.addr, Upstreams: []string{"127.0.0.1:1"}, ListenPacket: tc.listenPacket, Poller: pp.poller,
					Source: func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }}, st, nil)
				if err := s.Listen(); err != nil {
					t.Fatal(err)
				}
				served := make(chan error, 1)
				go func() { served <- s.Serve(context.Background()) }()
				defer func() { s.Close(); <-served }()
				port := uint16(s.Addr().(*net.UDPAddr).Port)
				for _, dst := range tc.dsts {
					c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(dst), port)))
					if err != nil {
						t.Fatal(err)
					}
					defer c.Close()
					c.SetDeadline(time.Now().Add(2 * time.Second))
					co := &dns.Conn{Conn: c}
					req := new(dns.Msg)
					req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
					if err := co.WriteMsg(req); err != nil {
						t.Fatal(err)
					}
					if resp, err := co.ReadMsg(); err != nil || len(resp.Answer) != 1 {
						t.Errorf("query to %s: %v %v; want the answer, from %s", dst, resp, err, dst)
					}
				}
			})
		}
	}
}

// Close with queries in flight over UDP and TCP, and an idle TCP client: the queries are
// answered (SERVFAIL, as Close ends their wait for the client's workload), Serve returns and
// leaves no goroutine or file descriptor behind.
func TestServeStopsWithQueriesInFlight(t *testing.T) {
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, pp := range testPollers(p) {
		t.Run(pp.name, func(t *testing.T) {
			leaktest.Check(t)
			fds, err := os.ReadDir("/proc/self/fd")
			if err != nil {
				t.Skipf("no /proc/self/fd to count: %v", err)
			}
			var asked atomic.Int32
			s := New(Config{Addr: "127.0.0.1:0", Upstreams: []string{"127.0.0.1:1"}, Poller: pp.poller, WorkloadWait: time.Minute,
				Source: func(netip.Addr) *state.Workload { asked.Add(1); return nil }}, state.NewStore(), nil)
			if err := s.Listen(); err != nil {
				t.Fatal(err)
			}
			served := make(chan error, 1)
			go func() { served <- s.Serve(context.Background()) }()
			addr := s.Addr().String()
			idle, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			const n = 8
			answers := make(chan string, n)
			for i := range n {
				network := []string{"udp", "tcp"}[i%2]
				go func() {
					req := new(dns.Msg)
					req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
					resp, _, err := (&dns.Client{Net: network, Timeout: 10 * time.Second}).Exchange(req, addr)
					if err != nil {
						answers <- network + ": " + err.Error()
						return
					}
					answers <- network + ": " + dns.RcodeToString[resp.Rcode]
				}()
			}
			// Each query asks twice before it waits: at once, and again once it follows the
			// store (awaitSource). Fewer asks would leave a query unread at Close.
			testutil.Eventually(t, "the queries to wait for their client's workload", func() bool { return asked.Load() >= 2*n })
			s.Close()
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
			for range n {
				if a := <-answers; !strings.HasSuffix(a, ": SERVFAIL") {
					t.Errorf("query in flight at Close: %s; want SERVFAIL", a)
				}
			}
			idle.Close()
			if after, _ := os.ReadDir("/proc/self/fd"); len(after) != len(fds) {
				t.Errorf("%d file descriptors open after Close; %d before Listen", len(after), len(fds))
			}
		})
	}
}
