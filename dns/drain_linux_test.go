//go:build linux

package dns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/xds/state"
)

// heldUpstream answers held.test. only once release is closed, counting the queries it
// holds, and refuses everything else: the upstream of a DNS proxy whose drain a query in
// flight keeps open.
type heldUpstream struct {
	addr    string
	held    atomic.Int32
	release chan struct{}
}

func startHeldUpstream(t *testing.T) *heldUpstream {
	t.Helper()
	u := &heldUpstream{release: make(chan struct{})}
	pc, ln, err := New(Config{}, nil, nil).listenPair("127.0.0.1", "0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = pc.LocalAddr().String()
	h := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		resp := new(dns.Msg)
		resp.SetReply(req)
		if req.Question[0].Name == "held.test." {
			u.held.Add(1)
			<-u.release
			resp.Answer = append(resp.Answer, mustRR(t, "held.test. 60 IN A 192.0.2.99"))
		} else {
			resp.Rcode = dns.RcodeRefused
		}
		w.WriteMsg(resp)
	})
	runServers(t, &dns.Server{PacketConn: pc, Handler: h}, &dns.Server{Listener: ln, Handler: h})
	t.Cleanup(u.let) // before the servers' shutdown (cleanups run last first)
	return u
}

// let answers the held queries; it is idempotent.
func (u *heldUpstream) let() {
	select {
	case <-u.release:
	default:
		close(u.release)
	}
}

