package state

import (
	"errors"
	"slices"
	"testing"

	"github.com/gozt/gozt/identity"
)

// remote is a workload of echo on network net2, known here without an address (as istiod
// describes another network's pods), reached through gateway g.
func remote(name string, g *GatewayAddress, mods ...func(*Workload)) *Workload {
	return wl(name, "", append([]func(*Workload){inSvc(echoKey, nil), func(w *Workload) {
		w.Network, w.NetworkGateway = "net2", g
	}}, mods...)...)
}

func onNet2(w *Workload) { w.Network = "net2" }

func TestResolveNetworkGateway(t *testing.T) {
	client := wl("client", "10.0.0.1")
	byAddr := &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15008}
	byHost := &GatewayAddress{Namespace: "istio-system", Hostname: "eastwest.istio-system.svc", HBONEPort: 15008}
	ewSvc := svc("istio-system", "eastwest.istio-system.svc", "10.96.1.1", func(s *Service) {
		s.Ports = map[uint16]uint16{15008: 15443}
		s.SubjectAltNames = []string{"spiffe://cluster.local/ns/istio-system/sa/eastwest-san"}
	})
	ewPod := wl("eastwest", "192.0.2.7", inSvc("istio-system/eastwest.istio-system.svc", nil), onNet2)
	id := identity.MustParse
	for _, tc := range []struct {
		name          string
		wls           []*Workload
		svcs          []*Service
		err           error
		dial, auth    string
		dst           string // the route's workload
		inner, outer  []identity.ID
		gatewayWlName string
	}{
		{name: "gateway by address is a workload",
			wls:  []*Workload{remote("r1", byAddr), wl("ewgw", "192.0.2.1", onNet2)},
			dial: "192.0.2.1:15008", auth: "echo.default.svc:80", dst: "r1", gatewayWlName: "ewgw",
			inner: []identity.ID{id("spiffe://cluster.local/ns/default/sa/echo-san"), id("spiffe://cluster.local/ns/default/sa/r1")},
			outer: []identity.ID{id("spiffe://cluster.local/ns/default/sa/ewgw")}},
		{name: "gateway by hostname is a service, on its hbone port's target",
			wls: []*Workload{remote("r1", byHost), ewPod}, svcs: []*Service{ewSvc},
			dial: "192.0.2.7:15443", auth: "echo.default.svc:80", dst: "r1", gatewayWlName: "eastwest",
			outer: []identity.ID{id("spiffe://cluster.local/ns/istio-system/sa/eastwest-san"), id("spiffe://cluster.local/ns/default/sa/eastwest")}},
		{name: "unknown gateway address", wls: []*Workload{remote("r1", byAddr)}, err: ErrNoGateway},
		{name: "unknown gateway hostname", wls: []*Workload{remote("r1", byHost)}, err: ErrNoGateway},
		{name: "gateway service without the hbone port",
			wls:  []*Workload{remote("r1", byHost), ewPod},
			svcs: []*Service{svc("istio-system", "eastwest.istio-system.svc", "10.96.1.1")}, err: ErrNoGateway},
		{name: "remote endpoint without a gateway", wls: []*Workload{remote("r1", nil, func(w *Workload) { w.Addresses = ips("10.1.0.9") })},
			err: ErrNoGateway},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore()
			s.Apply(&Batch{Workloads: append(tc.wls, client), Services: append(tc.svcs, echo())})
			r, err := s.Resolve(client, ap("10.96.0.10:80"))
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err = %v; want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.Kind != RouteDoubleHBONE || r.Dial.String() != tc.dial || r.Authority != tc.auth || r.Workload.Name != tc.dst || r.Gateway.Name != tc.gatewayWlName {
				t.Fatalf("route %v dial %v authority %q workload %s gateway %s; want double-hbone %s %q %s %s",
					r.Kind, r.Dial, r.Authority, r.Workload.Name, r.Gateway.Name, tc.dial, tc.auth, tc.dst, tc.gatewayWlName)
			}
			if tc.inner != nil && !slices.Equal(r.Identities, tc.inner) {
				t.Errorf("inner identities %v; want %v", r.Identities, tc.inner)
			}
			if !slices.Equal(r.GatewayIdentities, tc.outer) {
				t.Errorf("gateway identities %v; want %v", r.GatewayIdentities, tc.outer)
			}
		})
	}
}

