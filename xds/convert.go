package xds

import (
	"errors"
	"fmt"
	"math"
	"net/netip"
	"strings"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// Conversion from the wire protos to state types. These functions take no locks and keep no
// references to the protos; the xDS stream and the local file both go through them.

var errEmpty = errors.New("empty")

func ipFromBytes(b []byte) (netip.Addr, error) {
	ip, ok := netip.AddrFromSlice(b)
	if !ok {
		return netip.Addr{}, fmt.Errorf("address of %d bytes, want 4 or 16", len(b))
	}
	return ip.Unmap(), nil
}

func port16(v uint32, what string) (uint16, error) {
	if v > math.MaxUint16 {
		return 0, fmt.Errorf("%s %d out of range", what, v)
	}
	return uint16(v), nil
}

// ConvertAddress converts an istio.workload.Address into a workload or a service.
func ConvertAddress(a *workloadpb.Address) (*state.Workload, *state.Service, error) {
	return convertAddress(a, nil)
}

func convertAddress(a *workloadpb.Address, in *interner) (*state.Workload, *state.Service, error) {
	switch t := a.GetType().(type) {
	case *workloadpb.Address_Workload:
		w, err := workloadResource(t.Workload, in)
		return w, nil, err
	case *workloadpb.Address_Service:
		s, err := convertService(t.Service, in)
		if err != nil {
			return nil, nil, resourceErr("service", t.Service.GetNamespace()+"/"+t.Service.GetHostname(), err)
		}
		return nil, s, nil
	default:
		return nil, nil, errors.New("xds: address has neither workload nor service")
	}
}

func convertGateway(g *workloadpb.GatewayAddress, in *interner) (*state.GatewayAddress, error) {
	if g == nil {
		return nil, nil
	}
	out := &state.GatewayAddress{}
	p, err := port16(g.GetHboneMtlsPort(), "hbone_mtls_port")
	if err != nil {
		return nil, err
	}
	out.HBONEPort = p
	switch d := g.GetDestination().(type) {
	case *workloadpb.GatewayAddress_Hostname:
		if d.Hostname.GetHostname() == "" {
			return nil, errors.New("gateway hostname is empty")
		}
		out.Namespace, out.Hostname = in.str(d.Hostname.GetNamespace()), in.str(d.Hostname.GetHostname())
	case *workloadpb.GatewayAddress_Address:
		ip, err := ipFromBytes(d.Address.GetAddress())
		if err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
		out.Network, out.Address = in.str(d.Address.GetNetwork()), ip
	default:
		return nil, errors.New("gateway has no destination")
	}
	return out, nil
}

func convertPorts(ps []*workloadpb.Port, in *interner) (map[uint16]uint16, error) {
	pairs, err := appendPorts(nil, ps)
	if err != nil {
		return nil, err
	}
	return in.portsOf(pairs), nil
}

// resourceError is a resource that did not convert: `workload "uid": uid: empty`. The
// Convert functions return it behind the package's prefix ("xds: "); the local file source
// puts the entry's line there instead.
type resourceError struct {
	kind, name string
	err        error
}

func (e *resourceError) Error() string { return fmt.Sprintf("%s %q: %v", e.kind, e.name, e.err) }
func (e *resourceError) Unwrap() error { return e.err }

func resourceErr(kind, name string, err error) error {
	return fmt.Errorf("xds: %w", &resourceError{kind, name, err})
}

// ConvertWorkload converts one istio.workload.Workload, applying ztunnel's defaults (trust
// domain cluster.local, service account default, cluster Kubernetes, capacity 1).
func ConvertWorkload(p *workloadpb.Workload) (*state.Workload, error) {
	return workloadResource(p, nil)
}

// workloadResource is convertWorkload with its error naming the workload (by a copy of the
// uid: p's strings may alias a push's message).
func workloadResource(p *workloadpb.Workload, in *interner) (*state.Workload, error) {
	w, err := convertWorkload(p, in)
	if err != nil {
		return nil, resourceErr("workload", strings.Clone(p.GetUid()), err)
	}
	return w, nil
}

func convertWorkload(p *workloadpb.Workload, in *interner) (*state.Workload, error) {
	if p.GetUid() == "" {
		return nil, fmt.Errorf("uid: %w", errEmpty)
	}
	w, addrs := newWorkload(len(p.GetAddresses()))
	*w = state.Workload{
		UID: in.own(p.GetUid()), Name: p.GetName(), Node: in.str(p.GetNode()), Hostname: in.own(p.GetHostname()),
		Healthy:  p.GetStatus() == workloadpb.WorkloadStatus_HEALTHY,
		Capacity: 1,
	}
	// A Kubernetes UID ends in "/"+name: keep one string, not two.
	if n := len(w.UID) - len(w.Name); n > 0 && w.Name != "" && w.UID[n-1] == '/' && w.UID[n:] == w.Name {
		w.Name = w.UID[n:]
	} else {
		w.Name = in.own(w.Name)
	}
	if c := p.GetCapacity(); c != nil {
		w.Capacity = c.GetValue()
	}
	if len(p.GetAddresses()) > 0 {
		w.Addresses = addrs
		for i, b := range p.GetAddresses() {
			ip, err := ipFromBytes(b)
			if err != nil {
				return nil, fmt.Errorf("addresses[%d]: %w", i, err)
			}
			w.Addresses[i] = ip
		}
	}
	var key metaHash // the hash of the meta's key in the push (none without an interner)
	if in != nil {
		if k, ok := in.metaKey(p); ok {
			key = hashMetaKey(k)
			if m := in.metas[key]; m != nil {
				w.WorkloadMeta = m
				return w, nil
			}
		}
	}
	// Built on the stack; interned by value, so the pods of a deployment share one.
	m := state.WorkloadMeta{
		Namespace: in.str(p.GetNamespace()), Network: in.str(p.GetNetwork()),
		TrustDomain: in.str(p.GetTrustDomain()), ServiceAccount: in.str(p.GetServiceAccount()),
		CanonicalName: in.str(p.GetCanonicalName()), CanonicalRevision: in.str(p.GetCanonicalRevision()),
		WorkloadName: in.str(p.GetWorkloadName()), ClusterID: in.str(p.GetClusterId()), NativeTunnel: p.GetNativeTunnel(),
		AuthorizationPolicies: p.GetAuthorizationPolicies(),
	}
	if m.TrustDomain == "" {
		m.TrustDomain = state.DefaultTrustDomain
	}
	if m.ServiceAccount == "" {
		m.ServiceAccount = state.DefaultServiceAccount
	}
	if m.ClusterID == "" {
		m.ClusterID = istiogrpc.DefaultClusterID
	}
	switch p.GetTunnelProtocol() {
	case workloadpb.TunnelProtocol_NONE:
		m.Protocol = state.TunnelNone
	case workloadpb.TunnelProtocol_HBONE:
		m.Protocol = state.TunnelHBONE
	default:
		return nil, fmt.Errorf("unsupported tunnel_protocol %v", p.GetTunnelProtocol())
	}
	switch p.GetNetworkMode() {
	case workloadpb.NetworkMode_STANDARD:
	case workloadpb.NetworkMode_HOST_NETWORK:
		m.NetworkMode = state.NetworkHostNetwork
	default:
		return nil, fmt.Errorf("unknown network_mode %d", p.GetNetworkMode())
	}
	if t := p.GetWorkloadType(); t >= 0 && t <= workloadpb.WorkloadType_JOB {
		m.WorkloadType = state.WorkloadType(t)
	}
	var err error
	if m.Waypoint, err = convertGateway(p.GetWaypoint(), in); err != nil {
		return nil, fmt.Errorf("waypoint: %w", err)
	}
	if m.NetworkGateway, err = convertGateway(p.GetNetworkGateway(), in); err != nil {
		return nil, fmt.Errorf("network_gateway: %w", err)
	}
	if at := p.GetApplicationTunnel(); at != nil {
		port, err := port16(at.GetPort(), "application_tunnel.port")
		if err != nil {
			return nil, err
		}
		m.AppTunnel = &state.AppTunnel{Port: port}
		switch at.GetProtocol() {
		case workloadpb.ApplicationTunnel_NONE:
		case workloadpb.ApplicationTunnel_PROXY:
			m.AppTunnel.Protocol = state.AppTunnelProxy
		default:
			return nil, fmt.Errorf("unknown application_tunnel.protocol %d", at.GetProtocol())
		}
	}
	if l := p.GetLocality(); l != nil {
		m.Locality = state.Locality{Region: in.str(l.GetRegion()), Zone: in.str(l.GetZone()), Subzone: in.str(l.GetSubzone())}
	}
	if len(p.GetServices()) > 0 {
		if m.Services, err = in.services(p.GetServices()); err != nil {
			return nil, err
		}
	}
	w.WorkloadMeta = in.meta(&m, key)
	return w, nil
}

// newWorkload returns a zero workload and room for its n addresses. A pod has one or two
// (dual-stack): they are allocated with the workload, one object where there were two for
// the allocator to hand out and the collector to mark, a million fewer in a 1M push.
func newWorkload(n int) (*state.Workload, []netip.Addr) {
	switch n {
	case 1:
		x := new(struct {
			w state.Workload
			a [1]netip.Addr
		})
		return &x.w, x.a[:]
	case 2:
		x := new(struct {
			w state.Workload
			a [2]netip.Addr
		})
		return &x.w, x.a[:]
	}
	return new(state.Workload), make([]netip.Addr, n)
}

// ConvertService converts one istio.workload.Service.
func ConvertService(p *workloadpb.Service) (*state.Service, error) {
	s, err := convertService(p, nil)
	if err != nil {
		return nil, resourceErr("service", p.GetNamespace()+"/"+p.GetHostname(), err)
	}
	return s, nil
}

func convertService(p *workloadpb.Service, in *interner) (*state.Service, error) {
	if p.GetHostname() == "" {
		return nil, fmt.Errorf("hostname: %w", errEmpty)
	}
	s := &state.Service{
		Name: p.GetName(), Namespace: in.str(p.GetNamespace()), Hostname: p.GetHostname(),
		SubjectAltNames: p.GetSubjectAltNames(), Canonical: p.GetCanonical(),
		IngressUseWaypoint: p.GetIngressUseWaypoint(),
	}
	for i, a := range p.GetAddresses() {
		ip, err := ipFromBytes(a.GetAddress())
		if err != nil {
			return nil, fmt.Errorf("addresses[%d]: %w", i, err)
		}
		na := state.NetworkAddress{Network: a.GetNetwork(), Address: ip}
		if a.Length != nil {
			pfx, err := ip.Prefix(int(a.GetLength()))
			if err != nil || int(a.GetLength()) > ip.BitLen() {
				return nil, fmt.Errorf("addresses[%d]: bad prefix length %d", i, a.GetLength())
			}
			na.Prefix = pfx
		}
		s.Addresses = append(s.Addresses, na)
	}
	var err error
	if s.Ports, err = convertPorts(p.GetPorts(), in); err != nil {
		return nil, fmt.Errorf("ports: %w", err)
	}
	if s.Waypoint, err = convertGateway(p.GetWaypoint(), in); err != nil {
		return nil, fmt.Errorf("waypoint: %w", err)
	}
	for i, ww := range p.GetWeightedWaypoints() {
		g, err := convertGateway(ww.GetDestination(), in)
		if err != nil || g == nil {
			return nil, fmt.Errorf("weighted_waypoints[%d]: bad destination: %v", i, err)
		}
		s.WeightedWaypoints = append(s.WeightedWaypoints, state.WeightedWaypoint{Gateway: *g, Weight: ww.GetWeight()})
	}
	if lb := p.GetLoadBalancing(); lb != nil {
		out := &state.LoadBalancing{}
		for _, sc := range lb.GetRoutingPreference() {
			if sc < 0 || sc > workloadpb.LoadBalancing_NETWORK {
				return nil, fmt.Errorf("load_balancing: unknown scope %d", sc)
			}
			out.RoutingPreference = append(out.RoutingPreference, state.LBScope(sc))
		}
		if m := lb.GetMode(); m < 0 || m > workloadpb.LoadBalancing_PASSTHROUGH {
			return nil, fmt.Errorf("load_balancing: unknown mode %d", m)
		}
		out.Mode = state.LBMode(lb.GetMode())
		switch lb.GetHealthPolicy() {
		case workloadpb.LoadBalancing_ONLY_HEALTHY:
		case workloadpb.LoadBalancing_ALLOW_ALL:
			out.HealthPolicy = state.AllowAll
		default:
			return nil, fmt.Errorf("load_balancing: unknown health_policy %d", lb.GetHealthPolicy())
		}
		s.LoadBalancing = out
	}
	if f := p.GetIpFamilies(); f >= 0 && f <= workloadpb.IPFamilies_DUAL {
		s.IPFamilies = state.IPFamilies(f)
	}
	switch p.GetVisibility() {
	case workloadpb.Service_PUBLIC:
	case workloadpb.Service_NAMESPACE:
		s.Visibility = state.VisibilityNamespace
	default:
		return nil, fmt.Errorf("unknown visibility %d", p.GetVisibility())
	}
	return s, nil
}

// ConvertAuthorization converts one istio.security.Authorization.
func ConvertAuthorization(p *securitypb.Authorization) (*state.Policy, error) {
	pol, err := convertAuthorization(p)
	if err != nil {
		return nil, resourceErr("authorization", p.GetNamespace()+"/"+p.GetName(), err)
	}
	return pol, nil
}

func convertAuthorization(p *securitypb.Authorization) (*state.Policy, error) {
	if p.GetName() == "" {
		return nil, fmt.Errorf("name: %w", errEmpty)
	}
	pol := &state.Policy{Name: p.GetName(), Namespace: p.GetNamespace(), DryRun: p.GetDryRun()}
	switch p.GetScope() {
	case securitypb.Scope_GLOBAL:
		pol.Scope = state.ScopeGlobal
	case securitypb.Scope_NAMESPACE:
		pol.Scope = state.ScopeNamespace
	case securitypb.Scope_WORKLOAD_SELECTOR:
		pol.Scope = state.ScopeWorkloadSelector
	default:
		return nil, fmt.Errorf("unknown scope %d", p.GetScope())
	}
	switch p.GetAction() {
	case securitypb.Action_ALLOW:
		pol.Action = state.ActionAllow
	case securitypb.Action_DENY:
		pol.Action = state.ActionDeny
	default:
		return nil, fmt.Errorf("unknown action %d", p.GetAction())
	}
	pol.Rules = make([]state.Rule, len(p.GetRules()))
	for i, g := range p.GetRules() {
		r := &pol.Rules[i]
		r.Clauses = make([]state.Clause, len(g.GetRules()))
		for j, c := range g.GetRules() {
			cl := &r.Clauses[j]
			cl.Matches = make([]state.Match, len(c.GetMatches()))
			for k, m := range c.GetMatches() {
				if err := convertMatch(m, &cl.Matches[k]); err != nil {
					return nil, fmt.Errorf("rules[%d][%d][%d]: %w", i, j, k, err)
				}
			}
		}
	}
	return pol, nil
}

func convertMatch(p *securitypb.Match, m *state.Match) error {
	var err error
	sm := func(in []*securitypb.StringMatch, what string) []state.StringMatch {
		if err != nil || len(in) == 0 {
			return nil
		}
		out := make([]state.StringMatch, len(in))
		for i, s := range in {
			switch t := s.GetMatchType().(type) {
			case *securitypb.StringMatch_Exact:
				out[i] = state.StringMatch{Kind: state.MatchExact, Value: t.Exact}
			case *securitypb.StringMatch_Prefix:
				out[i] = state.StringMatch{Kind: state.MatchPrefix, Value: t.Prefix}
			case *securitypb.StringMatch_Suffix:
				out[i] = state.StringMatch{Kind: state.MatchSuffix, Value: t.Suffix}
			case *securitypb.StringMatch_Presence:
				out[i] = state.StringMatch{Kind: state.MatchPresence}
			default:
				err = fmt.Errorf("%s[%d]: string match has no type", what, i)
			}
		}
		return out
	}
	cidrs := func(in []*securitypb.Address, what string) []netip.Prefix {
		if err != nil || len(in) == 0 {
			return nil
		}
		out := make([]netip.Prefix, len(in))
		for i, a := range in {
			ip, e := ipFromBytes(a.GetAddress())
			if e != nil {
				err = fmt.Errorf("%s[%d]: %w", what, i, e)
				return nil
			}
			pfx, e := ip.Prefix(int(a.GetLength()))
			if e != nil || a.GetLength() > uint32(ip.BitLen()) {
				err = fmt.Errorf("%s[%d]: bad prefix length %d", what, i, a.GetLength())
				return nil
			}
			out[i] = pfx
		}
		return out
	}
	ports := func(in []uint32, what string) []uint16 {
		if err != nil || len(in) == 0 {
			return nil
		}
		out := make([]uint16, len(in))
		for i, v := range in {
			if out[i], err = port16(v, what); err != nil {
				return nil
			}
		}
		return out
	}
	sas := func(in []*securitypb.ServiceAccountMatch) []state.ServiceAccountMatch {
		if len(in) == 0 {
			return nil
		}
		out := make([]state.ServiceAccountMatch, len(in))
		for i, s := range in {
			out[i] = state.ServiceAccountMatch{Namespace: s.GetNamespace(), ServiceAccount: s.GetServiceAccount()}
		}
		return out
	}
	m.Namespaces = sm(p.GetNamespaces(), "namespaces")
	m.NotNamespaces = sm(p.GetNotNamespaces(), "not_namespaces")
	m.Principals = sm(p.GetPrincipals(), "principals")
	m.NotPrincipals = sm(p.GetNotPrincipals(), "not_principals")
	m.SourceIPs = cidrs(p.GetSourceIps(), "source_ips")
	m.NotSourceIPs = cidrs(p.GetNotSourceIps(), "not_source_ips")
	m.DestinationIPs = cidrs(p.GetDestinationIps(), "destination_ips")
	m.NotDestinationIPs = cidrs(p.GetNotDestinationIps(), "not_destination_ips")
	m.DestinationPorts = ports(p.GetDestinationPorts(), "destination_ports")
	m.NotDestinationPorts = ports(p.GetNotDestinationPorts(), "not_destination_ports")
	m.ServiceAccounts = sas(p.GetServiceAccounts())
	m.NotServiceAccounts = sas(p.GetNotServiceAccounts())
	return err
}
