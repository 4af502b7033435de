package rbac

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/xds/state"
)

// This file fuzzes Check against an independent, deliberately naive reading of Istio's
// AuthorizationPolicy rules (oracle below) and checks invariants that must hold for any policy set:
//
//   - Check never panics, whatever the policies (nil entries, empty rules, clauses, matches,
//     unknown StringMatch kinds, zero prefixes).
//   - Check agrees with the oracle on Allow, Reason and the deciding policy.
//   - Deny overrides: whenever a non-dry-run DENY policy matches, the connection is denied
//     and the named policy is a matching non-dry-run DENY, whatever ALLOW policies say and
//     in whichever order the policies come.
//   - Dry-run policies never change the decision: dropping them, or flipping their action,
//     gives the same Decision.
//   - Allow/deny does not depend on the order of the policies.
//   - Adding a non-dry-run DENY that matches everything denies; adding a non-dry-run ALLOW
//     that matches everything allows unless a DENY matched.
//
// Inputs are decoded from the fuzzer's bytes with small alphabets (a few namespaces,
// principals, CIDRs and ports) so that matches are frequent rather than vanishingly rare.

// gen turns fuzz bytes into choices; when the bytes run out every choice is 0.
type gen struct{ b []byte }

func (g *gen) next() byte {
	if len(g.b) == 0 {
		return 0
	}
	c := g.b[0]
	g.b = g.b[1:]
	return c
}

// n returns a value in [0, n).
func (g *gen) n(n int) int { return int(g.next()) % n }

var (
	fuzzStrings = []string{"", "default", "prod", "def", "ault", "cluster.local/ns/default/sa/sleep",
		"cluster.local/", "/sa/sleep", "spiffe://cluster.local/ns/default/sa/sleep", "example.org/ns/prod/sa/api"}
	fuzzPrefixes = []netip.Prefix{
		{}, // the zero Prefix: contains nothing
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("10.0.0.1/32"),
		netip.MustParsePrefix("192.168.0.0/16"), netip.MustParsePrefix("0.0.0.0/0"),
		netip.MustParsePrefix("::/0"), netip.MustParsePrefix("fd00::/8"), netip.MustParsePrefix("::ffff:10.0.0.0/104"),
	}
	fuzzAddrs = []netip.Addr{
		{}, netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("192.168.1.1"),
		netip.MustParseAddr("::ffff:10.0.0.1"), netip.MustParseAddr("fd00::1"), netip.MustParseAddr("2001:db8::1"),
	}
	fuzzPorts = []uint16{0, 80, 8080, 15008}
	fuzzIDs   = []identity.ID{
		{}, identity.MustParse("spiffe://cluster.local/ns/default/sa/sleep"),
		identity.MustParse("spiffe://cluster.local/ns/prod/sa/api"),
		identity.MustParse("spiffe://example.org/ns/prod/sa/api"),
	}
	fuzzSAs = []state.ServiceAccountMatch{{}, {Namespace: "default", ServiceAccount: "sleep"},
		{Namespace: "prod", ServiceAccount: "api"}, {Namespace: "default", ServiceAccount: "api"}}
)

func (g *gen) strings() []state.StringMatch {
	var out []state.StringMatch
	for range g.n(3) {
		// Kind 4 is not a defined kind; it must never match and never panic.
		out = append(out, state.StringMatch{Kind: state.StringMatchKind(g.n(5)), Value: fuzzStrings[g.n(len(fuzzStrings))]})
	}
	return out
}

func (g *gen) prefixes() []netip.Prefix {
	var out []netip.Prefix
	for range g.n(3) {
		out = append(out, fuzzPrefixes[g.n(len(fuzzPrefixes))])
	}
	return out
}

func (g *gen) ports() []uint16 {
	var out []uint16
	for range g.n(3) {
		out = append(out, fuzzPorts[g.n(len(fuzzPorts))])
	}
	return out
}

func (g *gen) sas() []state.ServiceAccountMatch {
	var out []state.ServiceAccountMatch
	for range g.n(3) {
		out = append(out, fuzzSAs[g.n(len(fuzzSAs))])
	}
	return out
}

