package state

import (
	"net/netip"
	"sort"
	"strconv"
)

// Dump is the JSON view of the cache for /config_dump, with ztunnel's field names.
type Dump struct {
	Workloads []WorkloadDump `json:"workloads"`
	Services  []ServiceDump  `json:"services"`
	Policies  []PolicyDump   `json:"policies"`
}

// GatewayDump is a waypoint or network gateway in the dump.
type GatewayDump struct {
	Destination   string `json:"destination"`
	HBONEMtlsPort uint16 `json:"hboneMtlsPort"`
}

// WorkloadDump is one workload in the dump.
type WorkloadDump struct {
	UID                   string         `json:"uid,omitempty"`
	WorkloadIPs           []string       `json:"workloadIps"`
	Waypoint              *GatewayDump   `json:"waypoint,omitempty"`
	NetworkGateway        *GatewayDump   `json:"networkGateway,omitempty"`
	Protocol              string         `json:"protocol"`
	NetworkMode           string         `json:"networkMode"`
	Name                  string         `json:"name"`
	Namespace             string         `json:"namespace"`
	TrustDomain           string         `json:"trustDomain,omitempty"`
	ServiceAccount        string         `json:"serviceAccount,omitempty"`
	Network               string         `json:"network,omitempty"`
	WorkloadName          string         `json:"workloadName,omitempty"`
	WorkloadType          string         `json:"workloadType,omitempty"`
	CanonicalName         string         `json:"canonicalName,omitempty"`
	CanonicalRevision     string         `json:"canonicalRevision,omitempty"`
	Hostname              string         `json:"hostname,omitempty"`
	Node                  string         `json:"node,omitempty"`
	NativeTunnel          bool           `json:"nativeTunnel,omitempty"`
	ApplicationTunnel     *AppTunnelDump `json:"applicationTunnel,omitempty"`
	AuthorizationPolicies []string       `json:"authorizationPolicies,omitempty"`
	Status                string         `json:"status"`
	ClusterID             string         `json:"clusterId"`
	Locality              *LocalityDump  `json:"locality,omitempty"`
	Services              []string       `json:"services,omitempty"`
	Capacity              uint32         `json:"capacity"`
}

// AppTunnelDump is a workload's application tunnel in the dump.
type AppTunnelDump struct {
	Protocol string `json:"protocol"`
	Port     uint16 `json:"port,omitempty"`
}

// LocalityDump is a workload locality in the dump.
type LocalityDump struct {
	Region  string `json:"region"`
	Zone    string `json:"zone"`
	Subzone string `json:"subzone"`
}

// EndpointDump is one service endpoint in the dump.
type EndpointDump struct {
	WorkloadUID string            `json:"workloadUid"`
	Service     string            `json:"service"`
	Port        map[string]uint16 `json:"port"`
	Status      string            `json:"status"`
}

// LoadBalancerDump is a service's load balancing settings in the dump.
type LoadBalancerDump struct {
	RoutingPreferences []string `json:"routingPreferences"`
	Mode               string   `json:"mode"`
	HealthPolicy       string   `json:"healthPolicy"`
}

// ServiceDump is one service in the dump.
type ServiceDump struct {
	Name            string                  `json:"name"`
	Namespace       string                  `json:"namespace"`
	Hostname        string                  `json:"hostname"`
	VIPs            []string                `json:"vips"`
	Ports           map[string]uint16       `json:"ports"`
	Endpoints       map[string]EndpointDump `json:"endpoints"`
	SubjectAltNames []string                `json:"subjectAltNames"`
	Waypoint        *GatewayDump            `json:"waypoint,omitempty"`
	LoadBalancer    *LoadBalancerDump       `json:"loadBalancer,omitempty"`
	IPFamilies      string                  `json:"ipFamilies,omitempty"`
	Canonical       bool                    `json:"canonical"`
	Visibility      string                  `json:"visibility"`
}

// PolicyDump is one authorization policy in the dump.
type PolicyDump struct {
	Name      string          `json:"name"`
	Namespace string          `json:"namespace"`
	Scope     string          `json:"scope"`
	Action    string          `json:"action"`
	Rules     [][][]MatchDump `json:"rules"`
	DryRun    bool            `json:"dryRun"`
}

// MatchDump is one Match in the dump (string matches as {"Exact": x} ... or {"Presence": []}, like ztunnel).
type MatchDump struct {
	Namespaces          []any    `json:"namespaces,omitempty"`
	NotNamespaces       []any    `json:"notNamespaces,omitempty"`
	ServiceAccounts     []SADump `json:"serviceAccounts,omitempty"`
	NotServiceAccounts  []SADump `json:"notServiceAccounts,omitempty"`
	Principals          []any    `json:"principals,omitempty"`
	NotPrincipals       []any    `json:"notPrincipals,omitempty"`
	SourceIPs           []string `json:"sourceIps,omitempty"`
	NotSourceIPs        []string `json:"notSourceIps,omitempty"`
	DestinationIPs      []string `json:"destinationIps,omitempty"`
	NotDestinationIPs   []string `json:"notDestinationIps,omitempty"`
	DestinationPorts    []uint16 `json:"destinationPorts,omitempty"`
	NotDestinationPorts []uint16 `json:"notDestinationPorts,omitempty"`
}

