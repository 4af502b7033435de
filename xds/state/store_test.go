package state

import (
	"context"
	"errors"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/identity"
)

func ip(s string) netip.Addr     { return netip.MustParseAddr(s) }
func ap(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }
func ips(s ...string) []netip.Addr {
	a := make([]netip.Addr, len(s))
	for i, x := range s {
		a[i] = ip(x)
	}
	return a
}
func vip(network, s string) NetworkAddress { return NetworkAddress{Network: network, Address: ip(s)} }

func wl(name string, addr string, mods ...func(*Workload)) *Workload {
	w := &Workload{
		UID: "Kubernetes//v1/Pod/default/" + name, Name: name, Healthy: true, Capacity: 1,
		WorkloadMeta: &WorkloadMeta{Namespace: "default", TrustDomain: "cluster.local", ServiceAccount: name, Protocol: TunnelHBONE},
	}
	if addr != "" {
		w.Addresses = ips(addr)
	}
	for _, m := range mods {
		m(w)
	}
	w.CacheIdentity() // as the xDS converter does
	return w
}

func inSvc(key string, ports map[uint16]uint16) func(*Workload) {
	return func(w *Workload) {
		if w.Services == nil {
			w.Services = map[string]map[uint16]uint16{}
		}
		w.Services[key] = ports
	}
}

func svc(ns, host string, addr string, mods ...func(*Service)) *Service {
	s := &Service{Name: strings.Split(host, ".")[0], Namespace: ns, Hostname: host, Ports: map[uint16]uint16{80: 8080}}
	if addr != "" {
		s.Addresses = []NetworkAddress{vip("", addr)}
	}
	for _, m := range mods {
		m(s)
	}
	return s
}

// Only the nodes and namespaces asked about are indexed, before or after their workloads
// arrive, and a node whose workloads all went stays indexed.
func TestOnDemandIndexes(t *testing.T) {
	s := NewStore()
	if got := s.WorkloadsOnNode("n1"); len(got) != 0 {
		t.Fatalf("empty store: %v", got)
	}
	on := func(name, node string) *Workload {
		return wl(name, "10.0.0."+strconv.Itoa(len(name)+len(node)*10), func(w *Workload) { w.Node = node })
	}
	big := Batch{Workloads: []*Workload{on("a", "n1"), on("bb", "n2")}}
	for i := range bigBatch { // the copy-and-swap path
		big.Workloads = append(big.Workloads, wl("x"+strconv.Itoa(i), "", func(w *Workload) { w.Node = "n3" }))
	}
	s.Apply(&big)
	if got := s.WorkloadsOnNode("n1"); len(got) != 1 || got[0].Name != "a" {
		t.Errorf("n1 after a push: %v", got)
	}
	if got := s.WorkloadsOnNode("n3"); len(got) != bigBatch { // indexed now, by a walk
		t.Errorf("n3: %d workloads; want %d", len(got), bigBatch)
	}
	if _, ok := s.idx.byNode["n2"]; ok || len(s.idx.byNode) != 2 {
		t.Errorf("nodes indexed: %v; want n1 and n3", slices.Collect(maps.Keys(s.idx.byNode)))
	}
	s.Apply(&Batch{RemoveAddresses: []string{big.Workloads[0].UID}})
	s.Apply(&Batch{Workloads: []*Workload{on("c", "n1")}})
	if got := s.WorkloadsOnNode("n1"); len(got) != 1 || got[0].Name != "c" {
		t.Errorf("n1 after its workload went and another came: %v", got)
	}

	if len(s.idx.byName) != 0 {
		t.Errorf("namespaces indexed by name before any was asked about: %d", len(s.idx.byName))
	}
	if w := s.FindWorkload("default", "x7"); w == nil || w.Name != "x7" || s.FindWorkload("other", "x7") != nil {
		t.Errorf("FindWorkload(default/x7) = %v", w)
	}
	s.Apply(&Batch{Workloads: []*Workload{on("d", "n2")}})
	if w := s.FindWorkload("default", "d"); w == nil || len(s.idx.byName) != 2 {
		t.Errorf("a namespace asked about is kept up to date: %v, %d indexed", w, len(s.idx.byName))
	}
}

