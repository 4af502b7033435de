// Package rbac decides whether an inbound connection is allowed by Istio authorization
// policies, with the semantics of the Rust ztunnel's src/rbac.rs: given the policies that
// apply to the destination workload and what can be seen of the connection, it returns
// allow or deny and which policy decided.
//
// It owns the matching rules only. It does not select which policies apply to a workload
// (xds/state does), does no I/O, does not log, and does not allocate per check.
package rbac

import (
	"iter"
	"net/netip"
	"strings"
	"sync"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/xds/state"
)

// Conn is what a policy can see of an inbound connection.
type Conn struct {
	Peer    identity.ID // verified mTLS peer; zero on the plaintext listener
	SrcIP   netip.Addr
	DstIP   netip.Addr // the destination workload's IP
	DstPort uint16     // final target port (not 15008)
}

// Reasons a Decision carries. They are constants so that Check never builds a string.
const (
	ReasonDenied        = "explicitly denied by"                   // a DENY policy matched
	ReasonNoAllow       = "no allow policies"                      // nothing to allow against: allowed
	ReasonAllowed       = "allowed by"                             // an ALLOW policy matched
	ReasonNoneAllowed   = "allow policies exist, but none allowed" // deny
	policyCacheMaxNames = 1 << 14
)

// Decision is the outcome of Check.
type Decision struct {
	Allow  bool
	Policy string // "ns/name" of the policy that decided, if any
	Reason string // one of the Reason constants
}

// String formats the decision the way ztunnel logs it, e.g.
// "explicitly denied by: ns/name". It allocates; call it only when logging.
func (d Decision) String() string {
	if d.Policy == "" {
		return d.Reason
	}
	return d.Reason + ": " + d.Policy
}

// Check applies the rules in Istio's order: a matching non-dry-run DENY policy denies; with no
// non-dry-run ALLOW policy the connection is allowed; a matching ALLOW policy allows;
// otherwise it is denied ("allow policies exist, but none allowed"). Dry-run policies never
// decide. Check does not allocate (the policy key comes from a small intern cache).
func Check(policies []*state.Policy, c Conn) Decision {
	c = c.normalize()
	haveAllow := false
	for _, p := range policies {
		if p == nil || p.DryRun {
			continue
		}
		if p.Action == state.ActionDeny {
			if matches(p, &c) {
				return Decision{Allow: false, Policy: key(p), Reason: ReasonDenied}
			}
		} else {
			haveAllow = true
		}
	}
	if !haveAllow {
		return Decision{Allow: true, Reason: ReasonNoAllow}
	}
	for _, p := range policies {
		if p == nil || p.DryRun || p.Action != state.ActionAllow {
			continue
		}
		if matches(p, &c) {
			return Decision{Allow: true, Policy: key(p), Reason: ReasonAllowed}
		}
	}
	return Decision{Allow: false, Reason: ReasonNoneAllowed}
}

// Matches reports whether the connection matches policy p, whatever its action and dry-run
// flag: any rule matches; a policy without rules never matches. The proxy may use it to log
// what dry-run policies would have done.
func Matches(p *state.Policy, c Conn) bool {
	c = c.normalize()
	return matches(p, &c)
}

// DryRunMatches yields the dry-run policies that match the connection, so the proxy can log
// what they would have done (dry-run policies are only logged). It is separate
// from Check to keep Check's cost independent of dry-run policies.
func DryRunMatches(policies []*state.Policy, c Conn) iter.Seq[*state.Policy] {
	c = c.normalize()
	return func(yield func(*state.Policy) bool) {
		for _, p := range policies {
			if p != nil && p.DryRun && matches(p, &c) && !yield(p) {
				return
			}
		}
	}
}

// normalize unmaps IPv4-mapped IPv6 addresses (a dual-stack listener reports IPv4 clients as
// ::ffff:a.b.c.d) so that IPv4 CIDRs match them.
func (c Conn) normalize() Conn {
	c.SrcIP = c.SrcIP.Unmap()
	c.DstIP = c.DstIP.Unmap()
	return c
}

func matches(p *state.Policy, c *Conn) bool {
	for i := range p.Rules {
		if ruleMatches(&p.Rules[i], c) {
			return true
		}
	}
	return false
}

// ruleMatches: every clause matches; an empty clause list matches.
func ruleMatches(r *state.Rule, c *Conn) bool {
	for i := range r.Clauses {
		if !clauseMatches(&r.Clauses[i], c) {
			return false
		}
	}
	return true
}

// clauseMatches: any non-empty Match matches. A clause with no matches matches (ztunnel treats
// an empty clause as matching), but a clause holding only empty Matches does not.
func clauseMatches(cl *state.Clause, c *Conn) bool {
	if len(cl.Matches) == 0 {
		return true
	}
	for i := range cl.Matches {
		m := &cl.Matches[i]
		if matchMatches(m, c) && !isEmpty(m) { // isEmpty last: most Matches fail a field first
			return true
		}
	}
	return false
}