func gatewayDump(g *GatewayAddress) *GatewayDump {
	if g == nil {
		return nil
	}
	return &GatewayDump{Destination: g.String(), HBONEMtlsPort: g.Port()}
}

func statusString(healthy bool) string {
	if healthy {
		return "Healthy"
	}
	return "Unhealthy"
}

var (
	scopeNames  = [...]string{"Unspecified", "Region", "Zone", "Subzone", "Node", "Cluster", "Network"}
	modeNames   = [...]string{"Unspecified", "Strict", "Failover", "Passthrough"}
	familyNames = [...]string{"Automatic", "IPv4Only", "IPv6Only", "Dual"}
)

// Dump returns the whole state (workloads sorted by uid, services by hostname, policies by
// key) in the JSON shape ztunnel's /config_dump uses. The result is a *Dump.
func (s *Store) Dump() any {
	s.mu.RLock()
	defer s.mu.RUnlock()
	d := &Dump{
		Workloads: make([]WorkloadDump, 0, len(s.idx.workloads)),
		Services:  make([]ServiceDump, 0, len(s.idx.services)),
		Policies:  make([]PolicyDump, 0, len(s.idx.policies)),
	}
	for _, w := range s.idx.workloads {
		d.Workloads = append(d.Workloads, workloadDump(w))
	}
	sort.Slice(d.Workloads, func(i, j int) bool { return d.Workloads[i].UID < d.Workloads[j].UID })
	for key, svc := range s.idx.services {
		d.Services = append(d.Services, s.serviceDumpLocked(key, svc))
	}
	sort.Slice(d.Services, func(i, j int) bool {
		a, b := d.Services[i], d.Services[j]
		return a.Hostname < b.Hostname || a.Hostname == b.Hostname && a.Namespace < b.Namespace
	})
	for _, p := range s.idx.policies {
		d.Policies = append(d.Policies, policyDump(p))
	}
	sort.Slice(d.Policies, func(i, j int) bool {
		return d.Policies[i].Namespace+"/"+d.Policies[i].Name < d.Policies[j].Namespace+"/"+d.Policies[j].Name
	})
	return d
}

func workloadDump(w *Workload) WorkloadDump {
	wd := WorkloadDump{
		UID: w.UID, Waypoint: gatewayDump(w.Waypoint), NetworkGateway: gatewayDump(w.NetworkGateway),
		Protocol: w.Protocol.String(), NetworkMode: "Standard", Name: w.Name, Namespace: w.Namespace,
		TrustDomain: w.TrustDomain, ServiceAccount: w.ServiceAccount, Network: w.Network,
		WorkloadName: w.WorkloadName, WorkloadType: w.WorkloadType.String(),
		CanonicalName: w.CanonicalName, CanonicalRevision: w.CanonicalRevision, Hostname: w.Hostname,
		Node: w.Node, NativeTunnel: w.NativeTunnel, AuthorizationPolicies: w.AuthorizationPolicies,
		Status: statusString(w.Healthy), ClusterID: w.ClusterID, Capacity: w.Capacity,
		WorkloadIPs: make([]string, len(w.Addresses)), Services: make([]string, 0, len(w.Services)),
	}
	if wd.AuthorizationPolicies == nil {
		wd.AuthorizationPolicies = []string{}
	}
	if w.NetworkMode == NetworkHostNetwork {
		wd.NetworkMode = "HostNetwork"
	}
	for i, a := range w.Addresses {
		wd.WorkloadIPs[i] = a.String()
	}
	if w.AppTunnel != nil {
		wd.ApplicationTunnel = &AppTunnelDump{Protocol: "NONE", Port: w.AppTunnel.Port}
		if w.AppTunnel.Protocol == AppTunnelProxy {
			wd.ApplicationTunnel.Protocol = "PROXY"
		}
	}
	if w.Locality != (Locality{}) {
		wd.Locality = &LocalityDump{w.Locality.Region, w.Locality.Zone, w.Locality.Subzone}
	}
	for k := range w.Services {
		wd.Services = append(wd.Services, k)
	}
	sort.Strings(wd.Services)
	return wd
}

func portsDump(m map[uint16]uint16) map[string]uint16 {
	out := make(map[string]uint16, len(m))
	for k, v := range m {
		out[strconv.Itoa(int(k))] = v
	}
	return out
}