// TestApplyKeepsMeta: Apply stores each workload's meta as given, never a copy of its
// own, and computes no identity: the xDS converter computes each once (CacheIdentity).
func TestApplyKeepsMeta(t *testing.T) {
	m := &WorkloadMeta{Namespace: "default", TrustDomain: "cluster.local", ServiceAccount: "a"}
	w := &Workload{UID: "Kubernetes//v1/Pod/default/a", Name: "a", Addresses: ips("10.0.0.1"), WorkloadMeta: m}
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{w}})
	if got := s.WorkloadByIP("", ip("10.0.0.1")); got != w || got.WorkloadMeta != m {
		t.Fatalf("stored %p with meta %p; want the workload %p with its meta %p", got, got.WorkloadMeta, w, m)
	}
	if id := w.Identity(); !id.IsZero() {
		t.Errorf("Identity = %v for a meta whose identity no converter computed; want zero", id)
	}
}

func TestIndexes(t *testing.T) {
	s := NewStore()
	a := wl("a", "10.0.0.1", func(w *Workload) { w.Node = "n1" })
	b := wl("b", "10.0.0.2", func(w *Workload) { w.Node = "n1"; w.NetworkMode = NetworkHostNetwork })
	c := wl("c", "10.0.0.3", func(w *Workload) { w.Node = "n2"; w.Network = "net2" })
	s.Apply(&Batch{Workloads: []*Workload{a, b, c}})

	if got := s.WorkloadByIP("", ip("10.0.0.1")); got != a {
		t.Errorf("WorkloadByIP(10.0.0.1) = %v; want a", got)
	}
	if got := s.WorkloadByIP("", ip("10.0.0.2")); got != nil {
		t.Errorf("host-network workload indexed by IP: %v", got.UID)
	}
	if got := s.WorkloadByIP("", ip("10.0.0.3")); got != nil {
		t.Errorf("workload on net2 found on default network")
	}
	if got := s.WorkloadByIP("net2", ip("10.0.0.3")); got != c {
		t.Errorf("WorkloadByIP(net2/10.0.0.3) = %v; want c", got)
	}
	if got := s.FindWorkload("default", "b"); got != b {
		t.Errorf("FindWorkload(default/b) = %v", got)
	}
	if got := s.WorkloadsOnNode("n1"); len(got) != 2 || got[0] != a || got[1] != b {
		t.Errorf("WorkloadsOnNode(n1) = %v", got)
	}
	if got := a.Identity(); got != identity.MustParse("spiffe://cluster.local/ns/default/sa/a") {
		t.Errorf("Identity = %v", got)
	}

	// Update moves a's IP: the old one must disappear from the index.
	a2 := wl("a", "10.0.0.9")
	s.Apply(&Batch{Workloads: []*Workload{a2}})
	if s.WorkloadByIP("", ip("10.0.0.1")) != nil || s.WorkloadByIP("", ip("10.0.0.9")) != a2 {
		t.Errorf("update did not move the IP index")
	}
	if got := s.WorkloadsOnNode("n1"); len(got) != 1 {
		t.Errorf("node index after update: %d workloads; want 1", len(got))
	}
	s.Apply(&Batch{RemoveAddresses: []string{a2.UID, "no/such"}})
	if s.WorkloadByUID(a2.UID) != nil || s.WorkloadByIP("", ip("10.0.0.9")) != nil || s.FindWorkload("default", "a") != nil {
		t.Errorf("removed workload still indexed")
	}
	if n, _, _ := s.Len(); n != 2 {
		t.Errorf("Len = %d; want 2", n)
	}
}

