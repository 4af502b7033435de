package state

import (
	"maps"
	"net/netip"
	"slices"
)

// The index: every lookup structure of a Store, and how a Batch changes it. An index is
// changed only by Store.Apply, which serialises writers: a small push mutates the live
// index in place under Store.mu's write lock, a large one a private copy (cloneFor) that no
// reader sees until it is swapped in, so the methods below need no lock of their own.

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

	// While applyPrivate applies a batch (nil otherwise): the workloads it adds, whose
	// endpoints it indexes at its end, chained by meta (pending holds each meta's last
	// workload's index in added, next each one's predecessor of the same meta, -1 ending
	// the chain; metas lists them as first seen), and those of them it removed again.
	pending map[*WorkloadMeta]int32
	metas   []*WorkloadMeta
	added   []*Workload
	next    []int32
	dropped map[*Workload]struct{}
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
	if len(b.Workloads) > 0 || len(b.RemoveAddresses) > 0 { // addWorkload, removeWorkload
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
	if len(b.Services) > 0 || len(b.RemoveAddresses) > 0 { // addService, removeService
		vips := make(addrCount)
		for _, svc := range b.Services {
			for _, a := range svc.Addresses {
				vips.add(a.Network, a.Address)
			}
		}
		n := len(b.Services)
		c.services, c.byHost, c.byVIP, c.cidrs = cloneSized(x.services, n), cloneSized(x.byHost, n), x.byVIP.clone(vips), slices.Clip(x.cidrs)
	}
	if len(b.Policies) > 0 || len(b.RemovePolicies) > 0 { // addPolicy, removePolicy
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

// applyPrivate applies the whole batch to x, which no reader sees yet. The endpoints of the
// workloads it adds are indexed a meta at a time at the end, not a workload at a time as they
// come: a service's endpoints share a meta, and a control plane that sends a deployment's
// pods apart (istiod's and go-control-plane's map order) otherwise had each workload touch a
// cold services map, a cold endpoints entry and a cold inner map, a third of a 1M push
// (docs/PERFORMANCE.md, issue 59). A batch applied in slices to the live index cannot wait:
// readers see each resource whole.
func (x *index) applyPrivate(b *Batch) {
	x.pending, x.dropped = make(map[*WorkloadMeta]int32), make(map[*Workload]struct{})
	x.added, x.next = make([]*Workload, 0, len(b.Workloads)), make([]int32, 0, len(b.Workloads))
	x.apply(b, 0, b.size())
	// In the order the metas came: a push that keeps a deployment's pods together made its
	// metas, services maps and endpoints in that order, and they are still close in memory.
	for _, meta := range x.metas {
		last := x.pending[meta]
		for svc, ports := range meta.Services {
			m := x.endpointsOf(svc)
			for i := last; i >= 0; i = x.next[i] {
				w := x.added[i]
				if len(x.dropped) > 0 {
					if _, gone := x.dropped[w]; gone {
						continue
					}
				}
				m[w] = ports
			}
		}
	}
	x.pending, x.metas, x.added, x.next, x.dropped = nil, nil, nil, nil, nil
}

// endpointsOf is svc's endpoints, its map made on first use.
func (x *index) endpointsOf(svc string) map[*Workload]map[uint16]uint16 {
	m := x.endpoints[svc]
	if m == nil {
		m = make(map[*Workload]map[uint16]uint16)
		x.endpoints[svc] = m
	}
	return m
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
			x.removeWorkload(w)
		}
		if svc := x.services[name]; svc != nil {
			x.removeService(svc)
		}
		return
	}
	i -= len(b.RemoveAddresses)
	if i < len(b.RemovePolicies) {
		if p := x.policies[b.RemovePolicies[i]]; p != nil {
			x.removePolicy(p)
		}
		return
	}
	i -= len(b.RemovePolicies)
	if i < len(b.Workloads) {
		w := b.Workloads[i]
		if old := x.workloads[w.UID]; old != nil {
			x.removeWorkload(old)
		}
		x.addWorkload(w)
		return
	}
	i -= len(b.Workloads)
	if i < len(b.Services) {
		svc := b.Services[i]
		if old := x.services[svc.Key()]; old != nil {
			x.removeService(old)
		}
		x.addService(svc)
		return
	}
	p := b.Policies[i-len(b.Services)]
	if old := x.policies[p.Key()]; old != nil {
		x.removePolicy(old)
	}
	x.addPolicy(p)
}

func (x *index) addWorkload(w *Workload) {
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
	if x.pending != nil {
		prev, ok := x.pending[w.WorkloadMeta]
		if !ok {
			prev = -1
			x.metas = append(x.metas, w.WorkloadMeta)
		}
		x.pending[w.WorkloadMeta] = int32(len(x.added))
		x.added, x.next = append(x.added, w), append(x.next, prev)
		if len(x.dropped) > 0 {
			delete(x.dropped, w) // removed, then added again
		}
	} else {
		for svc, ports := range w.Services {
			x.endpointsOf(svc)[w] = ports
		}
	}
	if g := w.NetworkGateway; g != nil {
		x.gateways[gatewayKeyOf(g)]++
	}
}

func (x *index) removeWorkload(w *Workload) {
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
	if x.dropped != nil {
		x.dropped[w] = struct{}{} // if added by this batch, its endpoints are pending
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

func (x *index) addService(svc *Service) {
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

func (x *index) removeService(svc *Service) {
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

func (x *index) addPolicy(p *Policy) {
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

func (x *index) removePolicy(p *Policy) {
	delete(x.policies, p.Key())
	if m := x.policiesByNs[policyNs(p)]; m != nil {
		delete(m, p.Key())
		if len(m) == 0 {
			delete(x.policiesByNs, policyNs(p))
		}
	}
}
