package rbac

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/xds/state"
)

var (
	sleepID = identity.MustParse("spiffe://cluster.local/ns/default/sa/sleep")
	otherID = identity.MustParse("spiffe://example.org/ns/prod/sa/api")

	mtlsConn = Conn{
		Peer:    sleepID,
		SrcIP:   netip.MustParseAddr("10.0.0.1"),
		DstIP:   netip.MustParseAddr("10.0.1.2"),
		DstPort: 8080,
	}
	plainConn = Conn{
		SrcIP:   netip.MustParseAddr("10.0.0.1"),
		DstIP:   netip.MustParseAddr("10.0.1.2"),
		DstPort: 8080,
	}
)

func exact(v string) state.StringMatch  { return state.StringMatch{Kind: state.MatchExact, Value: v} }
func prefix(v string) state.StringMatch { return state.StringMatch{Kind: state.MatchPrefix, Value: v} }
func suffix(v string) state.StringMatch { return state.StringMatch{Kind: state.MatchSuffix, Value: v} }

var presence = state.StringMatch{Kind: state.MatchPresence}

func cidr(s string) netip.Prefix { return netip.MustParsePrefix(s) }

// policy builds a policy with one rule holding one clause holding the given matches.
func policy(name string, action state.PolicyAction, ms ...state.Match) *state.Policy {
	return &state.Policy{
		Name: name, Namespace: "ns", Action: action,
		Rules: []state.Rule{{Clauses: []state.Clause{{Matches: ms}}}},
	}
}

func allow(name string, ms ...state.Match) *state.Policy {
	return policy(name, state.ActionAllow, ms...)
}
func deny(name string, ms ...state.Match) *state.Policy { return policy(name, state.ActionDeny, ms...) }
func dryRun(p *state.Policy) *state.Policy              { p.DryRun = true; return p }

