package state

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/gozt/gozt/identity"
)

const echoKey = "default/echo.default.svc"

func echo(mods ...func(*Service)) *Service {
	return svc("default", "echo.default.svc", "10.96.0.10", append([]func(*Service){func(s *Service) {
		s.SubjectAltNames = []string{"spiffe://cluster.local/ns/default/sa/echo-san"}
	}}, mods...)...)
}

func TestResolve(t *testing.T) {
	client := wl("client", "10.0.0.1")
	wpGW := &GatewayAddress{Address: ip("10.0.0.100"), HBONEPort: 15008}
	type want struct {
		kind      RouteKind
		dial      string
		authority string
		workload  string // name, "" for nil
		service   bool
		err       error
	}
	for _, tc := range []struct {
		name  string
		src   *Workload
		wls   []*Workload
		svcs  []*Service
		dst   string
		randN func(uint64) uint64
		want  want
	}{
		{name: "rule8 hbone workload", wls: []*Workload{wl("server", "10.0.0.2")}, dst: "10.0.0.2:8080",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:8080", workload: "server"}},
		{name: "rule8 tcp workload", wls: []*Workload{wl("server", "10.0.0.2", func(w *Workload) { w.Protocol = TunnelNone })}, dst: "10.0.0.2:8080",
			want: want{kind: RouteTCP, dial: "10.0.0.2:8080", workload: "server"}},
		{name: "rule9 unknown is passthrough", dst: "1.2.3.4:443",
			want: want{kind: RoutePassthrough, dial: "1.2.3.4:443"}},
		{name: "rule4 service endpoint", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, map[uint16]uint16{80: 8080}))},
			svcs: []*Service{echo()}, dst: "10.96.0.10:80",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:8080", workload: "server", service: true}},
		{name: "rule4 missing service port", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil))},
			svcs: []*Service{echo()}, dst: "10.96.0.10:81", want: want{err: ErrNoServicePort}},
		{name: "rule9 no healthy endpoint", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil), func(w *Workload) { w.Healthy = false })},
			svcs: []*Service{echo()}, dst: "10.96.0.10:80", want: want{err: ErrNoHealthyEndpoint}},
		{name: "rule4 allow_all health policy", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil), func(w *Workload) { w.Healthy = false })},
			svcs: []*Service{echo(func(s *Service) { s.LoadBalancing = &LoadBalancing{HealthPolicy: AllowAll} })}, dst: "10.96.0.10:80",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:8080", workload: "server", service: true}},
		{name: "rule4 passthrough mode", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil))},
			svcs: []*Service{echo(func(s *Service) { s.LoadBalancing = &LoadBalancing{Mode: LBPassthrough} })}, dst: "10.96.0.10:80",
			want: want{kind: RoutePassthrough, dial: "10.96.0.10:80", service: true}},
		{name: "rule4 named port drops endpoint without it",
			wls: []*Workload{
				wl("named", "10.0.0.2", inSvc(echoKey, map[uint16]uint16{80: 9090})),
				wl("unnamed", "10.0.0.3", inSvc(echoKey, nil)),
			},
			svcs: []*Service{echo(func(s *Service) { s.Ports = map[uint16]uint16{80: 0} })}, dst: "10.96.0.10:80",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:9090", workload: "named", service: true}},
		{name: "rule5 app tunnel uses service port",
			wls:  []*Workload{wl("tun", "10.0.0.2", inSvc(echoKey, nil), func(w *Workload) { w.AppTunnel = &AppTunnel{Protocol: AppTunnelProxy} })},
			svcs: []*Service{echo(func(s *Service) { s.Ports = map[uint16]uint16{80: 0} })}, dst: "10.96.0.10:80",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:80", workload: "tun", service: true}},
		{name: "rule4 address-less, hostname-less same-network endpoint dropped",
			wls:  []*Workload{wl("nowhere", "", inSvc(echoKey, nil))},
			svcs: []*Service{echo()}, dst: "10.96.0.10:80", want: want{err: ErrNoHealthyEndpoint}},
		{name: "rule3 service waypoint", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil)), wl("waypoint", "10.0.0.100")},
			svcs: []*Service{echo(func(s *Service) { s.Waypoint = wpGW })}, dst: "10.96.0.10:80",
			want: want{kind: RouteWaypoint, dial: "10.0.0.100:15008", authority: "10.96.0.10:80", workload: "waypoint", service: true}},
		{name: "rule3 source is the waypoint", src: wl("waypoint", "10.0.0.100"),
			wls:  []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil)), wl("waypoint", "10.0.0.100")},
			svcs: []*Service{echo(func(s *Service) { s.Waypoint = wpGW })}, dst: "10.96.0.10:80",
			want: want{kind: RouteHBONE, dial: "10.0.0.2:15008", authority: "10.0.0.2:8080", workload: "server", service: true}},
		{name: "rule3 waypoint by hostname, via its service",
			wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil)),
				wl("wp-pod", "10.0.0.101", inSvc("default/wp.default.svc", nil))},
			svcs: []*Service{
				echo(func(s *Service) {
					s.Waypoint = &GatewayAddress{Namespace: "default", Hostname: "wp.default.svc", HBONEPort: 15009}
				}),
				svc("default", "wp.default.svc", "10.96.0.200"),
			}, dst: "10.96.0.10:80",
			want: want{kind: RouteWaypoint, dial: "10.0.0.101:15009", authority: "10.96.0.10:80", workload: "wp-pod", service: true}},
		{name: "rule3 weighted waypoints pick by weight", randN: func(n uint64) uint64 { return 5 }, // weights 5,5: 5 falls in the second
			wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil)), wl("wp1", "10.0.0.101"), wl("wp2", "10.0.0.102")},
			svcs: []*Service{echo(func(s *Service) {
				s.Waypoint = wpGW
				s.WeightedWaypoints = []WeightedWaypoint{{GatewayAddress{Address: ip("10.0.0.101")}, 5}, {GatewayAddress{Address: ip("10.0.0.102")}, 5}}
			})}, dst: "10.96.0.10:80",
			want: want{kind: RouteWaypoint, dial: "10.0.0.102:15008", authority: "10.96.0.10:80", workload: "wp2", service: true}},
		{name: "rule3 missing waypoint is an error", wls: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil))},
			svcs: []*Service{echo(func(s *Service) { s.Waypoint = &GatewayAddress{Namespace: "x", Hostname: "nope"} })}, dst: "10.96.0.10:80",
			want: want{err: ErrWaypointNotFound}},
		{name: "rule7 workload waypoint", wls: []*Workload{wl("server", "10.0.0.2", func(w *Workload) { w.Waypoint = wpGW }), wl("waypoint", "10.0.0.100")},
			dst:  "10.0.0.2:8080",
			want: want{kind: RouteWaypoint, dial: "10.0.0.100:15008", authority: "10.0.0.2:8080", workload: "waypoint"}},
		{name: "rule10 remote network via gateway",
			wls: []*Workload{
				wl("remote", "", inSvc(echoKey, nil), func(w *Workload) {
					w.Network = "net2"
					w.NetworkGateway = &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15009}
				}),
				wl("ewgw", "192.0.2.1", func(w *Workload) { w.Network = "net2" }),
			},
			svcs: []*Service{echo()}, dst: "10.96.0.10:80",
			want: want{kind: RouteDoubleHBONE, dial: "192.0.2.1:15009", authority: "echo.default.svc:80", workload: "remote", service: true}},
		{name: "rule10 remote network without gateway",
			wls:  []*Workload{wl("remote", "10.1.0.2", inSvc(echoKey, nil), func(w *Workload) { w.Network = "net2" })},
			svcs: []*Service{echo()}, dst: "10.96.0.10:80", want: want{err: ErrNoGateway}},
		{name: "rule6 dialed IP kept for dual-stack workload",
			wls:  []*Workload{wl("dual", "10.0.0.2", func(w *Workload) { w.Addresses = ips("10.0.0.2", "fd00::2") })},
			dst:  "[fd00::2]:8080",
			want: want{kind: RouteHBONE, dial: "[fd00::2]:15008", authority: "[fd00::2]:8080", workload: "dual"}},
		{name: "rule6 service picks same family",
			wls:  []*Workload{wl("dual", "10.0.0.2", inSvc(echoKey, nil), func(w *Workload) { w.Addresses = ips("10.0.0.2", "fd00::2") })},
			svcs: []*Service{echo(func(s *Service) { s.Addresses = append(s.Addresses, vip("", "fd00::10")) })}, dst: "[fd00::10]:80",
			want: want{kind: RouteHBONE, dial: "[fd00::2]:15008", authority: "[fd00::2]:8080", workload: "dual", service: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStore()
			if tc.randN != nil {
				s.randN = tc.randN
			}
			s.Apply(&Batch{Workloads: append(tc.wls, client), Services: tc.svcs})
			src := tc.src
			if src == nil {
				src = client
			}
			r, err := s.Resolve(src, ap(tc.dst))
			if tc.want.err != nil {
				if !errors.Is(err, tc.want.err) {
					t.Fatalf("err = %v; want %v", err, tc.want.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Resolve: %v", err)
			}
			if r.Kind != tc.want.kind || r.Dial.String() != tc.want.dial || r.Authority != tc.want.authority {
				t.Errorf("got %v dial %v authority %q; want %v %v %q", r.Kind, r.Dial, r.Authority, tc.want.kind, tc.want.dial, tc.want.authority)
			}
			if name := ""; r.Workload != nil {
				name = r.Workload.Name
				if name != tc.want.workload {
					t.Errorf("workload %q; want %q", name, tc.want.workload)
				}
			} else if tc.want.workload != "" {
				t.Errorf("no workload; want %q", tc.want.workload)
			}
			if (r.Service != nil) != tc.want.service {
				t.Errorf("service = %v; want set=%v", r.Service, tc.want.service)
			}
			if r.Workload != nil && r.Kind != RoutePassthrough {
				found := false
				for _, id := range r.Identities {
					found = found || id == r.Workload.Identity()
				}
				if !found {
					t.Errorf("identities %v lack the destination's %v", r.Identities, r.Workload.Identity())
				}
			}
		})
	}
}

