package state

import "net/netip"

// PolicyScope says which workloads an authorization policy applies to.
type PolicyScope uint8

const (
	ScopeGlobal           PolicyScope = iota // every workload (stored under namespace "")
	ScopeNamespace                           // every workload in Policy.Namespace
	ScopeWorkloadSelector                    // workloads that list the policy's key
)

// PolicyAction is what a matching policy does.
type PolicyAction uint8

const (
	ActionAllow PolicyAction = iota
	ActionDeny
)

// Policy is one istio.security.Authorization resource. A connection matches the policy when
// any Rule matches; a policy with no rules never matches.
type Policy struct {
	Name      string
	Namespace string
	Scope     PolicyScope
	Action    PolicyAction
	Rules     []Rule
	DryRun    bool
	Digest    uint64 // as Workload.Digest
}

// Key is the policy's resource name, "namespace/name", the form workloads reference.
func (p *Policy) Key() string { return p.Namespace + "/" + p.Name }

// Rule matches when every clause matches (AND); a rule with no clauses matches everything.
type Rule struct {
	Clauses []Clause
}

// Clause matches when any of its matches matches (OR).
type Clause struct {
	Matches []Match
}

// Match ANDs each non-empty field; values within a field are ORed; Not* fields match when
// none of their values match. A Match with every field empty never matches.
type Match struct {
	Namespaces, NotNamespaces             []StringMatch
	Principals, NotPrincipals             []StringMatch // identity without "spiffe://"
	SourceIPs, NotSourceIPs               []netip.Prefix
	DestinationIPs, NotDestinationIPs     []netip.Prefix
	DestinationPorts, NotDestinationPorts []uint16
	ServiceAccounts, NotServiceAccounts   []ServiceAccountMatch
}

// StringMatchKind is how a StringMatch compares.
type StringMatchKind uint8

const (
	MatchExact StringMatchKind = iota
	MatchPrefix
	MatchSuffix
	MatchPresence // any non-empty value
)

// StringMatch is one istio.security.StringMatch.
type StringMatch struct {
	Kind  StringMatchKind
	Value string
}

// ServiceAccountMatch matches a peer's namespace and service account.
type ServiceAccountMatch struct {
	Namespace      string
	ServiceAccount string
}
