package state

import (
	"net/netip"
	"strconv"

	"github.com/gozt/gozt/identity"
)

// TunnelProtocol is how a workload accepts mesh traffic.
type TunnelProtocol uint8

const (
	TunnelNone  TunnelProtocol = iota // plain TCP to podIP:port
	TunnelHBONE                       // HTTP/2 CONNECT to podIP:15008
)

func (p TunnelProtocol) String() string {
	if p == TunnelHBONE {
		return "HBONE"
	}
	return "TCP"
}

// HBONEPort is the inbound HBONE port every mesh workload's node listens on.
const HBONEPort = 15008

// Default values applied when converting a workload record that leaves them empty.
const (
	DefaultTrustDomain    = identity.DefaultTrustDomain
	DefaultServiceAccount = "default"
)

// NetworkMode says whether a workload shares its node's network (and so its IPs).
type NetworkMode uint8

const (
	NetworkStandard    NetworkMode = iota
	NetworkHostNetwork             // not indexed by IP: the IP is the node's
)

// WorkloadType is the kind of controller owning the workload (informational).
type WorkloadType uint8

const (
	WorkloadDeployment WorkloadType = iota
	WorkloadCronJob
	WorkloadPod
	WorkloadJob
)

var workloadTypeNames = [...]string{"deployment", "cronjob", "pod", "job"}

func (t WorkloadType) String() string {
	if int(t) < len(workloadTypeNames) {
		return workloadTypeNames[t]
	}
	return "unknown"
}

// AppTunnelProtocol is how a workload wants traffic delivered to its own in-pod proxy.
type AppTunnelProtocol uint8

const (
	AppTunnelNone  AppTunnelProtocol = iota
	AppTunnelProxy                   // PROXY protocol to the app tunnel port
)

// AppTunnel is a workload's application tunnel (e.g. a sandwiched waypoint).
type AppTunnel struct {
	Protocol AppTunnelProtocol
	Port     uint16 // 0: 15088 in ztunnel
}

// Locality is the topology position used by routing preferences.
type Locality struct {
	Region, Zone, Subzone string
}

// GatewayAddress is a waypoint or network gateway: an address on a network or a
// namespaced service hostname, plus the gateway's HBONE port.
type GatewayAddress struct {
	Network   string
	Address   netip.Addr // valid when addressed by IP
	Namespace string     // set when addressed by hostname
	Hostname  string
	HBONEPort uint16 // 0 means HBONEPort (15008)
}

// Port returns the gateway's HBONE port with the default applied.
func (g *GatewayAddress) Port() uint16 {
	if g.HBONEPort == 0 {
		return HBONEPort
	}
	return g.HBONEPort
}

// String is "network/IP" or "namespace/hostname", the on-demand key form.
func (g *GatewayAddress) String() string {
	if g.Address.IsValid() {
		return g.Network + "/" + g.Address.String()
	}
	return g.Namespace + "/" + g.Hostname
}

// Workload is one istio.workload.Workload. Values in a Store are immutable: an update
// replaces the pointer, so readers may keep a *Workload without locking.
//
// Only the per-pod fields live here; the rest (WorkloadMeta) is the same for every pod of
// a deployment on a locality, so the converter shares one meta among them: at a million
// workloads that is ~112 bytes and 5 pointers a workload instead of ~400 and ~20.
type Workload struct {
	*WorkloadMeta // shared and immutable: never written through after conversion

	UID, Name, Node, Hostname string
	Addresses                 []netip.Addr
	// Digest is a hash of the resource the value was converted from (xDS), 0 if unknown: a
	// re-push with the same bytes keeps the stored value.
	Digest   uint64
	Capacity uint32 // load-balancing weight; conversion defaults it to 1
	Healthy  bool
}

// WorkloadMeta is the part of a Workload shared by the pods of one deployment on one
// locality: namespace, network, identity, canonical labels, services, policies,
// gateways and tunnel settings. Immutable once a Workload holding it is in a Store.
type WorkloadMeta struct {
	Namespace, Network               string
	TrustDomain, ServiceAccount      string // defaults applied at conversion
	Waypoint, NetworkGateway         *GatewayAddress
	CanonicalName, CanonicalRevision string
	WorkloadName, ClusterID          string
	AppTunnel                        *AppTunnel
	// Services maps "ns/hostname" to service port -> target port (0: use the service's).
	Services              map[string]map[uint16]uint16
	AuthorizationPolicies []string // "ns/name" keys of selector policies
	Locality              Locality
	Protocol              TunnelProtocol
	WorkloadType          WorkloadType
	NetworkMode           NetworkMode
	NativeTunnel          bool

	// id is Identity(), set by CacheIdentity before the meta is shared; nil if invalid.
	id *identity.ID
}

// CacheIdentity computes the meta's identity and keeps it for Identity. The xDS converter
// calls it once per meta it makes, before any reader holds the meta; nothing else computes
// a workload's identity (a test that builds a Workload by hand calls it likewise).
func (m *WorkloadMeta) CacheIdentity() {
	if id, err := identity.New(m.TrustDomain, m.Namespace, m.ServiceAccount); err == nil {
		m.id = &id
	}
}

// Identity is spiffe://TrustDomain/ns/Namespace/sa/ServiceAccount, as CacheIdentity
// computed it; zero if invalid (or never computed).
func (w *Workload) Identity() identity.ID {
	if w.WorkloadMeta == nil || w.id == nil {
		return identity.ID{}
	}
	return *w.id
}

// HasAddress reports whether ip is one of the workload's addresses.
func (w *Workload) HasAddress(ip netip.Addr) bool {
	for _, a := range w.Addresses {
		if a == ip {
			return true
		}
	}
	return false
}

