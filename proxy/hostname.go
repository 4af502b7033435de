package proxy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// HostResolver looks a hostname up (dns.Resolver: the system's nameservers, a TTL cache).
type HostResolver interface {
	LookupHost(ctx context.Context, host string) ([]netip.Addr, error)
}

// resolveHostname fills in the address of a route to a workload known only by its hostname,
// as the Rust ztunnel does when it picks one (state.rs, resolve_on_demand_dns): every such
// connection counts in istio_on_demand_dns_total, and the address is one of the answers of
// dst's family if any, else any, at random.
func (p *Proxy) resolveHostname(ctx context.Context, src *state.Workload, r state.Route, dst netip.AddrPort) (state.Route, error) {
	var l metrics.Labels
	sourceLabels(&l, src)
	l.SourcePrincipal = src.Identity().String()
	p.metrics.OnDemandDNSUsed(l, r.Hostname)
	if p.cfg.Resolver == nil {
		return r, fmt.Errorf("proxy: workload %s has only a hostname (%s) and this proxy resolves none", r.Workload.UID, r.Hostname)
	}
	addrs, err := p.cfg.Resolver.LookupHost(ctx, r.Hostname)
	if err != nil {
		return r, fmt.Errorf("proxy: workload %s: %w", r.Workload.UID, err)
	}
	same := addrs[:0:0]
	for _, a := range addrs {
		if a.Unmap().Is4() == dst.Addr().Unmap().Is4() {
			same = append(same, a)
		}
	}
	if len(same) > 0 {
		addrs = same
	}
	return r.Resolved(addrs[rand.IntN(len(addrs))]), nil
}