// match fills each field with probability 1/4 so most Matches have one or two fields.
func (g *gen) match() state.Match {
	var m state.Match
	pick := func() bool { return g.n(4) == 0 }
	if pick() {
		m.Namespaces = g.strings()
	}
	if pick() {
		m.NotNamespaces = g.strings()
	}
	if pick() {
		m.Principals = g.strings()
	}
	if pick() {
		m.NotPrincipals = g.strings()
	}
	if pick() {
		m.SourceIPs = g.prefixes()
	}
	if pick() {
		m.NotSourceIPs = g.prefixes()
	}
	if pick() {
		m.DestinationIPs = g.prefixes()
	}
	if pick() {
		m.NotDestinationIPs = g.prefixes()
	}
	if pick() {
		m.DestinationPorts = g.ports()
	}
	if pick() {
		m.NotDestinationPorts = g.ports()
	}
	if pick() {
		m.ServiceAccounts = g.sas()
	}
	if pick() {
		m.NotServiceAccounts = g.sas()
	}
	return m
}

var fuzzNames = []string{"a", "b", "c", "d", "e", "f", "g", "h"}

func (g *gen) policies() []*state.Policy {
	var ps []*state.Policy
	for range g.n(6) {
		if g.n(16) == 0 {
			ps = append(ps, nil)
			continue
		}
		p := &state.Policy{
			Name:      fuzzNames[g.n(len(fuzzNames))],
			Namespace: fuzzStrings[g.n(3)],
			Action:    state.PolicyAction(g.n(2)),
			DryRun:    g.n(4) == 0,
		}
		for range g.n(3) {
			var r state.Rule
			for range g.n(3) {
				var cl state.Clause
				for range g.n(3) {
					cl.Matches = append(cl.Matches, g.match())
				}
				r.Clauses = append(r.Clauses, cl)
			}
			p.Rules = append(p.Rules, r)
		}
		ps = append(ps, p)
	}
	return ps
}

func (g *gen) conn() Conn {
	return Conn{
		Peer:    fuzzIDs[g.n(len(fuzzIDs))],
		SrcIP:   fuzzAddrs[g.n(len(fuzzAddrs))],
		DstIP:   fuzzAddrs[g.n(len(fuzzAddrs))],
		DstPort: fuzzPorts[g.n(len(fuzzPorts))],
	}
}

// oracle is those rules written as plainly as possible, sharing no code with rbac.go.
func oracle(policies []*state.Policy, c Conn) Decision {
	live := func(p *state.Policy) bool { return p != nil && !p.DryRun }
	for _, p := range policies {
		if live(p) && p.Action == state.ActionDeny && oracleMatches(p, c) {
			return Decision{Allow: false, Policy: p.Namespace + "/" + p.Name, Reason: ReasonDenied}
		}
	}
	anyAllow := slices.ContainsFunc(policies, func(p *state.Policy) bool { return live(p) && p.Action == state.ActionAllow })
	if !anyAllow {
		return Decision{Allow: true, Reason: ReasonNoAllow}
	}
	for _, p := range policies {
		if live(p) && p.Action == state.ActionAllow && oracleMatches(p, c) {
			return Decision{Allow: true, Policy: p.Namespace + "/" + p.Name, Reason: ReasonAllowed}
		}
	}
	return Decision{Allow: false, Reason: ReasonNoneAllowed}
}

func oracleMatches(p *state.Policy, c Conn) bool {
	return slices.ContainsFunc(p.Rules, func(r state.Rule) bool {
		for _, cl := range r.Clauses {
			if len(cl.Matches) == 0 {
				continue // an empty clause matches
			}
			if !slices.ContainsFunc(cl.Matches, func(m state.Match) bool { return oracleMatch(m, c) }) {
				return false
			}
		}
		return true
	})
}