func TestResolveIdentitiesIncludeSANs(t *testing.T) {
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil))}, Services: []*Service{echo()}})
	r, err := s.Resolve(nil, ap("10.96.0.10:80"))
	if err != nil {
		t.Fatal(err)
	}
	want := []identity.ID{identity.MustParse("spiffe://cluster.local/ns/default/sa/echo-san"), identity.MustParse("spiffe://cluster.local/ns/default/sa/server")}
	if len(r.Identities) != 2 || r.Identities[0] != want[0] || r.Identities[1] != want[1] {
		t.Errorf("identities = %v; want %v", r.Identities, want)
	}
}

func TestLoadBalancing(t *testing.T) {
	loc := func(region, zone string) func(*Workload) {
		return func(w *Workload) { w.Locality = Locality{Region: region, Zone: zone} }
	}
	client := wl("client", "10.0.0.1", loc("r1", "z1"))
	same := wl("same", "10.0.0.2", inSvc(echoKey, nil), loc("r1", "z1"))
	region := wl("region", "10.0.0.3", inSvc(echoKey, nil), loc("r1", "z2"))
	far := wl("far", "10.0.0.4", inSvc(echoKey, nil), loc("r2", "z9"))
	prefs := []LBScope{LBScopeRegion, LBScopeZone}
	pick := func(t *testing.T, s *Store) map[string]int {
		t.Helper()
		seen := map[string]int{}
		for range 200 {
			r, err := s.Resolve(client, ap("10.96.0.10:80"))
			if err != nil {
				t.Fatalf("Resolve: %v", err)
			}
			seen[r.Workload.Name]++
		}
		return seen
	}
	t.Run("failover prefers best rank", func(t *testing.T) {
		s := NewStore()
		s.Apply(&Batch{Workloads: []*Workload{client, same, region, far}, Services: []*Service{echo(func(s *Service) {
			s.LoadBalancing = &LoadBalancing{Mode: LBFailover, RoutingPreference: prefs}
		})}})
		if got := pick(t, s); got["same"] != 200 {
			t.Errorf("picks %v; want only same", got)
		}
		s.Apply(&Batch{RemoveAddresses: []string{same.UID}})
		if got := pick(t, s); got["region"] != 200 {
			t.Errorf("after losing zone: picks %v; want only region", got)
		}
		s.Apply(&Batch{RemoveAddresses: []string{region.UID}})
		if got := pick(t, s); got["far"] != 200 {
			t.Errorf("after losing region: picks %v; want far", got)
		}
	})
	t.Run("strict keeps only full matches", func(t *testing.T) {
		s := NewStore()
		s.Apply(&Batch{Workloads: []*Workload{client, region, far}, Services: []*Service{echo(func(s *Service) {
			s.LoadBalancing = &LoadBalancing{Mode: LBStrict, RoutingPreference: prefs}
		})}})
		if _, err := s.Resolve(client, ap("10.96.0.10:80")); !errors.Is(err, ErrNoHealthyEndpoint) {
			t.Errorf("err = %v; want ErrNoHealthyEndpoint", err)
		}
		s.Apply(&Batch{Workloads: []*Workload{same}})
		if got := pick(t, s); got["same"] != 200 {
			t.Errorf("picks %v; want only same", got)
		}
	})
	t.Run("unspecified mode spreads by capacity", func(t *testing.T) {
		s := NewStore()
		big := wl("big", "10.0.0.5", inSvc(echoKey, nil), func(w *Workload) { w.Capacity = 3 })
		s.Apply(&Batch{Workloads: []*Workload{client, same, big}, Services: []*Service{echo()}})
		seen := map[string]int{}
		for range 4000 {
			r, _ := s.Resolve(client, ap("10.96.0.10:80"))
			seen[r.Workload.Name]++
		}
		ratio := float64(seen["big"]) / float64(seen["same"])
		if ratio < 2.4 || ratio > 3.8 {
			t.Errorf("capacity 3:1 gave %v (ratio %.2f)", seen, ratio)
		}
	})
}

