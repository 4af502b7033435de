package state

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"

	"github.com/gozt/gozt/identity"
)

// Resolution errors; Resolve wraps them with the service or workload at fault.
var (
	ErrNoHealthyEndpoint = errors.New("state: no healthy endpoint")
	ErrNoServicePort     = errors.New("state: service has no such port")
	ErrNoGateway         = errors.New("state: remote-network endpoint has no network gateway")
	ErrWaypointNotFound  = errors.New("state: waypoint not found")
	ErrNoAddress         = errors.New("state: workload has no address")
	ErrRemoteWorkload    = errors.New("state: workload on another network addressed without a service")
)

// Resolve decides where an outbound connection from src (nil: unknown source on the local
// network) to dst goes, following the Rust ztunnel (src/state.rs): workload by IP, else service by VIP (with
// visibility and namespace preference), waypoints (weighted), load balancing by routing
// preference and capacity, network gateways, else passthrough.
func (s *Store) Resolve(src *Workload, dst netip.AddrPort) (Route, error) {
	return s.ResolveAvoiding(src, dst, Avoid{})
}

// Avoid steers a service's endpoint pick away from endpoints the caller saw fail: the
// endpoints a connection already tried, and those its outlier detection ejected. The zero
// value steers nothing.
type Avoid struct {
	// Tried endpoints are never picked again.
	Tried []*Workload
	// Ejected, when set, names endpoints picked only when no other is left, so an outage
	// of every endpoint still tries them: a workload and the port it would be picked for
	// (Route.EndpointPort). Asked for every endpoint a pick weighs, twice.
	Ejected func(w *Workload, port uint16) bool
	// Nodes' endpoints are picked as ejected ones are, only when no other is left: a connect
	// to one of them got no answer at all (no route, out of time), which the node's other
	// endpoints, behind the same network path, would likely share.
	Nodes []string
}

func (a *Avoid) tried(w *Workload) bool {
	for _, t := range a.Tried {
		if t == w {
			return true
		}
	}
	return false
}