func isEmpty(m *state.Match) bool {
	return len(m.Namespaces) == 0 && len(m.NotNamespaces) == 0 &&
		len(m.Principals) == 0 && len(m.NotPrincipals) == 0 &&
		len(m.SourceIPs) == 0 && len(m.NotSourceIPs) == 0 &&
		len(m.DestinationIPs) == 0 && len(m.NotDestinationIPs) == 0 &&
		len(m.DestinationPorts) == 0 && len(m.NotDestinationPorts) == 0 &&
		len(m.ServiceAccounts) == 0 && len(m.NotServiceAccounts) == 0
}

// matchMatches ANDs the field types; within a type the positive list needs any value to match
// (or is empty) and the not_ list needs none to match (or is empty). Cheap fields first.
func matchMatches(m *state.Match, c *Conn) bool {
	if !ports(m.DestinationPorts, m.NotDestinationPorts, c.DstPort) ||
		!prefixes(m.SourceIPs, m.NotSourceIPs, c.SrcIP) ||
		!prefixes(m.DestinationIPs, m.NotDestinationIPs, c.DstIP) {
		return false
	}
	if !serviceAccounts(m.ServiceAccounts, m.NotServiceAccounts, c.Peer) {
		return false
	}
	// Principals match the identity without "spiffe://"; with no peer identity no principal
	// value matches at all (not even presence), as in ztunnel.
	if !stringField(m.Principals, m.NotPrincipals, c.Peer.Principal(), !c.Peer.IsZero()) {
		return false
	}
	// Namespaces match the peer's namespace, "" without a peer.
	return stringField(m.Namespaces, m.NotNamespaces, c.Peer.Namespace(), true)
}

func ports(pos, neg []uint16, port uint16) bool {
	if len(pos) > 0 && !containsPort(pos, port) {
		return false
	}
	return len(neg) == 0 || !containsPort(neg, port)
}

func containsPort(ps []uint16, port uint16) bool {
	for _, p := range ps {
		if p == port {
			return true
		}
	}
	return false
}

func prefixes(pos, neg []netip.Prefix, ip netip.Addr) bool {
	if len(pos) > 0 && !containsIP(pos, ip) {
		return false
	}
	return len(neg) == 0 || !containsIP(neg, ip)
}

func containsIP(ps []netip.Prefix, ip netip.Addr) bool {
	for _, p := range ps {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

func serviceAccounts(pos, neg []state.ServiceAccountMatch, peer identity.ID) bool {
	if len(pos) > 0 && !containsSA(pos, peer) {
		return false
	}
	return len(neg) == 0 || !containsSA(neg, peer)
}

// containsSA: no identity matches no service account.
func containsSA(sas []state.ServiceAccountMatch, peer identity.ID) bool {
	if peer.IsZero() {
		return false
	}
	ns, sa := peer.Namespace(), peer.ServiceAccount()
	for i := range sas {
		if sas[i].Namespace == ns && sas[i].ServiceAccount == sa {
			return true
		}
	}
	return false
}

// stringField applies pos/neg to s; when !have, no value matches (so pos fails and neg passes).
func stringField(pos, neg []state.StringMatch, s string, have bool) bool {
	if len(pos) > 0 && !(have && containsString(pos, s)) {
		return false
	}
	return len(neg) == 0 || !have || !containsString(neg, s)
}

func containsString(ms []state.StringMatch, s string) bool {
	for i := range ms {
		if stringMatches(&ms[i], s) {
			return true
		}
	}
	return false
}

func stringMatches(m *state.StringMatch, s string) bool {
	switch m.Kind {
	case state.MatchExact:
		return s == m.Value
	case state.MatchPrefix:
		return strings.HasPrefix(s, m.Value)
	case state.MatchSuffix:
		return strings.HasSuffix(s, m.Value)
	case state.MatchPresence:
		return s != ""
	}
	return false // unknown kinds never match
}

// keys interns "namespace/name" strings so that a Decision names its policy without
// allocating. state.Policy has no cached key and policies are replaced on every xDS update, so
// the cache is keyed by value and simply reset when it grows past policyCacheMaxNames.
var keys struct {
	mu sync.RWMutex
	m  map[[2]string]string
}

func key(p *state.Policy) string {
	k := [2]string{p.Namespace, p.Name}
	keys.mu.RLock()
	s, ok := keys.m[k]
	keys.mu.RUnlock()
	if ok {
		return s
	}
	s = p.Key()
	keys.mu.Lock()
	if keys.m == nil || len(keys.m) >= policyCacheMaxNames {
		keys.m = make(map[[2]string]string)
	}
	keys.m[k] = s
	keys.mu.Unlock()
	return s
}