// A workload with a hostname and no address (a ServiceEntry with DNS resolution) is a
// service endpoint like any other: its route names the hostname for the caller to resolve,
// and Resolved puts the address where an IP route has it.
func TestResolveHostnameOnly(t *testing.T) {
	for _, tc := range []struct {
		proto           TunnelProtocol
		kind            RouteKind
		dial, authority string
		dialPort        uint16
	}{
		{TunnelHBONE, RouteHBONE, "192.0.2.7:15008", "192.0.2.7:8080", HBONEPort},
		{TunnelNone, RouteTCP, "192.0.2.7:8080", "", 8080},
	} {
		s, client := NewStore(), wl("client", "10.0.0.1")
		host := wl("vm", "", inSvc(echoKey, nil), func(w *Workload) { w.Hostname = "vm.example.com"; w.Protocol = tc.proto })
		s.Apply(&Batch{Workloads: []*Workload{host, client}, Services: []*Service{echo()}})
		r, err := s.Resolve(client, ap("10.96.0.10:80"))
		if err != nil {
			t.Fatalf("%v: Resolve: %v", tc.kind, err)
		}
		if r.Hostname != "vm.example.com" || r.Kind != tc.kind || r.Dial.Port() != tc.dialPort || r.Workload == nil || r.Workload.Name != "vm" {
			t.Fatalf("%v: route %+v; want hostname vm.example.com, port %d, workload vm", tc.kind, r, tc.dialPort)
		}
		r = r.Resolved(ip("192.0.2.7"))
		if r.Hostname != "" || r.Dial.String() != tc.dial || r.Authority != tc.authority {
			t.Errorf("%v: resolved dial %v authority %q hostname %q; want %s %q and no hostname", tc.kind, r.Dial, r.Authority, r.Hostname, tc.dial, tc.authority)
		}
	}
}