// field is one AND-ed field type: if pos is non-empty some value must hold; if neg is
// non-empty no value may hold.
func field[T any](pos, neg []T, holds func(T) bool) bool {
	if len(pos) > 0 && !slices.ContainsFunc(pos, holds) {
		return false
	}
	return !slices.ContainsFunc(neg, holds)
}

func oracleMatch(m state.Match, c Conn) bool {
	empty := len(m.Namespaces)+len(m.NotNamespaces)+len(m.Principals)+len(m.NotPrincipals)+
		len(m.SourceIPs)+len(m.NotSourceIPs)+len(m.DestinationIPs)+len(m.NotDestinationIPs)+
		len(m.DestinationPorts)+len(m.NotDestinationPorts)+len(m.ServiceAccounts)+len(m.NotServiceAccounts) == 0
	if empty {
		return false
	}
	str := func(s string) func(state.StringMatch) bool {
		return func(sm state.StringMatch) bool {
			switch sm.Kind {
			case state.MatchExact:
				return s == sm.Value
			case state.MatchPrefix:
				return strings.HasPrefix(s, sm.Value)
			case state.MatchSuffix:
				return strings.HasSuffix(s, sm.Value)
			case state.MatchPresence:
				return len(s) > 0
			default:
				return false
			}
		}
	}
	principal := func(sm state.StringMatch) bool {
		// ztunnel strips "spiffe://" and fails when it is absent, i.e. without a peer.
		rest, ok := strings.CutPrefix(c.Peer.String(), "spiffe://")
		return ok && str(rest)(sm)
	}
	sa := func(s state.ServiceAccountMatch) bool {
		return !c.Peer.IsZero() && s.Namespace == c.Peer.Namespace() && s.ServiceAccount == c.Peer.ServiceAccount()
	}
	in := func(a netip.Addr) func(netip.Prefix) bool {
		return func(p netip.Prefix) bool { return p.Contains(a.Unmap()) }
	}
	port := func(p uint16) bool { return p == c.DstPort }
	return field(m.Namespaces, m.NotNamespaces, str(c.Peer.Namespace())) &&
		field(m.Principals, m.NotPrincipals, principal) &&
		field(m.ServiceAccounts, m.NotServiceAccounts, sa) &&
		field(m.SourceIPs, m.NotSourceIPs, in(c.SrcIP)) &&
		field(m.DestinationIPs, m.NotDestinationIPs, in(c.DstIP)) &&
		field(m.DestinationPorts, m.NotDestinationPorts, port)
}

