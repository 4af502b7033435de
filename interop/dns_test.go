//go:build linux

package interop

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/miekg/dns"
)

// upstreamAnswer is what the test's upstream nameserver answers for upstream.example.
const upstreamAnswer = "192.0.2.10"

// TestDNS asks both programs' DNS proxies (15053, dedicated mode, node A's workload as the
// client) the same questions for the same config, with the same upstream nameserver behind
// them, and compares the answers: mesh names in full and by search domain, a family with no
// address, names the mesh does not know.
func TestDNS(t *testing.T) {
	requirePeers(t)
	questions := []struct {
		name  string
		qtype uint16
	}{
		{"echo.default.svc.cluster.local.", dns.TypeA},
		{"echo.default.svc.cluster.local.", dns.TypeAAAA},
		{"echo.default.svc.", dns.TypeA},
		{"echo.default.", dns.TypeA},
		{"echo.", dns.TypeA},
		{"nope.default.svc.cluster.local.", dns.TypeA},
		{"upstream.example.", dns.TypeA},
		{"missing.example.", dns.TypeA},
	}
	answers := map[string]map[string]string{} // question -> program -> answer
	for _, prog := range []string{gozt, rs} {
		t.Run(prog, func(t *testing.T) {
			m := newHosts(t)
			serveUpstream(t, m.a)
			startNode(t, prog, m.a, m.dedicatedEnv(prog, "node-a", "default/client/client"))
			for _, q := range questions {
				key := fmt.Sprintf("%s %s", dns.TypeToString[q.qtype], q.name)
				if answers[key] == nil {
					answers[key] = map[string]string{}
				}
				answers[key][prog] = ask(t, m.a, q.name, q.qtype)
			}
		})
	}
	if t.Failed() {
		return
	}
	// The mesh's own name must resolve to the service VIP on both.
	if got := answers["A echo.default.svc.cluster.local."]; got[gozt] != "NOERROR A "+echoVIP || got[rs] != got[gozt] {
		t.Errorf("A echo.default.svc.cluster.local.: gozt %q, rs %q; want NOERROR A %s from both", got[gozt], got[rs], echoVIP)
	}
	var diffs []string
	for _, q := range slices.Sorted(func(yield func(string) bool) {
		for k := range answers {
			if !yield(k) {
				return
			}
		}
	}) {
		t.Logf("%-40s gozt: %-30s rs: %s", q, answers[q][gozt], answers[q][rs])
		if answers[q][gozt] != answers[q][rs] {
			diffs = append(diffs, fmt.Sprintf("%s: gozt=%s, rs=%s", q, answers[q][gozt], answers[q][rs]))
		}
	}
	checkDifferences(t, "dns", diffs)
}

// ask sends one question to 127.0.0.1:15053 over UDP from inside h and returns the answer
// as "RCODE TYPE VALUE ..." (answers sorted), or "error: ...".
func ask(t *testing.T, h *host, name string, qtype uint16) string {
	t.Helper()
	return askAt(t, h, "127.0.0.1:15053", name, qtype)
}

// askAt is ask with the question sent to server (host:port) instead.
func askAt(t *testing.T, h *host, server, name string, qtype uint16) string {
	t.Helper()
	q := new(dns.Msg)
	q.SetQuestion(name, qtype)
	var resp *dns.Msg
	err := h.NS.Do(func() (err error) {
		resp, _, err = (&dns.Client{Net: "udp"}).Exchange(q, server)
		return err
	})
	if err != nil {
		return "error: " + err.Error()
	}
	out := []string{dns.RcodeToString[resp.Rcode]}
	var rrs []string
	for _, rr := range resp.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			rrs = append(rrs, "A "+rr.A.String())
		case *dns.AAAA:
			rrs = append(rrs, "AAAA "+rr.AAAA.String())
		case *dns.CNAME:
			rrs = append(rrs, "CNAME "+rr.Target)
		default:
			rrs = append(rrs, dns.TypeToString[rr.Header().Rrtype])
		}
	}
	slices.Sort(rrs)
	return strings.Join(append(out, rrs...), " ")
}

// serveUpstream runs the host's upstream nameserver on 127.0.0.1:53 inside h, named in the
// host's own resolv.conf (/etc/netns/NAME/resolv.conf, which ip netns exec mounts over
// /etc/resolv.conf): upstream.example has an address, every other name is NXDOMAIN.
func serveUpstream(t *testing.T, h *host) {
	t.Helper()
	dir := filepath.Join("/etc/netns", h.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.WriteFile(filepath.Join(dir, "resolv.conf"), []byte("nameserver 127.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pc, err := h.sock.ListenPacket(context.Background(), "udp", "127.0.0.1:53")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		if len(r.Question) == 1 && r.Question[0].Name == "upstream.example." && r.Question[0].Qtype == dns.TypeA {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: "upstream.example.", Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30}, A: net.ParseIP(upstreamAnswer)})
		} else {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go srv.ActivateAndServe()
	<-started
	t.Cleanup(func() { srv.Shutdown() })
}