func (s *Store) serviceDumpLocked(key string, svc *Service) ServiceDump {
	sd := ServiceDump{
		Name: svc.Name, Namespace: svc.Namespace, Hostname: svc.Hostname,
		VIPs: make([]string, len(svc.Addresses)), Ports: portsDump(svc.Ports),
		Endpoints: make(map[string]EndpointDump), SubjectAltNames: svc.SubjectAltNames,
		Waypoint: gatewayDump(svc.Waypoint), Canonical: svc.Canonical,
	}
	if sd.SubjectAltNames == nil {
		sd.SubjectAltNames = []string{}
	}
	if svc.IPFamilies != 0 && int(svc.IPFamilies) < len(familyNames) { // unset: omitted, as by the Rust ztunnel
		sd.IPFamilies = familyNames[svc.IPFamilies]
	}
	sd.Visibility = "Public" // the Rust ztunnel's names for the two visibilities
	if svc.Visibility == VisibilityNamespace {
		sd.Visibility = "Namespace"
	}
	for i, a := range svc.Addresses {
		sd.VIPs[i] = a.String()
	}
	if lb := svc.LoadBalancing; lb != nil {
		ld := &LoadBalancerDump{Mode: modeNames[lb.Mode%4], HealthPolicy: "OnlyHealthy"}
		if lb.HealthPolicy == AllowAll {
			ld.HealthPolicy = "AllowAll"
		}
		for _, p := range lb.RoutingPreference {
			ld.RoutingPreferences = append(ld.RoutingPreferences, scopeNames[int(p)%len(scopeNames)])
		}
		sd.LoadBalancer = ld
	}
	for w, ports := range s.idx.endpoints[key] {
		sd.Endpoints[w.UID] = EndpointDump{
			WorkloadUID: w.UID, Service: key, Port: portsDump(ports), Status: statusString(w.Healthy),
		}
	}
	return sd
}

func stringMatchesDump(ms []StringMatch) []any {
	if len(ms) == 0 {
		return nil
	}
	out := make([]any, len(ms))
	for i, m := range ms {
		switch m.Kind {
		case MatchExact:
			out[i] = map[string]string{"Exact": m.Value}
		case MatchPrefix:
			out[i] = map[string]string{"Prefix": m.Value}
		case MatchSuffix:
			out[i] = map[string]string{"Suffix": m.Value}
		default:
			// {"Presence": []}, as serde writes the Rust ztunnel's StringMatch::Presence()
			// tuple variant: istioctl reads it into its StringMatch's any-typed Presence
			// field, where a bare "Presence" string fails to decode the whole dump.
			out[i] = map[string][]string{"Presence": {}}
		}
	}
	return out
}

func prefixesDump(ps []netip.Prefix) []string {
	if len(ps) == 0 {
		return nil
	}
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

// SADump is a service-account match in the dump, in the local file's shape.
type SADump struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

func saDump(ms []ServiceAccountMatch) []SADump {
	if len(ms) == 0 {
		return nil
	}
	out := make([]SADump, len(ms))
	for i, m := range ms {
		out[i] = SADump(m)
	}
	return out
}

var policyScopeNames = [...]string{"Global", "Namespace", "WorkloadSelector"}

func policyDump(p *Policy) PolicyDump {
	pd := PolicyDump{Name: p.Name, Namespace: p.Namespace, Scope: policyScopeNames[int(p.Scope)%3],
		Action: "Allow", DryRun: p.DryRun, Rules: make([][][]MatchDump, len(p.Rules))}
	if p.Action == ActionDeny {
		pd.Action = "Deny"
	}
	for i, r := range p.Rules {
		pd.Rules[i] = make([][]MatchDump, len(r.Clauses))
		for j, c := range r.Clauses {
			pd.Rules[i][j] = make([]MatchDump, len(c.Matches))
			for k, m := range c.Matches {
				pd.Rules[i][j][k] = MatchDump{
					Namespaces: stringMatchesDump(m.Namespaces), NotNamespaces: stringMatchesDump(m.NotNamespaces),
					Principals: stringMatchesDump(m.Principals), NotPrincipals: stringMatchesDump(m.NotPrincipals),
					ServiceAccounts: saDump(m.ServiceAccounts), NotServiceAccounts: saDump(m.NotServiceAccounts),
					SourceIPs: prefixesDump(m.SourceIPs), NotSourceIPs: prefixesDump(m.NotSourceIPs),
					DestinationIPs: prefixesDump(m.DestinationIPs), NotDestinationIPs: prefixesDump(m.NotDestinationIPs),
					DestinationPorts: m.DestinationPorts, NotDestinationPorts: m.NotDestinationPorts,
				}
			}
		}
	}
	return pd
}