func TestServiceByVIP(t *testing.T) {
	s := NewStoreWith(Options{PreferredServiceNamespace: "pref"})
	pub := svc("other", "x.other.svc", "10.96.0.1")
	mine := svc("client", "x.client.svc", "10.96.0.1")
	private := svc("secret", "p.secret.svc", "10.96.0.2", func(s *Service) { s.Visibility = VisibilityNamespace })
	canon := svc("a", "c.a.svc", "10.96.0.3", func(s *Service) { s.Canonical = true })
	noncanon := svc("b", "c.b.svc", "10.96.0.3")
	pref := svc("pref", "d.pref.svc", "10.96.0.4")
	other := svc("zzz", "d.zzz.svc", "10.96.0.4")
	wide := svc("default", "wide.svc", "", func(s *Service) {
		s.Addresses = []NetworkAddress{{Address: ip("10.100.0.0"), Prefix: netip.MustParsePrefix("10.100.0.0/16")}}
	})
	narrow := svc("default", "narrow.svc", "", func(s *Service) {
		s.Addresses = []NetworkAddress{{Address: ip("10.100.1.0"), Prefix: netip.MustParsePrefix("10.100.1.0/24")}}
	})
	s.Apply(&Batch{Services: []*Service{pub, mine, private, noncanon, canon, other, pref, wide, narrow}})
	for _, tc := range []struct {
		ip, ns string
		want   *Service
	}{
		{"10.96.0.1", "client", mine},    // client namespace preferred
		{"10.96.0.1", "other", pub},      // its own namespace
		{"10.96.0.2", "client", nil},     // namespace-visible only
		{"10.96.0.2", "secret", private}, // same namespace sees it
		{"10.96.0.3", "x", canon},        // canonical wins
		{"10.96.0.4", "x", pref},         // PREFERED_SERVICE_NAMESPACE
		{"10.100.1.7", "x", narrow},      // longest CIDR
		{"10.100.2.7", "x", wide},
		{"10.101.0.1", "x", nil},
	} {
		if got := s.ServiceByVIP("", ip(tc.ip), tc.ns); got != tc.want {
			t.Errorf("ServiceByVIP(%s, ns %s) = %v; want %v", tc.ip, tc.ns, got, tc.want)
		}
	}
	if got := s.ServiceByHostname("p.secret.svc", "client"); got != nil {
		t.Errorf("ServiceByHostname ignores visibility")
	}
	if got := s.ServiceByHostname("c.a.svc", "client"); got != canon {
		t.Errorf("ServiceByHostname = %v", got)
	}
	s.Apply(&Batch{RemoveAddresses: []string{mine.Key(), narrow.Key()}})
	if got := s.ServiceByVIP("", ip("10.96.0.1"), "client"); got != pub {
		t.Errorf("after removal ServiceByVIP = %v; want pub", got)
	}
	if got := s.ServiceByVIP("", ip("10.100.1.7"), "x"); got != wide {
		t.Errorf("after CIDR removal = %v; want wide", got)
	}
}

func TestPoliciesFor(t *testing.T) {
	s := NewStore()
	g := &Policy{Name: "g", Namespace: "istio-system", Scope: ScopeGlobal}
	n := &Policy{Name: "n", Namespace: "default", Scope: ScopeNamespace}
	o := &Policy{Name: "o", Namespace: "other", Scope: ScopeNamespace}
	sel := &Policy{Name: "sel", Namespace: "default", Scope: ScopeWorkloadSelector}
	unsel := &Policy{Name: "unsel", Namespace: "default", Scope: ScopeWorkloadSelector}
	s.Apply(&Batch{Policies: []*Policy{g, n, o, sel, unsel}})
	w := wl("a", "10.0.0.1", func(w *Workload) { w.AuthorizationPolicies = []string{"default/sel", "default/missing"} })
	got := s.PoliciesFor(w)
	var keys []string
	for _, p := range got {
		keys = append(keys, p.Key())
	}
	if want := "default/n,istio-system/g,default/sel"; strings.Join(keys, ",") != want {
		t.Errorf("PoliciesFor = %v; want %v", keys, want)
	}
	s.Apply(&Batch{RemovePolicies: []string{"default/n"}})
	if got := s.PoliciesFor(w); len(got) != 2 {
		t.Errorf("after removal %d policies; want 2", len(got))
	}
}

func TestSubscribe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := NewStore()
		ctx, cancel := context.WithCancel(t.Context())
		ch := s.Subscribe(ctx)
		s.Apply(&Batch{Workloads: []*Workload{wl("a", "10.0.0.1")}})
		s.Apply(&Batch{Workloads: []*Workload{wl("b", "10.0.0.2")}})
		s.Apply(&Batch{}) // empty: no notification
		select {
		case <-ch:
		default:
			t.Fatal("no notification after apply")
		}
		select {
		case <-ch:
			t.Fatal("notifications not coalesced")
		default:
		}
		cancel()
		synctest.Wait()
		if _, ok := <-ch; ok {
			t.Fatal("channel not closed after ctx end")
		}
		s.Apply(&Batch{Workloads: []*Workload{wl("c", "10.0.0.3")}}) // must not panic
	})
}