// A service whose waypoint runs on another network (Rust ztunnel #1565): the waypoint is
// reached through its network's gateway, both CONNECTs naming the service, the inner TLS
// expecting the waypoint.
func TestResolveRemoteWaypoint(t *testing.T) {
	client := wl("client", "10.0.0.1")
	g := &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15008}
	wpSvc := svc("default", "wp.default.svc", "10.96.0.200", func(s *Service) { s.Ports = map[uint16]uint16{15008: 15008} })
	s := NewStore()
	s.Apply(&Batch{
		Workloads: []*Workload{client, wl("ewgw", "192.0.2.1", onNet2),
			wl("wp-pod", "", inSvc("default/wp.default.svc", nil), func(w *Workload) { w.Network, w.NetworkGateway = "net2", g })},
		Services: []*Service{wpSvc, echo(func(s *Service) {
			s.Waypoint = &GatewayAddress{Namespace: "default", Hostname: "wp.default.svc", HBONEPort: 15008}
		})},
	})
	r, err := s.Resolve(client, ap("10.96.0.10:80"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Kind != RouteDoubleHBONE || r.Dial.String() != "192.0.2.1:15008" || r.Authority != "echo.default.svc:80" || r.Workload.Name != "wp-pod" {
		t.Fatalf("route %v dial %v authority %q workload %s; want double-hbone to wp-pod via 192.0.2.1:15008 for echo.default.svc:80", r.Kind, r.Dial, r.Authority, r.Workload.Name)
	}
	if want := []identity.ID{identity.MustParse("spiffe://cluster.local/ns/default/sa/wp-pod")}; !slices.Equal(r.Identities, want) {
		t.Errorf("inner identities %v; want %v", r.Identities, want)
	}
}

// Endpoints on both networks share a service's traffic by capacity, as the Rust ztunnel's
// load_balance: a remote one is just an endpoint reached through its gateway.
func TestLoadBalanceAcrossNetworks(t *testing.T) {
	client := wl("client", "10.0.0.1")
	g := &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15008}
	s := NewStore()
	s.Apply(&Batch{
		Workloads: []*Workload{client, wl("local", "10.0.0.2", inSvc(echoKey, nil)), remote("far", g), wl("ewgw", "192.0.2.1", onNet2)},
		Services:  []*Service{echo()},
	})
	seen := map[RouteKind]int{}
	for range 200 {
		r, err := s.Resolve(client, ap("10.96.0.10:80"))
		if err != nil {
			t.Fatal(err)
		}
		seen[r.Kind]++
	}
	if seen[RouteHBONE] < 50 || seen[RouteDoubleHBONE] < 50 {
		t.Errorf("routes over 200 picks: %v; want both networks picked about equally", seen)
	}
}

