package dns

import (
	"math/rand/v2"
	"net/netip"
	"strings"

	"github.com/gozt/gozt/xds/state"
)

// alias is one candidate name for a query. stripped is the query with a search domain
// removed when the alias came from stripping it; a match then answers with a CNAME.
type alias struct {
	name     string
	stripped string
}

// match is the service a query resolved to.
type match struct {
	svc      *state.Service
	alias    alias
	wildcard bool // matched through *.rest: no CNAME
}

// searchDomains is the client's search list: fixed with FixedSearch (a dedicated ztunnel),
// else derived from the client's namespace (istio-cni gives pods the standard Kubernetes
// list).
func (s *Server) searchDomains(client *state.Workload) []string {
	if s.cfg.FixedSearch {
		return s.search
	}
	d := s.cfg.ClusterDomain
	return []string{client.Namespace + ".svc." + d, "svc." + d, d}
}

// eachAlias calls yield with the candidate names for name (normalised) as the client sees
// them, in lookup order and without duplicates, until yield returns false. Candidates are
// built lazily: the common case, an exact match on the query, builds none.
func (s *Server) eachAlias(client *state.Workload, name string, yield func(alias) bool) {
	var seenBuf [16]string
	seen := seenBuf[:0]
	emit := func(a alias) bool {
		for _, x := range seen {
			if x == a.name {
				return true
			}
		}
		seen = append(seen, a.name)
		return yield(a)
	}
	if !emit(alias{name: name}) {
		return
	}
	nsDomain := client.Namespace + ".svc." + s.cfg.ClusterDomain
	for _, k := range s.kubeFQDNs(name, nsDomain) {
		if !emit(alias{name: k}) {
			return
		}
	}
	for _, sd := range s.searchDomains(client) {
		stripped, ok := trimDomain(name, sd)
		if !ok {
			continue
		}
		if !emit(alias{name: stripped, stripped: stripped}) {
			return
		}
		for _, k := range s.kubeFQDNs(stripped, nsDomain) {
			if !emit(alias{name: k, stripped: stripped}) {
				return
			}
		}
	}
}

// kubeFQDNs expands a short name to the Kubernetes FQDNs it may stand for, by label count:
//
//	name              -> name.<client-ns>.svc.<domain>
//	name.ns           -> name.ns.svc.<domain>, name.ns.<client-ns>.svc.<domain> (pod.subdomain)
//	name.ns.svc       -> name.ns.svc.<domain>
//	pod.sub.ns        -> pod.sub.ns.svc.<domain>
//	pod.sub.ns.svc    -> pod.sub.ns.svc.<domain>
//
// Anything longer is taken as already qualified.
func (s *Server) kubeFQDNs(name, nsDomain string) []string {
	if name == "" {
		return nil
	}
	d := s.cfg.ClusterDomain
	lastIsSvc := strings.HasSuffix(name, ".svc")
	switch strings.Count(name, ".") + 1 {
	case 1:
		return []string{name + "." + nsDomain}
	case 2:
		return []string{name + ".svc." + d, name + "." + nsDomain}
	case 3:
		if lastIsSvc {
			return []string{name + "." + d, name + ".svc." + d}
		}
		return []string{name + ".svc." + d}
	case 4:
		if lastIsSvc {
			return []string{name + "." + d}
		}
	}
	return nil
}

// trimDomain removes the domain suffix from name; ok is false unless name is longer than
// and ends with "."+domain.
func trimDomain(name, domain string) (string, bool) {
	if domain == "" || len(name) <= len(domain)+1 || !strings.HasSuffix(name, domain) ||
		name[len(name)-len(domain)-1] != '.' {
		return "", false
	}
	return name[:len(name)-len(domain)-1], true
}

// find resolves a normalised query name to a service visible to client, trying each alias
// exactly and then as wildcards of decreasing specificity ("a.b.c", "*.b.c", "*.c").
func (s *Server) find(client *state.Workload, name string) (match, bool) {
	if name == "" {
		return match{}, false
	}
	var found match
	ok := false
	s.eachAlias(client, name, func(a alias) bool {
		if svc := s.service(a.name, client.Namespace); svc != nil {
			found, ok = match{svc: svc, alias: a}, true
			return false
		}
		for rest := a.name; ; {
			i := strings.IndexByte(rest, '.')
			if i < 0 || i == len(rest)-1 {
				return true
			}
			rest = rest[i+1:]
			if svc := s.service("*."+rest, client.Namespace); svc != nil {
				found, ok = match{svc: svc, alias: a, wildcard: true}, true
				return false
			}
		}
	})
	return found, ok
}

// service returns the service with that hostname the client's namespace may use, if the
// DNS proxy answers for it: services with VIPs, and VIP-less Kubernetes headless services.
// Others (e.g. VIP-less ServiceEntries) are left to the upstream resolver.
func (s *Server) service(host, clientNs string) *state.Service {
	svc := s.store.ServiceByHostname(host, clientNs)
	if svc == nil || (len(svc.Addresses) == 0 && !strings.HasSuffix(svc.Hostname, s.svcSuffix)) {
		return nil
	}
	return svc
}

// familyAllowed reports whether the service may have records of this family: IPV6_ENABLED
// and the service's ip_families (which matter for headless services, whose pods may be dual
// stack while the service is not).
func (s *Server) familyAllowed(svc *state.Service, v6 bool) bool {
	if v6 && s.cfg.DisableIPv6 {
		return false
	}
	switch svc.IPFamilies {
	case state.IPFamiliesIPv4Only:
		return !v6
	case state.IPFamiliesIPv6Only:
		return v6
	}
	return true
}

// hasFamily reports whether w has an address of the family (v6: IPv6), or has no address
// at all to tell by.
func hasFamily(w *state.Workload, v6 bool) bool {
	for _, a := range w.Addresses {
		if a.Unmap().Is6() == v6 {
			return true
		}
	}
	return len(w.Addresses) == 0
}

// addresses returns the service's addresses of one family, shuffled: VIPs on the client's
// network, or for a headless service the first address of that family of each endpoint
// workload that may receive traffic.
func (s *Server) addresses(client *state.Workload, svc *state.Service, v6 bool) []netip.Addr {
	var out []netip.Addr
	if len(svc.Addresses) > 0 {
		for _, a := range svc.Addresses {
			if a.Network != client.Network || !a.Address.IsValid() || a.Address.Is6() != v6 {
				continue
			}
			if a.Prefix.IsValid() && !a.Prefix.IsSingleIP() {
				continue // a CIDR VIP is a range, not an address to hand out
			}
			out = append(out, a.Address)
		}
	} else {
		allowAll := svc.LoadBalancing != nil && svc.LoadBalancing.HealthPolicy == state.AllowAll
		for _, ep := range s.store.Endpoints(svc.Key()) {
			w := ep.Workload
			if !w.Healthy && !allowAll {
				continue
			}
			for _, a := range w.Addresses {
				if a.Is6() == v6 {
					out = append(out, a)
					break
				}
			}
		}
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}