// askIn sends one query for name from a fresh socket in ns (a fresh source port, so the
// kernel's SO_REUSEPORT hash picks a proxy anew) and returns a summary of the answer, or
// the error.
func askIn(ns *netns.NetNS, network, addr, name string, timeout time.Duration) string {
	var c net.Conn
	err := ns.Do(func() (err error) {
		c, err = net.DialTimeout(network, addr, timeout)
		return err
	})
	if err != nil {
		return "dial: " + err.Error()
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	co := &dns.Conn{Conn: c}
	req := new(dns.Msg)
	req.SetQuestion(name, dns.TypeA)
	if err := co.WriteMsg(req); err != nil {
		return "write: " + err.Error()
	}
	resp, err := co.ReadMsg()
	if err != nil {
		return "read: " + err.Error()
	}
	return summary(resp)
}

// Two DNS proxies share 127.0.0.1:port and [::1]:port in one SO_REUSEPORT group, UDP and
// TCP, as an old and a new ztunnel share a pod's 15053 during an upgrade. The old one
// drains while queries it took are still being forwarded, in the middle of a stream of
// queries from fresh source ports: every query of the stream is answered within a
// resolver's timeout (by the new proxy once the old one has left the group), and the
// queries in flight on the old one are answered too. Each proxy is run with a goroutine
// per socket and with the node-wide poller.
func TestShutdownLeavesReusePortGroup(t *testing.T) {
	ns := netnstest.NewAnonymous(t)
	// As in-pod mode sets it in each pod: handshakes the kernel queued on the old TCP
	// listener move to the new one when it closes.
	if err := ns.Do(func() error {
		return os.WriteFile("/proc/sys/net/ipv4/tcp_migrate_req", []byte("1"), 0)
	}); err != nil {
		t.Fatalf("tcp_migrate_req: %v", err)
	}
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, pp := range testPollers(p) {
		t.Run(pp.name, func(t *testing.T) {
			leaktest.Check(t)
			testShutdownLeavesReusePortGroup(t, ns, pp.poller)
		})
	}
}

func testShutdownLeavesReusePortGroup(t *testing.T, ns *netns.NetNS, poller netpoll.Poller) {
	sockets := netns.Sockets{NS: ns, ReusePort: true}
	st := testStore()
	var asked [2]atomic.Int32 // queries each proxy took
	ups := [2]*heldUpstream{startHeldUpstream(t), startHeldUpstream(t)}
	close(ups[1].release) // the new proxy's upstream answers at once
	var servers [2]*Server
	var served [2]chan error
	addr := "localhost:0"
	for i := range servers {
		s := New(Config{Addr: addr, Upstreams: []string{ups[i].addr}, UpstreamTimeout: time.Minute, Poller: poller,
			Listen: sockets.Listen, ListenPacket: sockets.ListenPacket,
			Source: func(netip.Addr) *state.Workload { asked[i].Add(1); return st.WorkloadByUID("client1") }}, st, nil)
		s.tcpTimeout = time.Minute // nor does a TCP query's own bound end the held ones
		if err := s.Listen(); err != nil {
			t.Fatal(err)
		}
		servers[i], served[i] = s, make(chan error, 1)
		go func() { served[i] <- s.Serve(context.Background()) }()
		t.Cleanup(func() {
			s.Close()
			if err := <-served[i]; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
		addr = s.Addr().String()
		addr = "localhost:" + addr[strings.LastIndexByte(addr, ':')+1:]
	}
	old := servers[0]
	var targets []string // where the clients ask, each family the namespace's loopback has
	for _, pc := range old.udp {
		targets = append(targets, pc.LocalAddr().String())
	}
	if len(targets) < 2 {
		t.Logf("no IPv6 loopback in the namespace: IPv4 only")
	}

	const svc = "svc1.ns1.svc.cluster.local."
	const timeout = 2 * time.Second // a resolver's, shorter than the drain the held queries keep open
	// Both proxies take queries before the drain: the kernel spreads them over the group.
	for i := 0; asked[0].Load() == 0 || asked[1].Load() == 0; i++ {
		if i == 200 {
			t.Fatalf("200 queries reached the proxies %d and %d times; want both in one group", asked[0].Load(), asked[1].Load())
		}
		if got := askIn(ns, "udp", targets[0], svc, timeout); !strings.HasPrefix(got, "NOERROR") {
			t.Fatalf("query before the drain: %s", got)
		}
	}

	// A query of each protocol in flight on the old proxy: forwarded, its upstream holds it.
	var inflight []chan string
	for _, network := range []string{"udp", "tcp"} {
		for i := 0; ; i++ {
			if i == 100 {
				t.Fatalf("%s: 100 queries for held.test. did not reach the old proxy", network)
			}
			before := ups[0].held.Load()
			got := make(chan string, 1)
			go func() { got <- askIn(ns, network, targets[0], "held.test.", 30*time.Second) }()
			var answer string
			testutil.Eventually(t, "the held query to reach an upstream", func() bool {
				select {
				case answer = <-got: // the new proxy took it
					return true
				default:
					return ups[0].held.Load() > before
				}
			})
			if answer == "" {
				inflight = append(inflight, got)
				break
			}
		}
	}

	// The stream: queries of each protocol and family in turn, 32 at a time, each from a
	// fresh socket; the old proxy drains once a quarter of them are sent, so that some are
	// queued on its sockets, or on their way, when it leaves its group.
	type query struct{ network, target string }
	var queries []query
	for range 96 {
		for _, target := range targets {
			for _, network := range []string{"udp", "tcp"} {
				queries = append(queries, query{network, target})
			}
		}
	}
	work := make(chan query)
	var failures sync.Map // "network target: answer" -> count
	var failed atomic.Int32
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for q := range work {
				if got := askIn(ns, q.network, q.target, svc, timeout); got != "NOERROR aa ["+svc+" A 10.96.0.1]" {
					failed.Add(1)
					if strings.HasSuffix(got, "i/o timeout") {
						got = "no answer in " + timeout.String()
					}
					n, _ := failures.LoadOrStore(fmt.Sprintf("%s %s: %s", q.network, q.target, got), new(atomic.Int32))
					n.(*atomic.Int32).Add(1)
				}
			}
		})
	}
	drained := make(chan error, 1)
	var freshBefore int32
	for i, q := range queries {
		if i == len(queries)/4 {
			freshBefore = asked[1].Load()
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				drained <- old.Shutdown(ctx)
			}()
		}
		work <- q
	}
	close(work)
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of the stream's %d queries went unanswered (%s):", n, len(queries), migrateCounters(ns))
		failures.Range(func(k, v any) bool {
			t.Errorf("  %dx %s", v.(*atomic.Int32).Load(), k)
			return true
		})
	}
	if asked[1].Load() == freshBefore {
		t.Error("the new proxy answered none of the queries sent after the drain began")
	}
	select {
	case <-drained:
		t.Fatal("the old proxy's drain ended before its held queries were answered; the stream did not test the drain")
	default:
	}

	ups[0].let()
	for _, got := range inflight {
		if g := <-got; g != "NOERROR [held.test. A 192.0.2.99]" {
			t.Errorf("query in flight on the old proxy at its drain: %s; want the upstream's answer", g)
		}
	}
	if err := <-drained; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	if got := askIn(ns, "tcp", targets[0], svc, timeout); !strings.HasPrefix(got, "NOERROR") {
		t.Errorf("query after the drain: %s", got)
	}
}