// With network the first routing preference (FAILOVER), endpoints on the client's network
// win; without any, remote ones are ranked by the other scopes; STRICT never picks them.
func TestLoadBalanceNetworkPreferred(t *testing.T) {
	client := wl("client", "10.0.0.1", func(w *Workload) { w.Locality.Region = "r1" })
	g := &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15008}
	inR := func(region string) func(*Workload) { return func(w *Workload) { w.Locality.Region = region } }
	lb := func(mode LBMode) *Service {
		return echo(func(s *Service) {
			s.LoadBalancing = &LoadBalancing{Mode: mode, RoutingPreference: []LBScope{LBScopeNetwork, LBScopeRegion}}
		})
	}
	picks := func(t *testing.T, s *Store) map[string]int {
		seen := map[string]int{}
		for range 100 {
			r, err := s.Resolve(client, ap("10.96.0.10:80"))
			if err != nil {
				seen[err.Error()]++
				continue
			}
			seen[r.Workload.Name]++
		}
		return seen
	}
	gw := wl("ewgw", "192.0.2.1", onNet2)
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{client, gw, wl("local-r2", "10.0.0.2", inSvc(echoKey, nil), inR("r2")), remote("far-r1", g, inR("r1"))},
		Services: []*Service{lb(LBFailover)}})
	if got := picks(t, s); got["local-r2"] != 100 {
		t.Errorf("failover picks %v; want the local endpoint only, its region notwithstanding", got)
	}
	s.Apply(&Batch{Workloads: []*Workload{remote("far-r2", g, inR("r2"))}, RemoveAddresses: []string{"Kubernetes//v1/Pod/default/local-r2"}})
	if got := picks(t, s); got["far-r1"] != 100 {
		t.Errorf("failover picks %v; want the remote endpoint in the client's region", got)
	}
	s.Apply(&Batch{Services: []*Service{lb(LBStrict)}})
	if got := picks(t, s); got["far-r1"]+got["far-r2"] != 0 {
		t.Errorf("strict picks %v; want no remote endpoint", got)
	}
}

// IsNetworkGateway knows a gateway named by address, the endpoints of one named by
// hostname or by a service VIP, and forgets them with the last workload naming them.
func TestIsNetworkGateway(t *testing.T) {
	byAddr := &GatewayAddress{Network: "net2", Address: ip("10.2.0.6"), HBONEPort: 15008}
	byHost := &GatewayAddress{Namespace: "istio-system", Hostname: "eastwest.istio-system.svc", HBONEPort: 15008}
	byVIP := &GatewayAddress{Network: "net2", Address: ip("10.96.9.9"), HBONEPort: 15008}
	gwPod := wl("eastwest", "10.2.0.7", inSvc("istio-system/eastwest.istio-system.svc", nil), onNet2)
	vipPod := wl("lb", "10.2.0.8", inSvc("istio-system/lb.istio-system.svc", nil), onNet2)
	s := NewStore()
	s.Apply(&Batch{
		Workloads: []*Workload{gwPod, vipPod, wl("plain", "10.2.0.9", onNet2),
			wl("a", "10.2.0.1", onNet2, func(w *Workload) { w.NetworkGateway = byAddr }),
			wl("b", "10.2.0.2", onNet2, func(w *Workload) { w.NetworkGateway = byHost }),
			wl("c", "10.2.0.3", onNet2, func(w *Workload) { w.NetworkGateway = byVIP })},
		Services: []*Service{svc("istio-system", "eastwest.istio-system.svc", ""),
			svc("istio-system", "lb.istio-system.svc", "", func(s *Service) { s.Addresses = []NetworkAddress{vip("net2", "10.96.9.9")} })},
	})
	for addr, want := range map[string]bool{"10.2.0.6": true, "10.2.0.7": true, "10.2.0.8": true, "10.2.0.9": false, "10.2.0.1": false} {
		if got := s.IsNetworkGateway("net2", ip(addr)); got != want {
			t.Errorf("IsNetworkGateway(net2, %s) = %v; want %v", addr, got, want)
		}
	}
	if s.IsNetworkGateway("net1", ip("10.2.0.6")) {
		t.Error("a gateway address counts on another network")
	}
	s.Apply(&Batch{RemoveAddresses: []string{"Kubernetes//v1/Pod/default/a", "Kubernetes//v1/Pod/default/b"}})
	if s.IsNetworkGateway("net2", ip("10.2.0.6")) || s.IsNetworkGateway("net2", ip("10.2.0.7")) || !s.IsNetworkGateway("net2", ip("10.2.0.8")) {
		t.Error("gateways not forgotten with the workloads naming them, or one still named forgotten")
	}
}
