//go:build linux

package dns

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/podpoll"
	"github.com/gozt/gozt/xds/state"
)

// TestPolled runs the serving tests again with a node-wide poller (in-pod mode's) waiting on
// the sockets instead of a goroutine per socket.
func TestPolled(t *testing.T) {
	p, err := podpoll.New()
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
// it, byte for byte, with a goroutine per socket and with testPoller (TestPolled's podpoll).
func testMalformed(t *testing.T) {
	st := testStore()
	src := func(netip.Addr) *state.Workload { return st.WorkloadByUID("client1") }
	cfg := Config{Addr: "127.0.0.1:0", Upstreams: []string{"127.0.0.1:1"}, Source: src}
	run := func(poller Poller) string {
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
	servers := map[string]string{"goroutine per socket": run(nil), "podpoll": run(testPoller)}
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