// NetworkAddress is an address on a network; Prefix is valid only for CIDR VIPs.
type NetworkAddress struct {
	Network string
	Address netip.Addr
	Prefix  netip.Prefix
}

// String is "network/IP" or "network/CIDR".
func (a NetworkAddress) String() string {
	if a.Prefix.IsValid() {
		return a.Network + "/" + a.Prefix.String()
	}
	return a.Network + "/" + a.Address.String()
}

// Visibility limits which namespaces can reach a service by VIP or hostname.
type Visibility uint8

const (
	VisibilityPublic    Visibility = iota
	VisibilityNamespace            // only clients in the service's namespace
)

// IPFamilies is the service's address family policy.
type IPFamilies uint8

const (
	IPFamiliesAutomatic IPFamilies = iota
	IPFamiliesIPv4Only
	IPFamiliesIPv6Only
	IPFamiliesDual
)

// LBScope is one routing-preference dimension.
type LBScope uint8

const (
	LBScopeUnspecified LBScope = iota
	LBScopeRegion
	LBScopeZone
	LBScopeSubzone
	LBScopeNode
	LBScopeCluster
	LBScopeNetwork
)

// LBMode is how endpoints are filtered by routing preference.
type LBMode uint8

const (
	LBUnspecified LBMode = iota // random over all endpoints
	LBStrict                    // only endpoints matching every preference
	LBFailover                  // only endpoints of the best rank
	LBPassthrough               // send to the original destination
)

// HealthPolicy says whether unhealthy endpoints may be picked.
type HealthPolicy uint8

const (
	OnlyHealthy HealthPolicy = iota
	AllowAll
)

// LoadBalancing is a service's istio.workload.LoadBalancing.
type LoadBalancing struct {
	RoutingPreference []LBScope
	Mode              LBMode
	HealthPolicy      HealthPolicy
}

// WeightedWaypoint is one entry of Service.WeightedWaypoints.
type WeightedWaypoint struct {
	Gateway GatewayAddress
	Weight  uint32
}

// Service is one istio.workload.Service. Immutable once in a Store, like Workload.
type Service struct {
	Name, Namespace, Hostname string
	Addresses                 []NetworkAddress
	Ports                     map[uint16]uint16 // service port -> target port (0: named port)
	SubjectAltNames           []string
	Waypoint                  *GatewayAddress
	WeightedWaypoints         []WeightedWaypoint
	LoadBalancing             *LoadBalancing // nil: random over healthy endpoints
	Digest                    uint64         // as Workload.Digest
	IPFamilies                IPFamilies
	Canonical                 bool
	IngressUseWaypoint        bool
	Visibility                Visibility
}

// Key is the service's resource name, "namespace/hostname".
func (s *Service) Key() string { return s.Namespace + "/" + s.Hostname }

// VisibleTo reports whether a client in namespace ns may use the service.
func (s *Service) VisibleTo(ns string) bool {
	return s.Visibility == VisibilityPublic || s.Namespace == ns
}

// Endpoint is a workload serving a service, with its port map for that service.
type Endpoint struct {
	Workload *Workload
	Ports    map[uint16]uint16
}

// RouteKind is the way an outbound connection reaches its destination.
type RouteKind uint8

const (
	RouteHBONE       RouteKind = iota // HBONE directly to the destination pod's node
	RouteWaypoint                     // HBONE to a waypoint, authority = original dst
	RouteTCP                          // plain TCP to podIP:targetPort
	RoutePassthrough                  // plain TCP to the original destination
	RouteDoubleHBONE                  // HBONE inside HBONE through a network gateway
)

var routeKindNames = [...]string{"hbone", "waypoint", "tcp", "passthrough", "double-hbone"}

func (k RouteKind) String() string {
	if int(k) < len(routeKindNames) {
		return routeKindNames[k]
	}
	return "RouteKind(" + strconv.Itoa(int(k)) + ")"
}

// Route is where an outbound connection goes.
type Route struct {
	Kind     RouteKind
	Workload *Workload // destination workload or waypoint (nil for passthrough)
	Service  *Service  // the service the dst address matched, if any
	// EndpointPort is the port of Workload the route goes to: its target port (the
	// authority's port for HBONE), a waypoint's HBONE port. With Workload, it is the
	// endpoint the pick weighed (Avoid.Ejected) and outlier detection keys on.
	EndpointPort uint16
	// Dial is the TCP target: pod or waypoint IP + HBONE port (HBONE kinds), podIP:targetPort
	// (TCP), the gateway's IP:hbone port (double HBONE) or the original dst (passthrough).
	Dial netip.AddrPort
	// Authority is the CONNECT :authority for HBONE kinds: podIP:targetPort, or the original
	// VIP:port when going via a waypoint. For double HBONE it is both CONNECTs' authority,
	// service-hostname:service-port (the remote gateway routes by it); the outer CONNECT
	// goes to the gateway at Dial.
	Authority string
	// Identities are the expected peer identities: service SANs + the destination's
	// identity. For double HBONE, those of the inner TLS (the final destination or its
	// waypoint).
	Identities []identity.ID
	// Gateway is the network gateway workload for RouteDoubleHBONE (nil otherwise), and
	// GatewayIdentities what the outer TLS expects of it (its identity + its service's SANs).
	Gateway           *Workload
	GatewayIdentities []identity.ID
	// Hostname is set when the destination workload has no address, only a hostname (a
	// ServiceEntry with DNS resolution): Dial holds only the port until the caller
	// resolves the name on demand and calls Resolved.
	Hostname   string
	targetPort uint16 // with Hostname: the port the HBONE authority names
	// Others is how many other endpoints of Service the pick could have taken (any health):
	// whether a failed connect has another to be retried on.
	Others int
}