// TestResolveAvoiding: the proxy's retries and outlier detection steer the pick; health
// comes before routing preference, and an outage of every endpoint still picks them.
func TestResolveAvoiding(t *testing.T) {
	client := wl("client", "10.0.0.1", func(w *Workload) { w.Locality = Locality{Region: "r", Zone: "z"} })
	local := wl("local", "10.0.0.2", inSvc(echoKey, nil), func(w *Workload) { w.Locality = client.Locality; w.Node = "node-local" })
	remote := wl("remote", "10.0.0.3", inSvc(echoKey, nil), func(w *Workload) { w.Locality = Locality{Region: "r", Zone: "other"}; w.Node = "node-remote" })
	gone := wl("gone", "10.0.0.4", inSvc(echoKey, nil), func(w *Workload) { w.Locality = client.Locality; w.Healthy = false })
	failover := func(s *Service) {
		s.LoadBalancing = &LoadBalancing{Mode: LBFailover, RoutingPreference: []LBScope{LBScopeRegion, LBScopeZone}}
	}
	picks := func(s *Store, avoid Avoid) map[string]int {
		t.Helper()
		seen := map[string]int{}
		for range 200 {
			r, err := s.ResolveAvoiding(client, ap("10.96.0.10:80"), avoid)
			if err != nil {
				seen[err.Error()]++
				continue
			}
			seen[r.Workload.Name]++
		}
		return seen
	}
	// ejected names the endpoints ejected as name:port, the port the pick asks about.
	ejected := func(endpoints ...string) func(*Workload, uint16) bool {
		return func(w *Workload, port uint16) bool {
			return slices.Contains(endpoints, fmt.Sprintf("%s:%d", w.Name, port))
		}
	}
	s := NewStore()
	s.Apply(&Batch{Workloads: []*Workload{client, local, remote, gone}, Services: []*Service{echo(failover)}})
	for _, tc := range []struct {
		name  string
		avoid Avoid
		want  string
	}{
		{"nothing avoided: the best rank", Avoid{}, "local"},
		{"the local endpoint ejected: the healthy remote one", Avoid{Ejected: ejected("local:8080")}, "remote"},
		{"the local endpoint ejected on another port: still the best rank", Avoid{Ejected: ejected("local:9090")}, "local"},
		{"the local endpoint tried: the remote one", Avoid{Tried: []*Workload{local}}, "remote"},
		{"every healthy endpoint ejected: still picked, best rank first", Avoid{Ejected: ejected("local:8080", "remote:8080")}, "local"},
		{"tried and ejected", Avoid{Tried: []*Workload{local}, Ejected: ejected("remote:8080")}, "remote"},
		{"the local endpoint's node avoided: the remote one", Avoid{Nodes: []string{"node-local"}}, "remote"},
		{"both nodes avoided: still picked, best rank first", Avoid{Nodes: []string{"node-local", "node-remote"}}, "local"},
		{"ejected and its node avoided: one step down, as ejected alone", Avoid{Nodes: []string{"node-local"}, Ejected: ejected("local:8080", "remote:8080")}, "local"},
	} {
		if got := picks(s, tc.avoid); got[tc.want] != 200 {
			t.Errorf("%s: picks %v; want only %s", tc.name, got, tc.want)
		}
	}
	if got := picks(s, Avoid{Tried: []*Workload{local, remote}}); got[ErrNoHealthyEndpoint.Error()+" for "+echoKey+" port 80"] != 200 {
		t.Errorf("every healthy endpoint tried, no fallback: %v; want no healthy endpoint", got)
	}

	fb := NewStoreWith(Options{UnhealthyFallback: true})
	fb.Apply(&Batch{Workloads: []*Workload{client, local, remote, gone}, Services: []*Service{echo(failover)}})
	if got := picks(fb, Avoid{Ejected: ejected("local:8080", "remote:8080")}); got["local"] != 200 {
		t.Errorf("fallback on, healthy ones ejected: %v; want the ejected healthy local one before the unhealthy one", got)
	}
	if got := picks(fb, Avoid{Tried: []*Workload{local, remote}}); got["gone"] != 200 {
		t.Errorf("fallback on, healthy ones tried: %v; want the unhealthy one", got)
	}
	if got := picks(fb, Avoid{Tried: []*Workload{local, remote, gone}}); got["local"] != 0 || got["gone"] != 0 {
		t.Errorf("fallback on, every endpoint tried: %v; want none", got)
	}
}

