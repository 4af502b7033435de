// Package state is the workload cache: workloads, services, endpoints and authorization
// policies as plain Go values (netip.Addr, identity.ID; no protobuf types), their indexes
// (network/IP, uid, hostname, VIP and CIDR VIP; namespace/name and node for the namespaces
// and nodes asked about), outbound resolution and load balancing (Store.Resolve) and the
// /config_dump view. It also says what one proxy serves (local.go): Mode is PROXY_MODE
// (shared, i.e. in-pod, node or dedicated), and Local is a proxy's mode, node, network and
// workload in one value, with the questions the data plane, the DNS proxy and certificate
// prefetch ask the Store about them (a node's Local makes each pod's with Local.Pod).
//
// It does not talk to the control plane or parse protos: package xds converts resources into
// these types outside any lock and hands the Store one Batch per push. Values handed to the
// Store are immutable afterwards; an update swaps the pointer, so readers can keep them.
//
// Concurrency: readers take a sync.RWMutex read lock for a few map lookups. Writers are
// serialised; a small push (under 512 resources, the usual delta) updates the index in place
// under the write lock for a few microseconds; a large one into a smaller store (initial
// sync) is applied to a copy of the index built without the lock and swapped in; a large
// one into a store at least its size (a resync) is applied in place 128 resources at a
// time, the lock released between them. A pure immutable snapshot would copy every index on each small delta;
// docs/ARCHITECTURE.md (decision 2) has the figures, bench_test.go measures them.
package state

import (
	"context"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"sync"

	"github.com/gozt/gozt/identity"
)

// Options tunes a Store. The zero value is the default.
type Options struct {
	// Network is the local network, used when Resolve has no source workload.
	Network string
	// PreferredServiceNamespace breaks VIP/hostname ties (PREFERED_SERVICE_NAMESPACE).
	PreferredServiceNamespace string
}

// Batch is one push, applied by Store.Apply. Upserts replace by key (uid,
// "ns/hostname", "ns/name"); removals name resources the same way.
type Batch struct {
	Workloads       []*Workload
	Services        []*Service
	Policies        []*Policy
	RemoveAddresses []string // workload uids or service "namespace/hostname" keys
	RemovePolicies  []string // "namespace/name"
}

// Empty reports whether the batch changes nothing.
func (b *Batch) Empty() bool { return b.size() == 0 }

type netKey struct {
	network string
	ip      netip.Addr
}

type cidrVIP struct {
	network string
	prefix  netip.Prefix
	svc     *Service
}

// index holds every lookup structure. Small pushes mutate the live index under the write
// lock; large ones build a copy off-lock and swap it in (see Apply).
type index struct {
	workloads    map[string]*Workload // by uid
	byAddr       addrIndex[*Workload]
	byName       map[string]map[string]*Workload   // namespace -> name -> workload, only namespaces FindWorkload was asked about
	byNode       map[string]map[*Workload]struct{} // only nodes WorkloadsOnNode was asked about; pointer keys
	services     map[string]*Service               // by "ns/hostname"
	byHost       map[string][]*Service
	byVIP        addrIndex[[]*Service]
	cidrs        []cidrVIP
	endpoints    map[string]map[*Workload]map[uint16]uint16 // service key -> workload -> its ports (Endpoint.Ports)
	policies     map[string]*Policy
	policiesByNs map[string]map[string]*Policy // scope global under "", namespace scope by ns
	gateways     map[gatewayKey]int            // network gateways workloads name, with how many name each
}

// gatewayKey is a network gateway as workloads name it: an address on a network, or a
// service by its "namespace/hostname" key.
type gatewayKey struct {
	addr netKey
	svc  string
}

func gatewayKeyOf(g *GatewayAddress) gatewayKey {
	if g.Hostname != "" {
		return gatewayKey{svc: g.Namespace + "/" + g.Hostname}
	}
	return gatewayKey{addr: netKey{g.Network, g.Address}}
}

func newIndex() *index {
	return &index{
		workloads:    make(map[string]*Workload),
		byAddr:       make(addrIndex[*Workload]),
		byName:       make(map[string]map[string]*Workload),
		byNode:       make(map[string]map[*Workload]struct{}),
		services:     make(map[string]*Service),
		byHost:       make(map[string][]*Service),
		byVIP:        make(addrIndex[[]*Service]),
		endpoints:    make(map[string]map[*Workload]map[uint16]uint16),
		policies:     make(map[string]*Policy),
		policiesByNs: make(map[string]map[string]*Policy),
		gateways:     make(map[gatewayKey]int),
	}
}

