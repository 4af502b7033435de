package dns

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// nameserver is an in-test authoritative server on loopback that counts queries per name.
type nameserver struct {
	addr string
	mu   sync.Mutex
	seen map[string]int // queries per "name type"
}

func (ns *nameserver) queries(name string, qtype uint16) int {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return ns.seen[dns.Fqdn(name)+" "+dns.TypeToString[qtype]]
}

func startNameserver(t testing.TB) *nameserver {
	t.Helper()
	ns := &nameserver{seen: map[string]int{}}
	pc, ln, err := New(Config{}, nil, nil).listenPair("127.0.0.1", "0")
	if err != nil {
		t.Fatal(err)
	}
	ns.addr = pc.LocalAddr().String()
	h := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		q := req.Question[0]
		ns.mu.Lock()
		ns.seen[q.Name+" "+dns.TypeToString[q.Qtype]]++
		ns.mu.Unlock()
		resp := new(dns.Msg)
		resp.SetReply(req)
		switch {
		case q.Name == "slow.example.com.":
			time.Sleep(100 * time.Millisecond)
			fallthrough
		case q.Name == "vm.example.com." && q.Qtype == dns.TypeA:
			resp.Answer = append(resp.Answer, mustRR(t, q.Name+" 60 IN A 192.0.2.7"))
		case q.Name == "dual.example.com." && q.Qtype == dns.TypeA:
			resp.Answer = append(resp.Answer, mustRR(t, "dual.example.com. 30 IN CNAME real.example.com."), mustRR(t, "real.example.com. 300 IN A 192.0.2.8"))
		case q.Name == "dual.example.com." && q.Qtype == dns.TypeAAAA:
			resp.Answer = append(resp.Answer, mustRR(t, "dual.example.com. 300 IN AAAA 2001:db8::8"))
		case q.Name == "zero.example.com." && q.Qtype == dns.TypeA:
			resp.Answer = append(resp.Answer, mustRR(t, "zero.example.com. 0 IN A 192.0.2.9"))
		case strings.HasSuffix(q.Name, ".example.com.") && !strings.HasPrefix(q.Name, "missing"):
			// NOERROR, no data
		default:
			resp.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(resp)
	})
	runServers(t, &dns.Server{PacketConn: pc, Handler: h}, &dns.Server{Listener: ln, Handler: h})
	return ns
}

// On-demand resolution: an answer is cached for its TTL (the smallest of its records',
// CNAMEs included) and asked again after; a zero TTL is never reused; concurrent lookups of
// one name send one query; the cache holds at most MaxEntries names; a failing name's error
// says which name and why.
func TestResolver(t *testing.T) {
	ns := startNameserver(t)
	r, err := NewResolver(ResolverConfig{Upstreams: []string{ns.addr}, MaxEntries: 3, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	r.now = func() time.Time { return now }
	ctx := context.Background()
	lookup := func(host string) string {
		t.Helper()
		addrs, err := r.LookupHost(ctx, host)
		if err != nil {
			t.Fatalf("LookupHost(%s): %v", host, err)
		}
		var s []string
		for _, a := range addrs {
			s = append(s, a.String())
		}
		return strings.Join(s, ",")
	}

	if got := lookup("vm.example.com"); got != "192.0.2.7" {
		t.Fatalf("vm.example.com = %s", got)
	}
	if got := lookup("VM.example.com."); got != "192.0.2.7" || ns.queries("vm.example.com", dns.TypeA) != 1 {
		t.Fatalf("second lookup: %s after %d A queries; want the cached answer, 1 query", got, ns.queries("vm.example.com", dns.TypeA))
	}
	now = now.Add(61 * time.Second)
	if lookup("vm.example.com"); ns.queries("vm.example.com", dns.TypeA) != 2 {
		t.Fatalf("after the 60s TTL: %d A queries, want 2", ns.queries("vm.example.com", dns.TypeA))
	}

	if got := lookup("dual.example.com"); got != "192.0.2.8,2001:db8::8" {
		t.Fatalf("dual.example.com = %s; want the A through the CNAME and the AAAA", got)
	}
	now = now.Add(31 * time.Second) // the CNAME's TTL, the smallest
	if lookup("dual.example.com"); ns.queries("dual.example.com", dns.TypeA) != 2 {
		t.Fatalf("after the CNAME's 30s TTL: %d A queries, want 2", ns.queries("dual.example.com", dns.TypeA))
	}

	lookup("zero.example.com")
	if lookup("zero.example.com"); ns.queries("zero.example.com", dns.TypeA) != 2 {
		t.Fatalf("TTL 0: %d A queries for two lookups, want 2", ns.queries("zero.example.com", dns.TypeA))
	}

	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { lookup("slow.example.com") })
	}
	wg.Wait()
	if n := ns.queries("slow.example.com", dns.TypeA); n != 1 {
		t.Fatalf("8 concurrent lookups sent %d A queries, want 1", n)
	}

	r.mu.Lock()
	size := len(r.cache)
	r.mu.Unlock()
	if size > 3 {
		t.Fatalf("cache holds %d names, more than MaxEntries 3", size)
	}

	_, err = r.LookupHost(ctx, "missing.example.com")
	if err == nil || !strings.Contains(err.Error(), "missing.example.com") || !strings.Contains(err.Error(), "NXDOMAIN") {
		t.Fatalf("a missing name: %v; want an error naming it and NXDOMAIN", err)
	}
	if _, err := r.LookupHost(ctx, "nodata.example.com"); err == nil || !strings.Contains(err.Error(), "no A or AAAA record") {
		t.Fatalf("a name without addresses: %v", err)
	}
	r.LookupHost(ctx, "missing.example.com")
	if n := ns.queries("missing.example.com", dns.TypeA); n != 2 {
		t.Fatalf("a failed name was asked %d times in two lookups; failures are not kept, want 2", n)
	}
}

// A connection to a hostname-only workload whose answer is cached (hit) against one whose
// answer has a zero TTL (miss: A and AAAA from a nameserver on loopback).
func BenchmarkResolver(b *testing.B) {
	ns := startNameserver(b)
	r, err := NewResolver(ResolverConfig{Upstreams: []string{ns.addr}})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	for _, host := range []string{"vm.example.com", "zero.example.com"} {
		name := map[string]string{"vm.example.com": "hit", "zero.example.com": "miss"}[host]
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				if _, err := r.LookupHost(ctx, host); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