// TestMatch covers every field of a Match, positive and not_, against an mTLS and a
// plaintext connection.
func TestMatch(t *testing.T) {
	tests := []struct {
		name        string
		m           state.Match
		mtls, plain bool
	}{
		{"empty match never matches", state.Match{}, false, false},

		{"namespace exact", state.Match{Namespaces: []state.StringMatch{exact("default")}}, true, false},
		{"namespace exact other", state.Match{Namespaces: []state.StringMatch{exact("prod")}}, false, false},
		{"namespace prefix", state.Match{Namespaces: []state.StringMatch{prefix("def")}}, true, false},
		{"namespace suffix", state.Match{Namespaces: []state.StringMatch{suffix("ault")}}, true, false},
		{"namespace presence", state.Match{Namespaces: []state.StringMatch{presence}}, true, false},
		{"namespace values ORed", state.Match{Namespaces: []state.StringMatch{exact("prod"), exact("default")}}, true, false},
		{"not namespace", state.Match{NotNamespaces: []state.StringMatch{exact("default")}}, false, true},
		{"not namespace other", state.Match{NotNamespaces: []state.StringMatch{exact("prod")}}, true, true},
		{"not namespace presence", state.Match{NotNamespaces: []state.StringMatch{presence}}, false, true},

		{"principal exact without scheme", state.Match{Principals: []state.StringMatch{exact("cluster.local/ns/default/sa/sleep")}}, true, false},
		{"principal exact with scheme never matches", state.Match{Principals: []state.StringMatch{exact("spiffe://cluster.local/ns/default/sa/sleep")}}, false, false},
		{"principal prefix", state.Match{Principals: []state.StringMatch{prefix("cluster.local/ns/default/")}}, true, false},
		{"principal suffix", state.Match{Principals: []state.StringMatch{suffix("/sa/sleep")}}, true, false},
		{"principal suffix other", state.Match{Principals: []state.StringMatch{suffix("/sa/api")}}, false, false},
		{"principal presence", state.Match{Principals: []state.StringMatch{presence}}, true, false},
		{"principal empty prefix needs a peer", state.Match{Principals: []state.StringMatch{prefix("")}}, true, false},
		{"principal exact empty needs a peer", state.Match{Principals: []state.StringMatch{exact("")}}, false, false},
		{"not principal", state.Match{NotPrincipals: []state.StringMatch{exact("cluster.local/ns/default/sa/sleep")}}, false, true},
		{"not principal other", state.Match{NotPrincipals: []state.StringMatch{suffix("/sa/api")}}, true, true},
		{"STRICT shape: not principals presence", state.Match{NotPrincipals: []state.StringMatch{presence}}, false, true},

		{"service account", state.Match{ServiceAccounts: []state.ServiceAccountMatch{{Namespace: "default", ServiceAccount: "sleep"}}}, true, false},
		{"service account wrong ns", state.Match{ServiceAccounts: []state.ServiceAccountMatch{{Namespace: "prod", ServiceAccount: "sleep"}}}, false, false},
		{"service account wrong sa", state.Match{ServiceAccounts: []state.ServiceAccountMatch{{Namespace: "default", ServiceAccount: "api"}}}, false, false},
		{"service account empty", state.Match{ServiceAccounts: []state.ServiceAccountMatch{{}}}, false, false},
		{"not service account", state.Match{NotServiceAccounts: []state.ServiceAccountMatch{{Namespace: "default", ServiceAccount: "sleep"}}}, false, true},
		{"not service account other", state.Match{NotServiceAccounts: []state.ServiceAccountMatch{{Namespace: "prod", ServiceAccount: "api"}}}, true, true},

		{"source ip cidr", state.Match{SourceIPs: []netip.Prefix{cidr("10.0.0.0/24")}}, true, true},
		{"source ip host", state.Match{SourceIPs: []netip.Prefix{cidr("10.0.0.1/32")}}, true, true},
		{"source ip miss", state.Match{SourceIPs: []netip.Prefix{cidr("10.0.0.2/32"), cidr("192.168.0.0/16")}}, false, false},
		{"source ip v6 prefix never holds v4", state.Match{SourceIPs: []netip.Prefix{cidr("::/0")}}, false, false},
		{"source ip ORed", state.Match{SourceIPs: []netip.Prefix{cidr("192.168.0.0/16"), cidr("10.0.0.0/8")}}, true, true},
		{"not source ip", state.Match{NotSourceIPs: []netip.Prefix{cidr("10.0.0.0/24")}}, false, false},
		{"not source ip other", state.Match{NotSourceIPs: []netip.Prefix{cidr("10.9.0.0/16")}}, true, true},
		{"source and not source", state.Match{SourceIPs: []netip.Prefix{cidr("10.0.0.0/8")}, NotSourceIPs: []netip.Prefix{cidr("10.0.0.1/32")}}, false, false},

		{"destination ip", state.Match{DestinationIPs: []netip.Prefix{cidr("10.0.1.0/24")}}, true, true},
		{"destination ip miss", state.Match{DestinationIPs: []netip.Prefix{cidr("10.0.0.0/24")}}, false, false},
		{"not destination ip", state.Match{NotDestinationIPs: []netip.Prefix{cidr("10.0.1.2/32")}}, false, false},
		{"not destination ip other", state.Match{NotDestinationIPs: []netip.Prefix{cidr("10.0.0.2/32")}}, true, true},

		{"port", state.Match{DestinationPorts: []uint16{8080}}, true, true},
		{"port ORed", state.Match{DestinationPorts: []uint16{80, 8080}}, true, true},
		{"port miss (15008 is never the port)", state.Match{DestinationPorts: []uint16{15008}}, false, false},
		{"not port", state.Match{NotDestinationPorts: []uint16{8080}}, false, false},
		{"not port other", state.Match{NotDestinationPorts: []uint16{9090}}, true, true},

		{"fields ANDed: all hit", state.Match{
			Namespaces:       []state.StringMatch{exact("default")},
			Principals:       []state.StringMatch{suffix("/sa/sleep")},
			SourceIPs:        []netip.Prefix{cidr("10.0.0.0/8")},
			DestinationIPs:   []netip.Prefix{cidr("10.0.1.2/32")},
			DestinationPorts: []uint16{8080},
			ServiceAccounts:  []state.ServiceAccountMatch{{Namespace: "default", ServiceAccount: "sleep"}},
		}, true, false},
		{"fields ANDed: port misses", state.Match{
			Namespaces:       []state.StringMatch{exact("default")},
			SourceIPs:        []netip.Prefix{cidr("10.0.0.0/8")},
			DestinationPorts: []uint16{9090},
		}, false, false},
		{"STRICT with port exception: excepted port", state.Match{
			NotPrincipals:       []state.StringMatch{presence},
			NotDestinationPorts: []uint16{8080},
		}, false, false},
		{"STRICT with port exception: other port", state.Match{
			NotPrincipals:       []state.StringMatch{presence},
			NotDestinationPorts: []uint16{9090},
		}, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := deny("p", tt.m)
			if got := Matches(p, mtlsConn); got != tt.mtls {
				t.Errorf("mTLS conn: got match %v; want %v", got, tt.mtls)
			}
			if got := Matches(p, plainConn); got != tt.plain {
				t.Errorf("plaintext conn: got match %v; want %v", got, tt.plain)
			}
		})
	}
}