// cloneFor copies the index for b: the maps b mutates are deep-copied, the others shared
// (a push of policies alone must not copy a million workloads' maps: at 1M workloads that
// is 520 MB and seconds). Slices in byHost/byVIP are shared: writers only append past a
// reader's length or replace the slice (removeSvc copies).
func (x *index) cloneFor(b *Batch) *index {
	c := *x
	if len(b.Workloads) > 0 || len(b.RemoveAddresses) > 0 { // addWorkloadLocked, removeWorkloadLocked
		addrs, names := make(addrCount), make(map[string]int)
		for _, w := range b.Workloads {
			if w.NetworkMode != NetworkHostNetwork {
				for _, a := range w.Addresses {
					addrs.add(w.Network, a)
				}
			}
			if _, ok := x.byName[w.Namespace]; ok {
				names[w.Namespace]++
			}
		}
		c.workloads, c.byAddr = cloneSized(x.workloads, len(b.Workloads)), x.byAddr.clone(addrs)
		c.byName = make(map[string]map[string]*Workload, len(x.byName))
		for ns, m := range x.byName {
			c.byName[ns] = cloneSized(m, names[ns])
		}
		c.byNode = make(map[string]map[*Workload]struct{}, len(x.byNode))
		for k, m := range x.byNode {
			c.byNode[k] = maps.Clone(m)
		}
		c.endpoints = make(map[string]map[*Workload]map[uint16]uint16, len(x.endpoints))
		for k, m := range x.endpoints {
			c.endpoints[k] = maps.Clone(m)
		}
		c.gateways = maps.Clone(x.gateways)
	}
	if len(b.Services) > 0 || len(b.RemoveAddresses) > 0 { // addServiceLocked, removeServiceLocked
		vips := make(addrCount)
		for _, svc := range b.Services {
			for _, a := range svc.Addresses {
				vips.add(a.Network, a.Address)
			}
		}
		n := len(b.Services)
		c.services, c.byHost, c.byVIP, c.cidrs = cloneSized(x.services, n), cloneSized(x.byHost, n), x.byVIP.clone(vips), slices.Clip(x.cidrs)
	}
	if len(b.Policies) > 0 || len(b.RemovePolicies) > 0 { // addPolicyLocked, removePolicyLocked
		c.policies = maps.Clone(x.policies)
		c.policiesByNs = make(map[string]map[string]*Policy, len(x.policiesByNs))
		for k, m := range x.policiesByNs {
			c.policiesByNs[k] = maps.Clone(m)
		}
	}
	return &c
}

// cloneSized copies m, with room for n keys when a batch brings n (new or not): a node's
// first push of a million workloads otherwise grows each map twenty times over. Room for
// len(m)+n would double every table on a full re-push, for good: a Go map never shrinks.
func cloneSized[K comparable, V any](m map[K]V, n int) map[K]V {
	if n <= len(m) {
		return maps.Clone(m)
	}
	c := make(map[K]V, n)
	for k, v := range m {
		c[k] = v
	}
	return c
}