func TestLookupAllocs(t *testing.T) {
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{wl("a", "10.0.0.1")}, Services: []*Service{svc("default", "e.svc", "10.96.0.1")}})
	a, v := ip("10.0.0.1"), ip("10.96.0.1")
	if n := testing.AllocsPerRun(100, func() { _ = s.WorkloadByIP("", a) }); n != 0 {
		t.Errorf("WorkloadByIP allocs = %v; want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { _ = s.ServiceByVIP("", v, "default") }); n != 0 {
		t.Errorf("ServiceByVIP allocs = %v; want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { _ = s.WorkloadByUID("Kubernetes//v1/Pod/default/a") }); n != 0 {
		t.Errorf("WorkloadByUID allocs = %v; want 0", n)
	}
}

var _ = errors.Is

func TestBigBatchSwapWithConcurrentReaders(t *testing.T) {
	s := NewStore()
	mk := func(gen, n int) *Batch {
		b := &Batch{}
		for i := range n {
			a := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
			b.Workloads = append(b.Workloads, wl("w"+strconv.Itoa(i), a.String(), inSvc(echoKey, nil), func(w *Workload) { w.Node = "n" + strconv.Itoa(gen) }))
		}
		// Services sharing a VIP and a hostname exercise the shared slices of the index.
		for i := range 4 {
			b.Services = append(b.Services, svc("ns"+strconv.Itoa(i), "echo.default.svc", "10.96.0.10"))
		}
		b.Services = append(b.Services, echo())
		return b
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				s.WorkloadByIP("", ip("10.0.0.7"))
				s.ServiceByVIP("", ip("10.96.0.10"), "ns2")
				s.ServiceByHostname("echo.default.svc", "ns1")
				s.WorkloadsOnNode("n1")
				_, _ = s.Resolve(nil, ap("10.96.0.10:80"))
				_ = s.Dump()
			}
		}()
	}
	for gen := range 4 {
		s.Apply(mk(gen, bigBatch+100)) // big: swapped in
		s.Apply(&Batch{Workloads: []*Workload{wl("small", "10.9.0.1")}, RemoveAddresses: []string{"Kubernetes//v1/Pod/default/w3"}})
	}
	close(stop)
	wg.Wait()
	if n := len(s.WorkloadsOnNode("n3")); n != bigBatch+100-1 {
		t.Errorf("node n3 has %d workloads; want %d", n, bigBatch+99)
	}
	if len(s.WorkloadsOnNode("n0")) != 0 {
		t.Error("old node index survived the swap")
	}
	if got := s.ServiceByVIP("", ip("10.96.0.10"), "ns2"); got == nil || got.Namespace != "ns2" {
		t.Errorf("ServiceByVIP after swaps = %v", got)
	}
	if eps := s.Endpoints(echoKey); len(eps) != bigBatch+99 {
		t.Errorf("%d endpoints; want %d", len(eps), bigBatch+99)
	}
	if s.WorkloadByIP("", ip("10.0.0.3")) != nil || s.WorkloadByUID("Kubernetes//v1/Pod/default/small") == nil {
		t.Error("small push after a swap not applied")
	}
}

// A large push of one kind copies only the maps it mutates: policies alone leave the
// workload and service maps shared with the index before (a 1M-workload copy is 520 MB),
// and readers of the old index see none of the change.
func TestBigBatchCopiesOnlyWhatItMutates(t *testing.T) {
	s := NewStore()
	var b Batch
	for i := range bigBatch {
		b.Workloads = append(b.Workloads, wl("w"+strconv.Itoa(i), "10.0."+strconv.Itoa(i/250)+"."+strconv.Itoa(i%250)))
	}
	s.Apply(&b)
	old := s.idx
	var pb Batch
	for i := range bigBatch {
		pb.Policies = append(pb.Policies, &Policy{Name: "p" + strconv.Itoa(i), Namespace: "default", Scope: ScopeNamespace, Action: ActionAllow})
	}
	s.Apply(&pb)
	x := s.idx
	if x == old {
		t.Fatal("a big batch was applied in place")
	}
	same := func(a, b any) bool { return reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(b).UnsafePointer() }
	if !same(x.workloads, old.workloads) || !same(x.byAddr, old.byAddr) || !same(x.endpoints, old.endpoints) || !same(x.services, old.services) {
		t.Error("a policy push copied the workload or service maps")
	}
	if same(x.policies, old.policies) || len(old.policies) != 0 || len(x.policies) != bigBatch {
		t.Errorf("policies: old index has %d, new %d (shared %v); want 0 and %d, not shared", len(old.policies), len(x.policies), same(x.policies, old.policies), bigBatch)
	}
	// A push the store's size (a resync) is applied in place, in slices: no map copied.
	var re Batch
	for _, w := range b.Workloads[1:] {
		c := *w
		c.Healthy, c.Node = !w.Healthy, "n1"
		re.Workloads = append(re.Workloads, &c)
	}
	re.RemoveAddresses = []string{b.Workloads[0].UID}
	s.Apply(&re)
	y := s.idx
	if !same(y.workloads, x.workloads) || !same(y.byAddr, x.byAddr) || !same(y.policies, x.policies) || len(y.workloads) != bigBatch-1 {
		t.Errorf("a resync copied the maps it mutates, or lost workloads (%d)", len(y.workloads))
	}
	if w := s.WorkloadByUID(b.Workloads[1].UID); w != re.Workloads[0] {
		t.Error("a resync's workload not applied")
	}
	if got := s.WorkloadsOnNode("n1"); len(got) != bigBatch-1 || got[0].Healthy == b.Workloads[1].Healthy {
		t.Errorf("node index after a resync: %d workloads", len(got))
	}
	// Removing most of the store in place rebuilds the maps at their new size.
	var rm Batch
	for _, w := range b.Workloads[1:] {
		rm.RemoveAddresses = append(rm.RemoveAddresses, w.UID)
	}
	rm.Workloads = b.Workloads[:1]
	s.Apply(&rm)
	if z := s.idx; same(z.workloads, y.workloads) || len(z.workloads) != 1 || s.WorkloadByUID(b.Workloads[0].UID) == nil {
		t.Errorf("after removing most workloads in place: %d left, maps rebuilt %v", len(z.workloads), !same(z.workloads, y.workloads))
	}
}

