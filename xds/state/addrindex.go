package state

import (
	"maps"
	"net/netip"
)

// addrIndex maps an IP address on a network to a value. Each network has a table per
// address family keyed by the address's bytes, where a map keyed by {network string; ip
// netip.Addr} spends 40 bytes a slot on the key, 32 of them the network's name and the
// address's zone pointer repeated in every entry (the IP index was the largest map of a
// node in a large mesh; docs/PERFORMANCE.md). A key carries no zone: workload and service
// addresses have none.
//
// Like the index's other maps, it is mutated in place under the store's write lock or on a
// copy (clone) no reader has yet.
type addrIndex[V any] map[string]*addrTable[V]

// addrTable is one network's addresses.
type addrTable[V any] struct {
	v4 map[[4]byte]V
	v6 map[[16]byte]V // IPv4-mapped IPv6 addresses too: they are distinct addresses
}

// get returns the value at ip on network, the zero V if none.
func (x addrIndex[V]) get(network string, ip netip.Addr) V {
	var v V
	if t := x[network]; t != nil {
		switch {
		case ip.Is4():
			v = t.v4[ip.As4()]
		case ip.Is6():
			v = t.v6[ip.As16()]
		}
	}
	return v
}

// set puts v at ip on network; an invalid ip is ignored.
func (x addrIndex[V]) set(network string, ip netip.Addr, v V) {
	if !ip.IsValid() {
		return
	}
	t := x[network]
	if t == nil {
		t = &addrTable[V]{v4: make(map[[4]byte]V), v6: make(map[[16]byte]V)}
		x[network] = t
	}
	if ip.Is4() {
		t.v4[ip.As4()] = v
	} else {
		t.v6[ip.As16()] = v
	}
}

// delete removes ip on network, and the network's table when it is left empty.
func (x addrIndex[V]) delete(network string, ip netip.Addr) {
	t := x[network]
	if t == nil {
		return
	}
	switch {
	case ip.Is4():
		delete(t.v4, ip.As4())
	case ip.Is6():
		delete(t.v6, ip.As16())
	}
	if len(t.v4)+len(t.v6) == 0 {
		delete(x, network)
	}
}

// addrCount is how many addresses of each family a batch brings to each network.
type addrCount map[string]*[2]int // network -> {IPv4, IPv6}

func (c addrCount) add(network string, ip netip.Addr) {
	n := c[network]
	if n == nil {
		n = new([2]int)
		c[network] = n
	}
	if ip.Is4() {
		n[0]++
	} else {
		n[1]++
	}
}

// clone copies x, each table with room for the keys more says a batch brings to it (see
// cloneSized).
func (x addrIndex[V]) clone(more addrCount) addrIndex[V] {
	c := make(addrIndex[V], max(len(x), len(more)))
	for network, t := range x {
		var n [2]int
		if m := more[network]; m != nil {
			n = *m
		}
		c[network] = &addrTable[V]{v4: cloneSized(t.v4, n[0]), v6: cloneSized(t.v6, n[1])}
	}
	for network, n := range more {
		if c[network] == nil {
			c[network] = &addrTable[V]{v4: make(map[[4]byte]V, n[0]), v6: make(map[[16]byte]V, n[1])}
		}
	}
	return c
}

// shrunk is x with each table rebuilt at its length if it has fewer than half the keys it
// had (see the function shrunk); had is x's lengths before, by network. x itself is not
// written (readers may hold it): a table that shrinks goes into a copy.
func (x addrIndex[V]) shrunk(had map[string][2]int) addrIndex[V] {
	out, copied := x, false
	for network, t := range x {
		h := had[network]
		if len(t.v4) >= h[0]/2 && len(t.v6) >= h[1]/2 {
			continue
		}
		if !copied {
			out, copied = maps.Clone(x), true
		}
		out[network] = &addrTable[V]{v4: shrunk(t.v4, h[0]), v6: shrunk(t.v6, h[1])}
	}
	return out
}

// lens is each table's length, by network (what shrunk takes).
func (x addrIndex[V]) lens() map[string][2]int {
	m := make(map[string][2]int, len(x))
	for network, t := range x {
		m[network] = [2]int{len(t.v4), len(t.v6)}
	}
	return m
}