func TestMappedAddress(t *testing.T) {
	c := mtlsConn
	c.SrcIP = netip.MustParseAddr("::ffff:10.0.0.1")
	if !Matches(deny("p", state.Match{SourceIPs: []netip.Prefix{cidr("10.0.0.0/24")}}), c) {
		t.Error("v4-mapped source did not match its v4 prefix")
	}
	if Matches(deny("p", state.Match{NotSourceIPs: []netip.Prefix{cidr("10.0.0.0/24")}}), c) {
		t.Error("v4-mapped source escaped a not_source_ips v4 prefix")
	}
}

// TestStructure covers how rules, clauses and matches combine.
func TestStructure(t *testing.T) {
	hit := state.Match{DestinationPorts: []uint16{8080}}
	miss := state.Match{DestinationPorts: []uint16{1}}
	tests := []struct {
		name  string
		rules []state.Rule
		want  bool
	}{
		{"no rules never matches", nil, false},
		{"empty rule matches", []state.Rule{{}}, true},
		{"rule with an empty clause matches", []state.Rule{{Clauses: []state.Clause{{}}}}, true},
		{"clause of only empty matches never matches", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{}, {}}}}}}, false},
		{"empty match skipped, next one counts", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{}, hit}}}}}, true},
		{"clause ORs matches", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{miss, hit}}}}}, true},
		{"clause all miss", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{miss, miss}}}}}, false},
		{"rule ANDs clauses: both hit", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{hit}}, {Matches: []state.Match{hit}}}}}, true},
		{"rule ANDs clauses: one misses", []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{hit}}, {Matches: []state.Match{miss}}}}}, false},
		{"policy ORs rules", []state.Rule{
			{Clauses: []state.Clause{{Matches: []state.Match{miss}}}},
			{Clauses: []state.Clause{{Matches: []state.Match{hit}}}},
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &state.Policy{Name: "p", Namespace: "ns", Action: state.ActionDeny, Rules: tt.rules}
			if got := Matches(p, mtlsConn); got != tt.want {
				t.Errorf("got match %v; want %v", got, tt.want)
			}
		})
	}
}

// TestCheck covers the decision order of Istio's AuthorizationPolicy.
func TestCheck(t *testing.T) {
	hit := state.Match{DestinationPorts: []uint16{8080}}
	miss := state.Match{DestinationPorts: []uint16{1}}
	strict := &state.Policy{
		Name: "istio_converted_static_strict", Namespace: "istio-system", Scope: state.ScopeGlobal, Action: state.ActionDeny,
		Rules: []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{NotPrincipals: []state.StringMatch{presence}}}}}}},
	}
	tests := []struct {
		name     string
		policies []*state.Policy
		conn     Conn
		want     Decision
	}{
		{"no policies allows", nil, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"nil entries ignored", []*state.Policy{nil}, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"non-matching deny allows", []*state.Policy{deny("d", miss)}, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"matching deny denies", []*state.Policy{deny("d", hit)}, mtlsConn, Decision{Policy: "ns/d", Reason: ReasonDenied}},
		{"deny wins over allow listed first", []*state.Policy{allow("a", hit), deny("d", hit)}, mtlsConn, Decision{Policy: "ns/d", Reason: ReasonDenied}},
		{"first matching deny named", []*state.Policy{deny("d1", miss), deny("d2", hit), deny("d3", hit)}, mtlsConn, Decision{Policy: "ns/d2", Reason: ReasonDenied}},
		{"matching allow allows", []*state.Policy{allow("a1", miss), allow("a2", hit)}, mtlsConn, Decision{Allow: true, Policy: "ns/a2", Reason: ReasonAllowed}},
		{"allow exists, none matches", []*state.Policy{allow("a", miss)}, mtlsConn, Decision{Reason: ReasonNoneAllowed}},
		{"allow with no rules denies all", []*state.Policy{{Name: "a", Namespace: "ns"}}, mtlsConn, Decision{Reason: ReasonNoneAllowed}},
		{"dry-run deny ignored", []*state.Policy{dryRun(deny("d", hit))}, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"dry-run allow does not count as an allow policy", []*state.Policy{dryRun(allow("a", miss))}, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"dry-run allow does not allow", []*state.Policy{dryRun(allow("a1", hit)), allow("a2", miss)}, mtlsConn, Decision{Reason: ReasonNoneAllowed}},
		{"STRICT denies plaintext", []*state.Policy{strict}, plainConn, Decision{Policy: "istio-system/istio_converted_static_strict", Reason: ReasonDenied}},
		{"STRICT allows mTLS", []*state.Policy{strict}, mtlsConn, Decision{Allow: true, Reason: ReasonNoAllow}},
		{"allow by principal, plaintext denied", []*state.Policy{allow("a", state.Match{Principals: []state.StringMatch{presence}})}, plainConn, Decision{Reason: ReasonNoneAllowed}},
		{"allow by principal, other peer denied", []*state.Policy{allow("a", state.Match{Principals: []state.StringMatch{exact("cluster.local/ns/default/sa/sleep")}})}, Conn{Peer: otherID, DstPort: 8080}, Decision{Reason: ReasonNoneAllowed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Check(tt.policies, tt.conn); got != tt.want {
				t.Errorf("got %+v; want %+v", got, tt.want)
			}
		})
	}
}