func FuzzCheck(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte("\x05\x01\x00\x01\x00\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x01\x03"))
	f.Add([]byte("the STRICT deny with not_principals presence and a plaintext peer"))
	f.Add([]byte{4, 1, 3, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 1, 2, 0, 1, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		g := &gen{b: data}
		policies := g.policies()
		c := g.conn()

		got := Check(policies, c)
		want := oracle(policies, c)
		if got != want {
			t.Fatalf("Check = %+v; oracle = %+v\nconn %+v\npolicies %s", got, want, c, dump(policies))
		}

		// Consistency of the Decision itself.
		switch got.Reason {
		case ReasonNoAllow, ReasonAllowed:
			if !got.Allow {
				t.Fatalf("reason %q with Allow=false", got.Reason)
			}
		case ReasonDenied, ReasonNoneAllowed:
			if got.Allow {
				t.Fatalf("reason %q with Allow=true", got.Reason)
			}
		default:
			t.Fatalf("unknown reason %q", got.Reason)
		}

		// Deny overrides, in every order.
		var firstDeny *state.Policy
		for _, p := range policies {
			if p != nil && !p.DryRun && p.Action == state.ActionDeny && Matches(p, c) {
				firstDeny = p
				break
			}
		}
		if firstDeny != nil {
			if got.Allow || got.Reason != ReasonDenied || got.Policy != firstDeny.Key() {
				t.Fatalf("matching DENY %s did not decide: %+v", firstDeny.Key(), got)
			}
			rev := slices.Clone(policies)
			slices.Reverse(rev)
			if d := Check(rev, c); d.Allow || d.Reason != ReasonDenied {
				t.Fatalf("reversed order escaped a matching DENY: %+v", d)
			}
		}

		// Order does not change allow/deny.
		rev := slices.Clone(policies)
		slices.Reverse(rev)
		if d := Check(rev, c); d.Allow != got.Allow {
			t.Fatalf("reversing the policies changed Allow: %+v then %+v", got, d)
		}

		// Dry-run policies never decide: dropping them or flipping their action changes nothing.
		live := slices.DeleteFunc(slices.Clone(policies), func(p *state.Policy) bool { return p != nil && p.DryRun })
		if d := Check(live, c); d != got {
			t.Fatalf("dropping dry-run policies changed %+v to %+v", got, d)
		}
		flipped := make([]*state.Policy, len(policies))
		for i, p := range policies {
			if p != nil && p.DryRun {
				q := *p
				q.Action = 1 - q.Action
				p = &q
			}
			flipped[i] = p
		}
		if d := Check(flipped, c); d != got {
			t.Fatalf("flipping dry-run actions changed %+v to %+v", got, d)
		}

		// A DENY that matches everything always denies.
		denyAll := &state.Policy{Name: "deny-all", Namespace: "z", Action: state.ActionDeny, Rules: []state.Rule{{}}}
		if d := Check(append(slices.Clone(policies), denyAll), c); d.Allow {
			t.Fatalf("deny-all appended, still allowed: %+v", d)
		}
		// An ALLOW that matches everything allows unless a DENY matched.
		allowAll := &state.Policy{Name: "allow-all", Namespace: "z", Action: state.ActionAllow, Rules: []state.Rule{{}}}
		if d := Check(append(slices.Clone(policies), allowAll), c); d.Allow != (firstDeny == nil) {
			t.Fatalf("allow-all appended: %+v (matching deny: %v)", d, firstDeny != nil)
		}
	})
}

func dump(ps []*state.Policy) string {
	var b strings.Builder
	for _, p := range ps {
		if p == nil {
			b.WriteString("\n  <nil>")
			continue
		}
		b.WriteString("\n  ")
		b.WriteString(p.Key())
		if p.DryRun {
			b.WriteString(" (dry-run)")
		}
		if p.Action == state.ActionDeny {
			b.WriteString(" DENY ")
		} else {
			b.WriteString(" ALLOW ")
		}
		for _, r := range p.Rules {
			b.WriteString("\n    rule:")
			for _, cl := range r.Clauses {
				b.WriteString("\n      clause:")
				for _, m := range cl.Matches {
					b.WriteString("\n        ")
					b.WriteString(strings.ReplaceAll(strings.TrimSpace(stringify(m)), "\n", " "))
				}
			}
		}
	}
	return b.String()
}

func stringify(m state.Match) string {
	var b strings.Builder
	add := func(name string, n int, v any) {
		if n > 0 {
			b.WriteString(name)
			b.WriteString("=")
			b.WriteString(strings.TrimSpace(strings.ReplaceAll(fmt.Sprint(v), "\n", " ")))
			b.WriteString(" ")
		}
	}
	add("ns", len(m.Namespaces), m.Namespaces)
	add("!ns", len(m.NotNamespaces), m.NotNamespaces)
	add("principals", len(m.Principals), m.Principals)
	add("!principals", len(m.NotPrincipals), m.NotPrincipals)
	add("src", len(m.SourceIPs), m.SourceIPs)
	add("!src", len(m.NotSourceIPs), m.NotSourceIPs)
	add("dst", len(m.DestinationIPs), m.DestinationIPs)
	add("!dst", len(m.NotDestinationIPs), m.NotDestinationIPs)
	add("ports", len(m.DestinationPorts), m.DestinationPorts)
	add("!ports", len(m.NotDestinationPorts), m.NotDestinationPorts)
	add("sa", len(m.ServiceAccounts), m.ServiceAccounts)
	add("!sa", len(m.NotServiceAccounts), m.NotServiceAccounts)
	if b.Len() == 0 {
		return "(empty)"
	}
	return b.String()
}
