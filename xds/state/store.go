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
	"math/rand/v2"
	"net/netip"
	"sort"
	"sync"
)

// Options tunes a Store. The zero value is the default.
type Options struct {
	// Network is the local network, used when Resolve has no source workload.
	Network string
	// PreferredServiceNamespace breaks VIP/hostname ties (PREFERED_SERVICE_NAMESPACE).
	PreferredServiceNamespace string
	// UnhealthyFallback picks an unhealthy endpoint when a service has no healthy one left
	// (ENDPOINT_UNHEALTHY_FALLBACK). istiod marks not-ready and terminating pods alike
	// UNHEALTHY, so this sends to pods failing readiness too, which Kubernetes'
	// ProxyTerminatingEndpoints never does. Off: such a service has no endpoint
	// (ErrNoHealthyEndpoint), as in the Rust ztunnel.
	UnhealthyFallback bool
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
	for _, w := range b.Workloads {
		if w.WorkloadMeta == nil { // built by hand: the converter always sets one
			w.WorkloadMeta = &WorkloadMeta{}
		}
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
		x.applyPrivate(b)
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