func TestDryRunMatches(t *testing.T) {
	hit := state.Match{DestinationPorts: []uint16{8080}}
	miss := state.Match{DestinationPorts: []uint16{1}}
	ps := []*state.Policy{dryRun(deny("d1", hit)), deny("d2", hit), dryRun(allow("a1", miss)), nil, dryRun(allow("a2", hit))}
	var got []string
	for p := range DryRunMatches(ps, mtlsConn) {
		got = append(got, p.Key())
	}
	if want := []string{"ns/d1", "ns/a2"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v; want %v", got, want)
	}
	for range DryRunMatches(ps, mtlsConn) {
		break // stopping early must not panic
	}
}

func TestDecisionString(t *testing.T) {
	d := Check([]*state.Policy{deny("d", state.Match{DestinationPorts: []uint16{8080}})}, mtlsConn)
	if got, want := d.String(), "explicitly denied by: ns/d"; got != want {
		t.Errorf("got %q; want %q", got, want)
	}
	if got, want := (Decision{Reason: ReasonNoneAllowed}).String(), "allow policies exist, but none allowed"; got != want {
		t.Errorf("got %q; want %q", got, want)
	}
}

func TestKeyCacheReset(t *testing.T) {
	for i := range policyCacheMaxNames + 10 {
		p := &state.Policy{Namespace: "ns", Name: fmt.Sprint(i)}
		if got, want := key(p), p.Key(); got != want {
			t.Fatalf("key = %q; want %q", got, want)
		}
	}
	keys.mu.RLock()
	n := len(keys.m)
	keys.mu.RUnlock()
	if n > policyCacheMaxNames {
		t.Errorf("key cache holds %d names; want at most %d", n, policyCacheMaxNames)
	}
}

func TestCheckAllocs(t *testing.T) {
	policies := []*state.Policy{
		deny("strict", state.Match{NotPrincipals: []state.StringMatch{presence}}),
		deny("d", state.Match{SourceIPs: []netip.Prefix{cidr("192.168.0.0/16")}, Namespaces: []state.StringMatch{prefix("kube-")}}),
		allow("a", state.Match{Principals: []state.StringMatch{suffix("/sa/sleep")}, DestinationPorts: []uint16{8080}}),
	}
	for _, c := range []Conn{mtlsConn, plainConn} {
		Check(policies, c) // warm the key cache
		if n := testing.AllocsPerRun(1000, func() { Check(policies, c) }); n != 0 {
			t.Errorf("Check(%v) allocates %v times per run; want 0", c.Peer, n)
		}
	}
}

// benchPolicies builds n DENY policies of 10 rules each that never match a connection from
// 10.0.0.1 (as ztunnel's rbac bench: 10,000 x 10).
func benchPolicies(n int) []*state.Policy {
	ps := make([]*state.Policy, n)
	for i := range ps {
		p := &state.Policy{Name: fmt.Sprintf("deny-%d", i), Namespace: "ns", Action: state.ActionDeny}
		for r := range 10 {
			p.Rules = append(p.Rules, state.Rule{Clauses: []state.Clause{
				{Matches: []state.Match{{SourceIPs: []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{192, 168, byte(i), byte(r)}), 32)}}}},
				{Matches: []state.Match{{Namespaces: []state.StringMatch{exact("default")}, Principals: []state.StringMatch{prefix("cluster.local/")}}}},
			}})
		}
		ps[i] = p
	}
	return ps
}

func BenchmarkCheck(b *testing.B) {
	for _, n := range []int{1, 100, 10000} {
		ps := benchPolicies(n)
		b.Run(fmt.Sprintf("deny=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if !Check(ps, mtlsConn).Allow {
					b.Fatal("denied")
				}
			}
		})
		// Baseline: the naive closure-based oracle of fuzz_test.go on the same policies.
		b.Run(fmt.Sprintf("baseline-oracle/deny=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if !oracle(ps, mtlsConn).Allow {
					b.Fatal("denied")
				}
			}
		})
	}
}