// EachWorkload holds no lock while f runs: a push applied from f (as one may arrive while
// the metric sweep walks a million workloads) does not wait for the walk.
func TestEachWorkloadHoldsNoLock(t *testing.T) {
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{wl("a", "10.0.0.1"), wl("b", "10.0.0.2")}})
	done := make(chan struct{})
	seen := 0
	go func() {
		defer close(done)
		s.EachWorkload(func(w *Workload) {
			seen++
			s.Apply(&Batch{Workloads: []*Workload{wl("c"+w.Name, "10.0.1."+strconv.Itoa(seen))}})
		})
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a push from inside EachWorkload waited for the walk")
	}
	if n, _, _ := s.Len(); seen != 2 || n != 4 {
		t.Errorf("visited %d workloads, store holds %d; want 2 and 4", seen, n)
	}
}

// A big batch into a smaller store (applied to a private copy, its endpoints indexed a meta
// at a time at the end) that carries a workload twice indexes only the second, whichever
// service each names, as a small batch applied in place does; workloads of one meta are
// each an endpoint of its services.
func TestBigBatchEndpointsOfRepeatedWorkload(t *testing.T) {
	const other = "default/other.default.svc"
	shared := &WorkloadMeta{Namespace: "default", TrustDomain: "cluster.local", ServiceAccount: "echo", Protocol: TunnelHBONE,
		Services: map[string]map[uint16]uint16{echoKey: {80: 8080}}}
	for _, size := range []int{3, bigBatch + 10} {
		var b Batch
		for i := range size {
			b.Workloads = append(b.Workloads, wl("w"+strconv.Itoa(i), "10.1."+strconv.Itoa(i/250)+"."+strconv.Itoa(i%250), func(w *Workload) { w.WorkloadMeta = shared }))
		}
		first, second := wl("twice", "10.2.0.1", inSvc(echoKey, nil)), wl("twice", "10.2.0.1", inSvc(other, nil))
		again, last := wl("again", "10.2.0.2", inSvc(echoKey, nil)), wl("again", "10.2.0.2", inSvc(echoKey, nil))
		b.Workloads = append(append([]*Workload{first, again}, b.Workloads...), second, last)
		s := NewStore()
		s.Apply(&b)
		eps := s.Endpoints(echoKey)
		if len(eps) != size+1 {
			t.Errorf("batch of %d: %d endpoints of echo; want %d", len(b.Workloads), len(eps), size+1)
		}
		for _, e := range eps {
			if e.Workload == first || e.Workload == again {
				t.Errorf("batch of %d: the replaced %s is still an endpoint of echo", len(b.Workloads), e.Workload.Name)
			}
		}
		if o := s.Endpoints(other); len(o) != 1 || o[0].Workload != second {
			t.Errorf("batch of %d: endpoints of other %v; want the second twice", len(b.Workloads), o)
		}
	}
}