// TestEndpointPort: a route names the port of its workload the pick weighed (the target
// port, a waypoint's HBONE port), the one it asked Avoid.Ejected about, so outlier
// detection keys a failure where the pick looks it up.
func TestEndpointPort(t *testing.T) {
	client := wl("client", "10.0.0.1")
	for _, tc := range []struct {
		name string
		wls  []*Workload
		svcs []*Service
		want uint16
	}{
		{"service endpoint", []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil))}, []*Service{echo()}, 8080},
		{"named port", []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, map[uint16]uint16{80: 9090}))},
			[]*Service{echo(func(s *Service) { s.Ports = map[uint16]uint16{80: 0} })}, 9090},
		{"service waypoint, picked from its service", []*Workload{wl("server", "10.0.0.2", inSvc(echoKey, nil)),
			wl("wp-pod", "10.0.0.101", inSvc("default/wp.default.svc", nil))},
			[]*Service{echo(func(s *Service) {
				s.Waypoint = &GatewayAddress{Namespace: "default", Hostname: "wp.default.svc", HBONEPort: 15009}
			}), svc("default", "wp.default.svc", "10.96.0.200")}, 15009},
		{"remote network via gateway", []*Workload{
			wl("server", "", inSvc(echoKey, nil), func(w *Workload) {
				w.Network = "net2"
				w.NetworkGateway = &GatewayAddress{Network: "net2", Address: ip("192.0.2.1"), HBONEPort: 15009}
			}),
			wl("ewgw", "192.0.2.1", func(w *Workload) { w.Network = "net2" }),
		}, []*Service{echo()}, 8080},
	} {
		s := NewStore()
		s.Apply(&Batch{Workloads: append(tc.wls, client), Services: tc.svcs})
		var asked []string
		r, err := s.ResolveAvoiding(client, ap("10.96.0.10:80"), Avoid{Ejected: func(w *Workload, port uint16) bool {
			asked = append(asked, fmt.Sprintf("%s:%d", w.Name, port))
			return false
		}})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := fmt.Sprintf("%s:%d", r.Workload.Name, r.EndpointPort); r.EndpointPort != tc.want || !slices.Contains(asked, got) {
			t.Errorf("%s: route to %s; want port %d, one the pick asked about (%v)", tc.name, got, tc.want, asked)
		}
	}
}