// migrateCounters reports the kernel's count of connections it moved from a closed listener
// to another of its SO_REUSEPORT group (tcp_migrate_req) and of those it could not move,
// which it resets: a handshake that completes on a listener as it closes is one.
func migrateCounters(ns *netns.NetNS) string {
	var out []string
	ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/netstat")
		if err != nil {
			return err
		}
		lines := strings.Split(string(b), "\n")
		for i := 0; i+1 < len(lines); i += 2 {
			k, v := strings.Fields(lines[i]), strings.Fields(lines[i+1])
			for j := range min(len(k), len(v)) {
				if strings.HasPrefix(k[j], "TCPMigrateReq") {
					out = append(out, k[j]+" "+v[j])
				}
			}
		}
		return nil
	})
	return strings.Join(out, ", ")
}

// A draining proxy's TCP clients: one that connected before the drain and sends its first
// query after it began gets its answer; one that has had its answer and is idle is let go
// at once, without holding the drain for its idle timeout.
func TestShutdownTCPClients(t *testing.T) {
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// An idle client must be let go by the drain, not by its idle timeout.
	defer func(d time.Duration) { tcpTimeout = d }(tcpTimeout)
	tcpTimeout = time.Minute
	for _, pp := range testPollers(p) {
		t.Run(pp.name, func(t *testing.T) {
			leaktest.Check(t)
			e := start(t, "client1", func(c *Config) { c.Poller = pp.poller })
			dial := func() *dns.Conn {
				c, err := net.Dial("tcp", e.addr)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				c.SetDeadline(time.Now().Add(30 * time.Second))
				return &dns.Conn{Conn: c}
			}
			ask := func(co *dns.Conn) string {
				req := new(dns.Msg)
				req.SetQuestion("svc1.ns1.svc.cluster.local.", dns.TypeA)
				if err := co.WriteMsg(req); err != nil {
					return err.Error()
				}
				resp, err := co.ReadMsg()
				if err != nil {
					return err.Error()
				}
				return summary(resp)
			}
			const want = "NOERROR aa [svc1.ns1.svc.cluster.local. A 10.96.0.1]"
			idle := dial()
			if got := ask(idle); got != want {
				t.Fatalf("idle client's query: %s", got)
			}
			fresh := dial()
			testutil.Eventually(t, "both clients to be accepted", func() bool {
				e.srv.mu.Lock()
				defer e.srv.mu.Unlock()
				return len(e.srv.conns) == 2
			})

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			drained := make(chan error, 1)
			go func() { drained <- e.srv.Shutdown(ctx) }()
			if _, err := idle.ReadMsg(); err == nil {
				t.Error("the idle client was sent a message; want its connection closed")
			} else if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
				t.Error("the idle client's connection still open 30s into the drain")
			}
			if got := ask(fresh); got != want {
				t.Errorf("first query of a client accepted before the drain, sent during it: %s; want the answer", got)
			}
			select {
			case err := <-drained:
				if err != nil {
					t.Errorf("Shutdown: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Shutdown still waiting 30s after its clients were answered")
			}
		})
	}
}