// shrunk returns m rebuilt at its length if it has fewer than half the keys it had: a Go map
// does not shrink, so a mesh that scaled down would otherwise keep its peak's tables.
func shrunk[K comparable, V any](m map[K]V, had int) map[K]V {
	if len(m) >= had/2 {
		return m
	}
	c := make(map[K]V, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// shrunkEach is shrunk for each inner map of m (had: their lengths before, by outer key).
// m itself is not written (readers may hold it): inner maps that shrink go into a copy.
func shrunkEach[K comparable, V any](m map[string]map[K]V, had map[string]int) map[string]map[K]V {
	out, copied := m, false
	for k, inner := range m {
		if len(inner) >= had[k]/2 {
			continue
		}
		if !copied {
			out, copied = maps.Clone(m), true
		}
		out[k] = shrunk(inner, had[k])
	}
	return out
}

// sizes is the length of each map compact may rebuild.
type sizes struct {
	workloads, services, byHost, policies int
	byAddr, byVIP                         map[string][2]int
	byName                                map[string]int
}

func (x *index) sizes() sizes {
	names := make(map[string]int, len(x.byName))
	for ns, m := range x.byName {
		names[ns] = len(m)
	}
	return sizes{
		workloads: len(x.workloads), services: len(x.services), byHost: len(x.byHost), policies: len(x.policies),
		byAddr: x.byAddr.lens(), byVIP: x.byVIP.lens(), byName: names,
	}
}

// compact shrinks the maps a big removal left mostly empty (had: their lengths before);
// x is not yet published.
func (x *index) compact(had sizes) {
	x.workloads = shrunk(x.workloads, had.workloads)
	x.byAddr = x.byAddr.shrunk(had.byAddr)
	x.byName = shrunkEach(x.byName, had.byName)
	x.services = shrunk(x.services, had.services)
	x.byHost = shrunk(x.byHost, had.byHost)
	x.byVIP = x.byVIP.shrunk(had.byVIP)
	x.policies = shrunk(x.policies, had.policies)
}

// Store is the workload cache. The zero value is not usable; call NewStore.
type Store struct {
	opts  Options
	randN func(n uint64) uint64 // [0,n); replaced in tests

	pushMu sync.Mutex // serialises writers; held across a whole Apply

	mu      sync.RWMutex // guards idx (the pointer and, for small pushes, its maps)
	idx     *index
	version uint64 // bumped on every applied batch

	subMu sync.Mutex
	subs  map[chan struct{}]struct{}
}

// bigBatch is the push size from which Apply does not hold the write lock for the whole
// push: a push into a store smaller than itself (a node's first push) is applied to a copy
// built without the lock and swapped in; one into a store at least its size (a full
// re-push) is applied in place, applySlice resources at a time, the lock released between
// them, so readers wait at most for one slice and no index is copied (at 1M workloads the
// copy was 500 MB, alive beside the old maps). Smaller pushes are applied in place at once
// (a few microseconds).
var bigBatch = 512 // a var so the benchmark can compare both paths

// applySlice is the most resources a big push applies under one hold of the write lock:
// about a microsecond each, so a reader waits a fraction of a millisecond.
const applySlice = 128

// NewStore returns an empty Store with default Options.
func NewStore() *Store { return NewStoreWith(Options{}) }

// NewStoreWith returns an empty Store.
func NewStoreWith(opts Options) *Store {
	return &Store{opts: opts, randN: rand.Uint64N, idx: newIndex(), subs: make(map[chan struct{}]struct{})}
}

// Apply applies one push and notifies subscribers. The batch's values must not be modified
// afterwards. Readers wait at most for a small in-place update, one slice of a big one or a
// pointer swap; during a big push into a populated store they may see part of it applied,
// each resource whole (its removal and insertion happen under one lock).
func (s *Store) Apply(b *Batch) {
	if b.Empty() {
		return
	}
	// Work that needs no lock: identities, one per service account. A meta without a
	// cached one (not from the xDS converter) is replaced by a private copy that has it:
	// the meta may be shared with a stored workload, so it is never written.
	var ids map[[3]string]*identity.ID
	var metas map[*WorkloadMeta]*WorkloadMeta
	for _, w := range b.Workloads {
		if w.WorkloadMeta == nil {
			w.WorkloadMeta = &WorkloadMeta{}
		}
		if w.id != nil {
			continue
		}
		if m := metas[w.WorkloadMeta]; m != nil {
			w.WorkloadMeta = m
			continue
		}
		if ids == nil {
			ids = make(map[[3]string]*identity.ID)
			metas = make(map[*WorkloadMeta]*WorkloadMeta)
		}
		k := [3]string{w.TrustDomain, w.Namespace, w.ServiceAccount}
		id := ids[k]
		if id == nil {
			v, err := identity.New(w.TrustDomain, w.Namespace, w.ServiceAccount)
			if err != nil {
				continue // Identity() is zero for it, as before
			}
			id = &v
			ids[k] = id
		}
		m := *w.WorkloadMeta
		m.id = id
		metas[w.WorkloadMeta] = &m
		w.WorkloadMeta = &m
	}
	s.pushMu.Lock()
	defer s.pushMu.Unlock()
	// Only writers mutate idx and pushMu excludes the others, so reading it here without
	// mu races with nothing.
	size := b.size()
	switch {
	case size < bigBatch:
		s.mu.Lock()
		s.idx.apply(b, 0, size)
		s.version++
		s.mu.Unlock()
	case s.idx.copyCost(b) < size:
		// Readers keep using the old index meanwhile.
		x := s.idx.cloneFor(b)
		x.apply(b, 0, size)
		if len(b.RemoveAddresses)+len(b.RemovePolicies) > 0 {
			x.compact(s.idx.sizes())
		}
		s.mu.Lock()
		s.idx = x
		s.version++
		s.mu.Unlock()
	default:
		had := s.idx.sizes()
		for from := 0; from < size; from += applySlice {
			s.mu.Lock()
			s.idx.apply(b, from, min(from+applySlice, size))
			s.version++
			s.mu.Unlock()
		}
		if len(b.RemoveAddresses)+len(b.RemovePolicies) > 0 {
			// Reading the live maps without mu is safe: readers only read them too.
			x := *s.idx
			x.compact(had)
			s.mu.Lock()
			s.idx = &x
			s.mu.Unlock()
		}
	}
	s.notify()
}

func (b *Batch) size() int {
	return len(b.Workloads) + len(b.Services) + len(b.Policies) + len(b.RemoveAddresses) + len(b.RemovePolicies)
}

// copyCost is the number of entries cloneFor(b) copies.
func (x *index) copyCost(b *Batch) int {
	n := 0
	if len(b.Workloads) > 0 || len(b.RemoveAddresses) > 0 {
		n += len(x.workloads)
	}
	if len(b.Services) > 0 || len(b.RemoveAddresses) > 0 {
		n += len(x.services)
	}
	if len(b.Policies) > 0 || len(b.RemovePolicies) > 0 {
		n += len(x.policies)
	}
	return n
}

// apply applies the batch's changes [from, to), in the order removals of addresses, of
// policies, then workloads, services and policies.
func (x *index) apply(b *Batch, from, to int) {
	for i := from; i < to; i++ {
		x.applyOne(b, i)
	}
}

func (x *index) applyOne(b *Batch, i int) {
	if i < len(b.RemoveAddresses) {
		name := b.RemoveAddresses[i]
		if w := x.workloads[name]; w != nil {
			x.removeWorkloadLocked(w)
		}
		if svc := x.services[name]; svc != nil {
			x.removeServiceLocked(svc)
		}
		return
	}
	i -= len(b.RemoveAddresses)
	if i < len(b.RemovePolicies) {
		if p := x.policies[b.RemovePolicies[i]]; p != nil {
			x.removePolicyLocked(p)
		}
		return
	}
	i -= len(b.RemovePolicies)
	if i < len(b.Workloads) {
		w := b.Workloads[i]
		if old := x.workloads[w.UID]; old != nil {
			x.removeWorkloadLocked(old)
		}
		x.addWorkloadLocked(w)
		return
	}
	i -= len(b.Workloads)
	if i < len(b.Services) {
		svc := b.Services[i]
		if old := x.services[svc.Key()]; old != nil {
			x.removeServiceLocked(old)
		}
		x.addServiceLocked(svc)
		return
	}
	p := b.Policies[i-len(b.Services)]
	if old := x.policies[p.Key()]; old != nil {
		x.removePolicyLocked(old)
	}
	x.addPolicyLocked(p)
}

func (x *index) addWorkloadLocked(w *Workload) {
	x.workloads[w.UID] = w
	if w.NetworkMode != NetworkHostNetwork {
		for _, a := range w.Addresses {
			x.byAddr.set(w.Network, a, w)
		}
	}
	if names := x.byName[w.Namespace]; names != nil {
		names[w.Name] = w
	}
	if m := x.byNode[w.Node]; m != nil {
		m[w] = struct{}{}
	}
	for svc, ports := range w.Services {
		m := x.endpoints[svc]
		if m == nil {
			m = make(map[*Workload]map[uint16]uint16)
			x.endpoints[svc] = m
		}
		m[w] = ports
	}
	if g := w.NetworkGateway; g != nil {
		x.gateways[gatewayKeyOf(g)]++
	}
}

func (x *index) removeWorkloadLocked(w *Workload) {
	delete(x.workloads, w.UID)
	for _, a := range w.Addresses {
		if x.byAddr.get(w.Network, a) == w {
			x.byAddr.delete(w.Network, a)
		}
	}
	if names := x.byName[w.Namespace]; names[w.Name] == w {
		delete(names, w.Name) // an emptied namespace stays: it is still asked about
	}
	if m := x.byNode[w.Node]; m != nil {
		delete(m, w) // an emptied node stays: it is still asked about
	}
	for svc := range w.Services {
		if m := x.endpoints[svc]; m != nil {
			delete(m, w)
			if len(m) == 0 {
				delete(x.endpoints, svc)
			}
		}
	}
	if g := w.NetworkGateway; g != nil {
		k := gatewayKeyOf(g)
		if x.gateways[k]--; x.gateways[k] <= 0 {
			delete(x.gateways, k)
		}
	}
}

func (x *index) addServiceLocked(svc *Service) {
	x.services[svc.Key()] = svc
	x.byHost[svc.Hostname] = append(x.byHost[svc.Hostname], svc)
	for _, a := range svc.Addresses {
		if a.Prefix.IsValid() && a.Prefix.Bits() != a.Prefix.Addr().BitLen() {
			x.cidrs = append(x.cidrs, cidrVIP{a.Network, a.Prefix, svc})
			continue
		}
		x.byVIP.set(a.Network, a.Address, append(x.byVIP.get(a.Network, a.Address), svc))
	}
}

func removeSvc(list []*Service, svc *Service) []*Service {
	for i, x := range list {
		if x == svc {
			// Copy so slices handed to earlier readers stay intact.
			out := make([]*Service, 0, len(list)-1)
			out = append(out, list[:i]...)
			return append(out, list[i+1:]...)
		}
	}
	return list
}

func (x *index) removeServiceLocked(svc *Service) {
	delete(x.services, svc.Key())
	if l := removeSvc(x.byHost[svc.Hostname], svc); len(l) == 0 {
		delete(x.byHost, svc.Hostname)
	} else {
		x.byHost[svc.Hostname] = l
	}
	for _, a := range svc.Addresses {
		if a.Prefix.IsValid() && a.Prefix.Bits() != a.Prefix.Addr().BitLen() {
			continue
		}
		if l := removeSvc(x.byVIP.get(a.Network, a.Address), svc); len(l) == 0 {
			x.byVIP.delete(a.Network, a.Address)
		} else {
			x.byVIP.set(a.Network, a.Address, l)
		}
	}
	if len(x.cidrs) > 0 {
		out := x.cidrs[:0:0]
		for _, c := range x.cidrs {
			if c.svc != svc {
				out = append(out, c)
			}
		}
		x.cidrs = out
	}
}

func policyNs(p *Policy) string {
	if p.Scope == ScopeGlobal {
		return ""
	}
	return p.Namespace
}

func (x *index) addPolicyLocked(p *Policy) {
	x.policies[p.Key()] = p
	if p.Scope == ScopeWorkloadSelector {
		return
	}
	ns := policyNs(p)
	m := x.policiesByNs[ns]
	if m == nil {
		m = make(map[string]*Policy)
		x.policiesByNs[ns] = m
	}
	m[p.Key()] = p
}

func (x *index) removePolicyLocked(p *Policy) {
	delete(x.policies, p.Key())
	if m := x.policiesByNs[policyNs(p)]; m != nil {
		delete(m, p.Key())
		if len(m) == 0 {
			delete(x.policiesByNs, policyNs(p))
		}
	}
}

// WorkloadByIP returns the workload with address ip on network, or nil.
func (s *Store) WorkloadByIP(network string, ip netip.Addr) *Workload {
	s.mu.RLock()
	w := s.idx.byAddr.get(network, ip)
	s.mu.RUnlock()
	return w
}

// IsNetworkGateway reports whether ip on network is a network gateway some workload names:
// the address itself, or a workload there that is an endpoint of a gateway service (named
// by hostname, or by one of its VIPs). Connections from a gateway carry other clients' (double
// HBONE), so per-source budgets must not lump them together.
func (s *Store) IsNetworkGateway(network string, ip netip.Addr) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	x := s.idx
	if len(x.gateways) == 0 {
		return false
	}
	if x.gateways[gatewayKey{addr: netKey{network, ip}}] > 0 {
		return true
	}
	w := x.byAddr.get(network, ip)
	if w == nil {
		return false
	}
	for key := range w.Services {
		if x.gateways[gatewayKey{svc: key}] > 0 {
			return true
		}
		if svc := x.services[key]; svc != nil {
			for _, a := range svc.Addresses {
				if x.gateways[gatewayKey{addr: netKey{a.Network, a.Address}}] > 0 {
					return true
				}
			}
		}
	}
	return false
}

// WorkloadByUID returns the workload with that uid, or nil.
func (s *Store) WorkloadByUID(uid string) *Workload {
	s.mu.RLock()
	w := s.idx.workloads[uid]
	s.mu.RUnlock()
	return w
}

// FindWorkload returns a workload by namespace and name (dedicated mode's own workload), or
// nil. Only the namespaces asked about are indexed by name, as nodes are (WorkloadsOnNode).
func (s *Store) FindWorkload(namespace, name string) *Workload {
	s.mu.RLock()
	names, ok := s.idx.byName[namespace]
	w := names[name]
	s.mu.RUnlock()
	if !ok {
		s.startIndex(func(x *index) {
			names, ok := x.byName[namespace]
			if !ok {
				names = make(map[string]*Workload)
				for _, w := range x.workloads {
					if w.Namespace == namespace {
						names[w.Name] = w
					}
				}
				x.byName[namespace] = names
			}
			w = names[name]
		})
	}
	return w
}

// startIndex runs add on the live index under the write lock, with no push building a copy
// of the index meanwhile (the copy would not have what add starts indexing). It is how the
// indexes built on demand (by node, by name) learn a key: a walk of every workload, once.
func (s *Store) startIndex(add func(x *index)) {
	s.pushMu.Lock()
	defer s.pushMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	add(s.idx)
}

// EachWorkload calls f for every workload in the store when called, in no order, without
// the store's lock: the workloads are copied out under it first. (The node's metric sweep
// built a map of every workload under the read lock; at a million workloads that is
// seconds, and a push waiting for the write lock meanwhile queues every lookup behind it.)
func (s *Store) EachWorkload(f func(*Workload)) {
	s.mu.RLock()
	ws := make([]*Workload, 0, len(s.idx.workloads))
	for _, w := range s.idx.workloads {
		ws = append(ws, w)
	}
	s.mu.RUnlock()
	for _, w := range ws {
		f(w)
	}
}

// WorkloadsOnNode returns the workloads scheduled on node, sorted by uid.
//
// Only the nodes asked about are indexed (a proxy asks about its own): the first call for a
// node walks the store once, under the write lock, and later pushes keep that node's set.
// Indexing every node and namespace of a large mesh cost memory and inserts on every push
// for the one node (or pod) a proxy serves (docs/PERFORMANCE.md).
func (s *Store) WorkloadsOnNode(node string) []*Workload {
	if node == "" {
		return nil
	}
	s.mu.RLock()
	m, ok := s.idx.byNode[node]
	out := make([]*Workload, 0, len(m))
	for w := range m {
		out = append(out, w)
	}
	s.mu.RUnlock()
	if !ok {
		s.startIndex(func(x *index) {
			m, ok := x.byNode[node]
			if !ok {
				m = make(map[*Workload]struct{})
				for _, w := range x.workloads {
					if w.Node == node {
						m[w] = struct{}{}
					}
				}
				x.byNode[node] = m
			}
			for w := range m {
				out = append(out, w)
			}
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	return out
}

// ServiceByKey returns the service named "namespace/hostname", or nil.
func (s *Store) ServiceByKey(key string) *Service {
	s.mu.RLock()
	svc := s.idx.services[key]
	s.mu.RUnlock()
	return svc
}

// ServiceByVIP returns the service a client in srcNamespace reaches at ip on network, or nil.
// Exact VIPs win over CIDR VIPs; ties are broken as the Rust ztunnel breaks them.
func (s *Store) ServiceByVIP(network string, ip netip.Addr, srcNamespace string) *Service {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.serviceByVIPLocked(network, ip, srcNamespace)
}

func (s *Store) serviceByVIPLocked(network string, ip netip.Addr, srcNs string) *Service {
	if svc := s.pickService(s.idx.byVIP.get(network, ip), srcNs); svc != nil {
		return svc
	}
	var best *Service
	bestBits := -1
	for i := range s.idx.cidrs {
		c := &s.idx.cidrs[i]
		if c.network != network || !c.prefix.Contains(ip) || !c.svc.VisibleTo(srcNs) {
			continue
		}
		b := c.prefix.Bits()
		switch {
		case b > bestBits:
			best, bestBits = c.svc, b
		case b == bestBits && s.better(c.svc, best, srcNs):
			best = c.svc
		}
	}
	return best
}

// better reports whether a beats b on the tie-break: client namespace, canonical, preferred
// namespace.
func (s *Store) better(a, b *Service, srcNs string) bool {
	if (a.Namespace == srcNs) != (b.Namespace == srcNs) {
		return a.Namespace == srcNs
	}
	if a.Canonical != b.Canonical {
		return a.Canonical
	}
	p := s.opts.PreferredServiceNamespace
	return p != "" && a.Namespace == p && b.Namespace != p
}

func (s *Store) pickService(list []*Service, srcNs string) *Service {
	var best *Service
	for _, svc := range list {
		if !svc.VisibleTo(srcNs) {
			continue
		}
		if best == nil || s.better(svc, best, srcNs) {
			best = svc
		}
	}
	return best
}

// ServiceByHostname returns the service with exactly this hostname visible to srcNamespace,
// preferring the client's namespace, or nil.
func (s *Store) ServiceByHostname(hostname, srcNamespace string) *Service {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.pickService(s.idx.byHost[hostname], srcNamespace)
}

// Endpoints returns the service's endpoints sorted by workload uid.
func (s *Store) Endpoints(serviceKey string) []Endpoint {
	s.mu.RLock()
	m := s.idx.endpoints[serviceKey]
	out := make([]Endpoint, 0, len(m))
	for w, ports := range m {
		out = append(out, Endpoint{w, ports})
	}
	s.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Workload.UID < out[j].Workload.UID })
	return out
}

// Policy returns the policy with key "namespace/name", or nil.
func (s *Store) Policy(key string) *Policy {
	s.mu.RLock()
	p := s.idx.policies[key]
	s.mu.RUnlock()
	return p
}

// PoliciesFor returns the policies that apply to w: global, w's namespace, and the selector
// policies w lists (unknown keys skipped), sorted by key within each group.
func (s *Store) PoliciesFor(w *Workload) []*Policy {
	s.mu.RLock()
	g, n := s.idx.policiesByNs[""], s.idx.policiesByNs[w.Namespace]
	out := make([]*Policy, 0, len(g)+len(n)+len(w.AuthorizationPolicies))
	for _, p := range g {
		out = append(out, p)
	}
	for _, p := range n {
		out = append(out, p)
	}
	sortPolicies(out)
	mark := len(out)
	for _, key := range w.AuthorizationPolicies {
		if p := s.idx.policies[key]; p != nil && p.Scope == ScopeWorkloadSelector {
			out = append(out, p)
		}
	}
	s.mu.RUnlock()
	sortPolicies(out[mark:])
	return out
}

func sortPolicies(ps []*Policy) {
	sort.Slice(ps, func(i, j int) bool { return ps[i].Key() < ps[j].Key() })
}

// Len returns the number of workloads, services and policies.
func (s *Store) Len() (workloads, services, policies int) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.idx.workloads), len(s.idx.services), len(s.idx.policies)
}

// Version counts applied batches; it changes whenever the state does.
func (s *Store) Version() uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.version
}

// Subscribe returns a coalescing notification channel (buffer 1) that receives after each
// applied change; it is closed when ctx ends.
func (s *Store) Subscribe(ctx context.Context) <-chan struct{} {
	ch := make(chan struct{}, 1)
	s.subMu.Lock()
	s.subs[ch] = struct{}{}
	s.subMu.Unlock()
	context.AfterFunc(ctx, func() {
		s.subMu.Lock()
		delete(s.subs, ch)
		close(ch)
		s.subMu.Unlock()
	})
	return ch
}

func (s *Store) notify() {
	s.subMu.Lock()
	for ch := range s.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	s.subMu.Unlock()
}