// ResolveAvoiding is Resolve with the endpoint pick steered by avoid (see Avoid).
func (s *Store) ResolveAvoiding(src *Workload, dst netip.AddrPort, avoid Avoid) (Route, error) {
	network, srcNs := s.opts.Network, ""
	if src != nil {
		network, srcNs = src.Network, src.Namespace
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if w := s.idx.byAddr.get(network, dst.Addr()); w != nil {
		if w.Waypoint != nil && !s.isWaypointLocked(src, w.Waypoint) {
			return s.waypointRouteLocked(src, network, w.Waypoint, nil, dst, &avoid)
		}
		r, err := s.directRouteLocked(src, network, nil, w, dst.Port(), dst, &avoid)
		if err != nil {
			return Route{}, err
		}
		r.Identities = []identity.ID{w.Identity()}
		return r, nil
	}
	svc := s.serviceByVIPLocked(network, dst.Addr(), srcNs)
	if svc == nil {
		return Route{Kind: RoutePassthrough, Dial: dst}, nil
	}
	if wp := s.serviceWaypoint(svc); wp != nil && !s.isWaypointLocked(src, wp) {
		return s.waypointRouteLocked(src, network, wp, svc, dst, &avoid)
	}
	target, ok := svc.Ports[dst.Port()]
	if !ok {
		return Route{}, fmt.Errorf("%w: %s port %d", ErrNoServicePort, svc.Key(), dst.Port())
	}
	if lb := svc.LoadBalancing; lb != nil && lb.Mode == LBPassthrough {
		return Route{Kind: RoutePassthrough, Service: svc, Dial: dst}, nil
	}
	w, port, others := s.pickEndpointLocked(src, network, svc, dst.Port(), target, &avoid)
	if w == nil {
		return Route{}, fmt.Errorf("%w for %s port %d", ErrNoHealthyEndpoint, svc.Key(), dst.Port())
	}
	r, err := s.directRouteLocked(src, network, svc, w, port, dst, &avoid)
	if err != nil {
		return Route{}, err
	}
	r.Identities, r.Others = serviceIdentities(svc, w), others
	return r, nil
}

func serviceIdentities(svc *Service, w *Workload) []identity.ID {
	ids := make([]identity.ID, 0, len(svc.SubjectAltNames)+1)
	for _, san := range svc.SubjectAltNames {
		if id, err := identity.Parse(san); err == nil {
			ids = append(ids, id)
		}
	}
	if id := w.Identity(); !id.IsZero() {
		for _, x := range ids {
			if x == id {
				return ids
			}
		}
		ids = append(ids, id)
	}
	return ids
}

// serviceWaypoint picks the service's waypoint: weighted among WeightedWaypoints, else Waypoint.
func (s *Store) serviceWaypoint(svc *Service) *GatewayAddress {
	if len(svc.WeightedWaypoints) == 0 {
		return svc.Waypoint
	}
	var total uint64
	for _, ww := range svc.WeightedWaypoints {
		total += uint64(ww.Weight)
	}
	if total == 0 {
		return &svc.WeightedWaypoints[s.randN(uint64(len(svc.WeightedWaypoints)))].Gateway
	}
	n := s.randN(total)
	for i := range svc.WeightedWaypoints {
		w := uint64(svc.WeightedWaypoints[i].Weight)
		if n < w {
			return &svc.WeightedWaypoints[i].Gateway
		}
		n -= w
	}
	return &svc.WeightedWaypoints[len(svc.WeightedWaypoints)-1].Gateway
}

// gatewayServiceKeyLocked returns the service key a gateway names (by hostname or VIP), or "".
func (s *Store) gatewayServiceKeyLocked(g *GatewayAddress) string {
	if g.Hostname != "" {
		return g.Namespace + "/" + g.Hostname
	}
	if svc := s.pickService(s.idx.byVIP.get(g.Network, g.Address), ""); svc != nil {
		return svc.Key()
	}
	return ""
}

// isWaypointLocked reports whether src is (an instance of) the waypoint g, so traffic it
// sends on is not looped back to itself.
func (s *Store) isWaypointLocked(src *Workload, g *GatewayAddress) bool {
	if src == nil {
		return false
	}
	if g.Address.IsValid() && src.Network == g.Network && src.HasAddress(g.Address) {
		return true
	}
	if key := s.gatewayServiceKeyLocked(g); key != "" {
		_, ok := src.Services[key]
		return ok
	}
	return false
}

// gatewayWorkloadLocked resolves a gateway address to one workload: by IP, else through the
// service it names (load balanced).
func (s *Store) gatewayWorkloadLocked(src *Workload, network string, g *GatewayAddress, avoid *Avoid) *Workload {
	if g.Address.IsValid() {
		if w := s.idx.byAddr.get(g.Network, g.Address); w != nil {
			return w
		}
	}
	key := s.gatewayServiceKeyLocked(g)
	svc := s.idx.services[key]
	if svc == nil {
		return nil
	}
	w, _, _ := s.pickEndpointLocked(src, network, svc, 0, g.Port(), avoid) // picked for its HBONE port
	return w
}

func (s *Store) waypointRouteLocked(src *Workload, network string, g *GatewayAddress, svc *Service, dst netip.AddrPort, avoid *Avoid) (Route, error) {
	wp := s.gatewayWorkloadLocked(src, network, g, avoid)
	if wp == nil {
		return Route{}, fmt.Errorf("%w: %s", ErrWaypointNotFound, g)
	}
	if wp.Network != network {
		// A waypoint on another network (Rust ztunnel #1565): through that network's gateway,
		// authority the service's, the inner TLS to the waypoint's service SANs and identity.
		if svc == nil {
			return Route{}, fmt.Errorf("%w: waypoint %s of %v is on network %q; only services cross networks", ErrRemoteWorkload, wp.UID, dst.Addr(), wp.Network)
		}
		r, err := s.doubleHBONELocked(src, svc, wp, dst, avoid)
		if err != nil {
			return Route{}, err
		}
		r.EndpointPort = g.Port()
		r.Identities = []identity.ID{wp.Identity()}
		if wsvc := s.idx.services[s.gatewayServiceKeyLocked(g)]; wsvc != nil {
			r.Identities = serviceIdentities(wsvc, wp)
		}
		return r, nil
	}
	ip, ok := chooseIP(wp, g.Address)
	if !ok {
		return Route{}, fmt.Errorf("%w: waypoint %s", ErrNoAddress, wp.UID)
	}
	return Route{
		Kind:         RouteWaypoint,
		Workload:     wp,
		Service:      svc,
		EndpointPort: g.Port(),
		Dial:         netip.AddrPortFrom(ip, g.Port()),
		Authority:    dst.String(),
		Identities:   []identity.ID{wp.Identity()},
	}, nil
}

// directRouteLocked builds the route to workload w's targetPort, prefer being the dialed IP.
func (s *Store) directRouteLocked(src *Workload, network string, svc *Service, w *Workload, targetPort uint16, dst netip.AddrPort, avoid *Avoid) (Route, error) {
	prefer := dst.Addr()
	if w.Network != network {
		if svc == nil { // by IP only workloads of the source's network are found
			return Route{}, fmt.Errorf("%w: %s is on network %q; only services cross networks", ErrRemoteWorkload, w.UID, w.Network)
		}
		r, err := s.doubleHBONELocked(src, svc, w, dst, avoid)
		r.EndpointPort = targetPort
		return r, err
	}
	ip, ok := chooseIP(w, prefer)
	if !ok && w.Hostname != "" {
		return hostnameRoute(svc, w, targetPort), nil
	}
	if !ok {
		return Route{}, fmt.Errorf("%w: %s", ErrNoAddress, w.UID)
	}
	if w.Protocol == TunnelHBONE {
		return Route{
			Kind:         RouteHBONE,
			Workload:     w,
			Service:      svc,
			EndpointPort: targetPort,
			Dial:         netip.AddrPortFrom(ip, HBONEPort),
			Authority:    netip.AddrPortFrom(ip, targetPort).String(),
		}, nil
	}
	return Route{Kind: RouteTCP, Workload: w, Service: svc, EndpointPort: targetPort, Dial: netip.AddrPortFrom(ip, targetPort)}, nil
}

// hostnameRoute is the route to a workload known only by its hostname (a ServiceEntry with
// DNS resolution): the caller resolves Hostname and fills the address in with Resolved.
func hostnameRoute(svc *Service, w *Workload, targetPort uint16) Route {
	r := Route{Kind: RouteTCP, Workload: w, Service: svc, EndpointPort: targetPort, Dial: netip.AddrPortFrom(netip.Addr{}, targetPort), Hostname: w.Hostname, targetPort: targetPort}
	if w.Protocol == TunnelHBONE {
		r.Kind, r.Dial = RouteHBONE, netip.AddrPortFrom(netip.Addr{}, HBONEPort)
	}
	return r
}

// Resolved returns the route with ip, a resolved address of Hostname, as the destination
// workload's address: dialed, and in the HBONE authority.
func (r Route) Resolved(ip netip.Addr) Route {
	r.Dial = netip.AddrPortFrom(ip, r.Dial.Port())
	if r.Kind == RouteHBONE {
		r.Authority = netip.AddrPortFrom(ip, r.targetPort).String()
	}
	r.Hostname = ""
	return r
}

// doubleHBONELocked routes to w, a workload or waypoint of svc on another network, through
// w's network gateway, as the Rust ztunnel's build_request_through_gateway: both CONNECTs
// carry svc-hostname:dst-port (the gateway routes by it without opening the inner TLS),
// the outer TLS expects the gateway's identities. The caller sets the inner ones.
func (s *Store) doubleHBONELocked(src *Workload, svc *Service, w *Workload, dst netip.AddrPort, avoid *Avoid) (Route, error) {
	g := w.NetworkGateway
	if g == nil {
		return Route{}, fmt.Errorf("%w: %s on network %q", ErrNoGateway, w.UID, w.Network)
	}
	gw, dial, ids, err := s.networkGatewayLocked(src, g, dst, avoid)
	if err != nil {
		return Route{}, err
	}
	return Route{
		Kind:              RouteDoubleHBONE,
		Workload:          w,
		Service:           svc,
		Dial:              dial,
		Authority:         net.JoinHostPort(svc.Hostname, strconv.Itoa(int(dst.Port()))),
		Identities:        serviceIdentities(svc, w),
		Gateway:           gw,
		GatewayIdentities: ids,
	}, nil
}

// networkGatewayLocked resolves a network gateway as the Rust ztunnel's
// fetch_network_gateway: an address names a workload (or a service VIP) on the gateway's
// network, a hostname a service; a service is load-balanced on its port g.Port(). The
// gateway must be known: its identity (and its service's SANs) is what the outer TLS
// expects.
func (s *Store) networkGatewayLocked(src *Workload, g *GatewayAddress, dst netip.AddrPort, avoid *Avoid) (*Workload, netip.AddrPort, []identity.ID, error) {
	var svc *Service
	if g.Address.IsValid() {
		if w := s.idx.byAddr.get(g.Network, g.Address); w != nil {
			return w, netip.AddrPortFrom(g.Address, g.Port()), []identity.ID{w.Identity()}, nil
		}
		svc = s.pickService(s.idx.byVIP.get(g.Network, g.Address), "")
	} else {
		svc = s.idx.services[g.Namespace+"/"+g.Hostname]
	}
	if svc == nil {
		return nil, netip.AddrPort{}, nil, fmt.Errorf("%w: network gateway %s not found", ErrNoGateway, g)
	}
	target, ok := svc.Ports[g.Port()]
	if !ok {
		return nil, netip.AddrPort{}, nil, fmt.Errorf("%w: network gateway service %s has no port %d", ErrNoGateway, svc.Key(), g.Port())
	}
	w, port, _ := s.pickEndpointLocked(src, g.Network, svc, g.Port(), target, avoid)
	if w == nil {
		return nil, netip.AddrPort{}, nil, fmt.Errorf("%w: network gateway service %s has no healthy endpoint", ErrNoGateway, svc.Key())
	}
	prefer := dst.Addr()
	if g.Address.IsValid() {
		prefer = g.Address
	}
	ip, ok := chooseIP(w, prefer)
	if !ok {
		return nil, netip.AddrPort{}, nil, fmt.Errorf("%w: gateway %s", ErrNoAddress, w.UID)
	}
	if port == 0 {
		port = g.Port()
	}
	return w, netip.AddrPortFrom(ip, port), serviceIdentities(svc, w), nil
}

// chooseIP picks prefer if it is one of w's addresses, else the first of the same family,
// else the first address.
func chooseIP(w *Workload, prefer netip.Addr) (netip.Addr, bool) {
	if len(w.Addresses) == 0 {
		return netip.Addr{}, false
	}
	if prefer.IsValid() {
		for _, a := range w.Addresses {
			if a == prefer {
				return a, true
			}
		}
		for _, a := range w.Addresses {
			if a.Is4() == prefer.Is4() {
				return a, true
			}
		}
	}
	return w.Addresses[0], true
}

// rank counts the leading routing-preference scopes on which src and w agree (n, which
// STRICT requires to be all of them) and the rank endpoints are compared by. When network
// is the first scope it is preferred but not required, as in the Rust ztunnel (#1980): an
// endpoint on another network is ranked by the scopes after it, one on src's network
// above every such endpoint.
func rank(prefs []LBScope, src, w *Workload) (n, r int) {
	networkFirst := len(prefs) > 0 && prefs[0] == LBScopeNetwork
	adjust := 0
	for i, p := range prefs {
		var ok bool
		switch p {
		case LBScopeRegion:
			ok = src.Locality.Region == w.Locality.Region
		case LBScopeZone:
			ok = src.Locality.Region == w.Locality.Region && src.Locality.Zone == w.Locality.Zone
		case LBScopeSubzone:
			ok = src.Locality == w.Locality
		case LBScopeNode:
			ok = src.Node == w.Node
		case LBScopeCluster:
			ok = src.ClusterID == w.ClusterID
		case LBScopeNetwork:
			ok = src.Network == w.Network
			if networkFirst && i == 0 {
				if !ok {
					continue
				}
				adjust = len(prefs) - 1
			}
		default:
			ok = true
		}
		if !ok {
			break
		}
		n++
	}
	return n, n + adjust
}

// pickEndpointLocked load-balances over svc's endpoints for svcPort (0: any port) and returns
// the workload and the target port. It applies the health policy, named-port and address
// filters, FAILOVER/STRICT routing preference, then a random pick weighted by capacity.
// Health comes before routing preference: a healthy endpoint in another zone is picked
// before an ejected or unhealthy one in the client's (see eligible). Two passes over the
// endpoint map and no allocation: the first finds the best key and the total weight, the
// second walks to the drawn weight (map order does not bias a uniform draw). The third result
// is how many other endpoints it could have taken, in any class.
func (s *Store) pickEndpointLocked(src *Workload, network string, svc *Service, svcPort, target uint16, avoid *Avoid) (*Workload, uint16, int) {
	eps := s.idx.endpoints[svc.Key()]
	best, n, eligible := -1, 0, 0
	var total uint64
	for w, ports := range eps {
		_, key, ok := s.eligible(src, network, svc, w, ports, svcPort, target, avoid)
		if ok {
			eligible++
		}
		switch {
		case !ok || key < best:
		case key > best:
			best, n, total = key, 1, uint64(w.Capacity)
		default:
			n++
			total += uint64(w.Capacity)
		}
	}
	if n == 0 {
		return nil, 0, 0
	}
	draw, byCount := uint64(0), total == 0
	if byCount {
		draw = s.randN(uint64(n))
	} else {
		draw = s.randN(total)
	}
	var last *Workload
	var lastPort uint16
	for w, ports := range eps {
		port, key, ok := s.eligible(src, network, svc, w, ports, svcPort, target, avoid)
		if !ok || key != best {
			continue
		}
		weight := uint64(w.Capacity)
		if byCount {
			weight = 1
		}
		if draw < weight {
			return w, port, eligible - 1
		}
		draw -= weight
		last, lastPort = w, port
	}
	return last, lastPort, eligible - 1
}

// Health classes of an endpoint; the pick takes the best class present. Healthy, then
// healthy but ejected by the caller's outlier detection (one less), then UNHEALTHY in xDS
// (terminating or not ready, with UnhealthyFallback), then UNHEALTHY and ejected.
const (
	classHealthy   = 3
	classUnhealthy = 1
)

// eligible filters one endpoint and returns its target port and the key picks compare:
// its health class, then its routing-preference rank.
func (s *Store) eligible(src *Workload, network string, svc *Service, w *Workload, ports map[uint16]uint16, svcPort, target uint16, avoid *Avoid) (uint16, int, bool) {
	lb := svc.LoadBalancing
	class := classHealthy
	if !w.Healthy && (lb == nil || lb.HealthPolicy != AllowAll) {
		if !s.opts.UnhealthyFallback {
			return 0, 0, false
		}
		class = classUnhealthy
	}
	if len(w.Addresses) == 0 && w.Hostname == "" && (w.Network == network || w.NetworkGateway == nil) {
		return 0, 0, false
	}
	if len(avoid.Tried) > 0 && avoid.tried(w) {
		return 0, 0, false
	}
	port := target
	if svcPort != 0 {
		if p := ports[svcPort]; p != 0 {
			port = p
		} else if target == 0 {
			if w.AppTunnel == nil {
				return 0, 0, false // named port this endpoint does not define
			}
			port = svcPort
		}
	}
	if avoid.Ejected != nil && avoid.Ejected(w, port) || len(avoid.Nodes) > 0 && w.Node != "" && slices.Contains(avoid.Nodes, w.Node) {
		class--
	}
	key := class << 16
	if lb == nil || src == nil || (lb.Mode != LBFailover && lb.Mode != LBStrict) {
		return port, key, true
	}
	n, r := rank(lb.RoutingPreference, src, w)
	if lb.Mode == LBStrict && n < len(lb.RoutingPreference) {
		return 0, 0, false
	}
	return port, key | r, true
}
