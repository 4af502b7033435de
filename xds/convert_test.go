package xds

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

func addr(s string) []byte { return netip.MustParseAddr(s).AsSlice() }

func baseWorkload() *workloadpb.Workload {
	return &workloadpb.Workload{Uid: "u1", Name: "a", Namespace: "ns", Addresses: [][]byte{addr("10.0.0.1")}, TunnelProtocol: workloadpb.TunnelProtocol_HBONE}
}

func TestConvertWorkload(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mod   func(*workloadpb.Workload)
		check func(*state.Workload) bool
		err   string
	}{
		{"defaults", func(*workloadpb.Workload) {}, func(w *state.Workload) bool {
			return w.TrustDomain == "cluster.local" && w.ServiceAccount == "default" && w.ClusterID == "Kubernetes" &&
				w.Capacity == 1 && w.Healthy && w.Protocol == state.TunnelHBONE &&
				w.Identity().String() == "spiffe://cluster.local/ns/ns/sa/default"
		}, ""},
		{"explicit identity", func(p *workloadpb.Workload) { p.TrustDomain, p.ServiceAccount = "td", "sa" },
			func(w *state.Workload) bool { return w.Identity().String() == "spiffe://td/ns/ns/sa/sa" }, ""},
		{"missing uid", func(p *workloadpb.Workload) { p.Uid = "" }, nil, "uid: empty"},
		{"ipv6 and mapped v4", func(p *workloadpb.Workload) {
			p.Addresses = [][]byte{addr("fd00::1"), netip.MustParseAddr("::ffff:10.0.0.2").AsSlice()}
		}, func(w *state.Workload) bool {
			return w.Addresses[0] == netip.MustParseAddr("fd00::1") && w.Addresses[1] == netip.MustParseAddr("10.0.0.2")
		}, ""},
		{"bad address length", func(p *workloadpb.Workload) { p.Addresses = [][]byte{{1, 2, 3}} }, nil, "addresses[0]: address of 3 bytes"},
		{"tcp", func(p *workloadpb.Workload) { p.TunnelProtocol = workloadpb.TunnelProtocol_NONE },
			func(w *state.Workload) bool { return w.Protocol == state.TunnelNone }, ""},
		{"legacy mtls rejected", func(p *workloadpb.Workload) { p.TunnelProtocol = workloadpb.TunnelProtocol_LEGACY_ISTIO_MTLS }, nil, "unsupported tunnel_protocol"},
		{"unhealthy", func(p *workloadpb.Workload) { p.Status = workloadpb.WorkloadStatus_UNHEALTHY },
			func(w *state.Workload) bool { return !w.Healthy }, ""},
		{"capacity", func(p *workloadpb.Workload) { p.Capacity = wrapperspb.UInt32(7) },
			func(w *state.Workload) bool { return w.Capacity == 7 }, ""},
		{"capacity zero kept", func(p *workloadpb.Workload) { p.Capacity = wrapperspb.UInt32(0) },
			func(w *state.Workload) bool { return w.Capacity == 0 }, ""},
		{"host network", func(p *workloadpb.Workload) { p.NetworkMode = workloadpb.NetworkMode_HOST_NETWORK },
			func(w *state.Workload) bool { return w.NetworkMode == state.NetworkHostNetwork }, ""},
		{"waypoint by address", func(p *workloadpb.Workload) {
			p.Waypoint = &workloadpb.GatewayAddress{Destination: &workloadpb.GatewayAddress_Address{Address: &workloadpb.NetworkAddress{Network: "n", Address: addr("10.0.0.9")}}}
		}, func(w *state.Workload) bool {
			return w.Waypoint.Address == netip.MustParseAddr("10.0.0.9") && w.Waypoint.Network == "n" && w.Waypoint.Port() == 15008
		}, ""},
		{"waypoint by hostname", func(p *workloadpb.Workload) {
			p.Waypoint = &workloadpb.GatewayAddress{HboneMtlsPort: 15009, Destination: &workloadpb.GatewayAddress_Hostname{Hostname: &workloadpb.NamespacedHostname{Namespace: "ns", Hostname: "wp"}}}
		}, func(w *state.Workload) bool { return w.Waypoint.String() == "ns/wp" && w.Waypoint.Port() == 15009 }, ""},
		{"waypoint without destination", func(p *workloadpb.Workload) { p.Waypoint = &workloadpb.GatewayAddress{} }, nil, "waypoint: gateway has no destination"},
		{"network gateway", func(p *workloadpb.Workload) {
			p.NetworkGateway = &workloadpb.GatewayAddress{HboneMtlsPort: 15009, Destination: &workloadpb.GatewayAddress_Address{Address: &workloadpb.NetworkAddress{Address: addr("192.0.2.1")}}}
		}, func(w *state.Workload) bool { return w.NetworkGateway.Address == netip.MustParseAddr("192.0.2.1") }, ""},
		{"bad gateway port", func(p *workloadpb.Workload) {
			p.NetworkGateway = &workloadpb.GatewayAddress{HboneMtlsPort: 70000}
		}, nil, "hbone_mtls_port 70000 out of range"},
		{"app tunnel", func(p *workloadpb.Workload) {
			p.ApplicationTunnel = &workloadpb.ApplicationTunnel{Protocol: workloadpb.ApplicationTunnel_PROXY, Port: 15088}
		}, func(w *state.Workload) bool {
			return *w.AppTunnel == state.AppTunnel{Protocol: state.AppTunnelProxy, Port: 15088}
		}, ""},
		{"services", func(p *workloadpb.Workload) {
			p.Services = map[string]*workloadpb.PortList{"ns/svc": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}, {ServicePort: 81}}}}
		}, func(w *state.Workload) bool {
			return reflect.DeepEqual(w.Services, map[string]map[uint16]uint16{"ns/svc": {80: 8080, 81: 0}})
		}, ""},
		{"service port out of range", func(p *workloadpb.Workload) {
			p.Services = map[string]*workloadpb.PortList{"ns/svc": {Ports: []*workloadpb.Port{{ServicePort: 65536}}}}
		}, nil, "service_port 65536 out of range"},
		{"locality, node, network, policies", func(p *workloadpb.Workload) {
			p.Locality = &workloadpb.Locality{Region: "r", Zone: "z", Subzone: "s"}
			p.Node, p.Network, p.AuthorizationPolicies = "n1", "net", []string{"ns/p"}
		}, func(w *state.Workload) bool {
			return w.Locality == state.Locality{Region: "r", Zone: "z", Subzone: "s"} && w.Node == "n1" && w.Network == "net" && w.AuthorizationPolicies[0] == "ns/p"
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := baseWorkload()
			tc.mod(p)
			w, err := ConvertWorkload(p)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v; want containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.check(w) {
				t.Errorf("unexpected conversion: %+v", w)
			}
		})
	}
}

func TestConvertService(t *testing.T) {
	l16 := uint32(16)
	l40 := uint32(40)
	for _, tc := range []struct {
		name  string
		mod   func(*workloadpb.Service)
		check func(*state.Service) bool
		err   string
	}{
		{"basic", func(*workloadpb.Service) {}, func(s *state.Service) bool {
			return s.Key() == "ns/svc.ns.svc" && s.Ports[80] == 8080 && s.Addresses[0].Address == netip.MustParseAddr("10.96.0.1") &&
				!s.Addresses[0].Prefix.IsValid() && s.Visibility == state.VisibilityPublic && s.LoadBalancing == nil
		}, ""},
		{"missing hostname", func(p *workloadpb.Service) { p.Hostname = "" }, nil, "hostname: empty"},
		{"cidr vip", func(p *workloadpb.Service) { p.Addresses[0].Length = &l16 },
			func(s *state.Service) bool { return s.Addresses[0].Prefix == netip.MustParsePrefix("10.96.0.0/16") }, ""},
		{"bad cidr length", func(p *workloadpb.Service) { p.Addresses[0].Length = &l40 }, nil, "bad prefix length 40"},
		{"bad vip", func(p *workloadpb.Service) { p.Addresses[0].Address = []byte{1} }, nil, "addresses[0]"},
		{"namespace visibility", func(p *workloadpb.Service) { p.Visibility = workloadpb.Service_NAMESPACE },
			func(s *state.Service) bool { return s.Visibility == state.VisibilityNamespace }, ""},
		{"canonical", func(p *workloadpb.Service) { p.Canonical = true }, func(s *state.Service) bool { return s.Canonical }, ""},
		{"load balancing", func(p *workloadpb.Service) {
			p.LoadBalancing = &workloadpb.LoadBalancing{
				RoutingPreference: []workloadpb.LoadBalancing_Scope{workloadpb.LoadBalancing_REGION, workloadpb.LoadBalancing_NETWORK},
				Mode:              workloadpb.LoadBalancing_FAILOVER, HealthPolicy: workloadpb.LoadBalancing_ALLOW_ALL,
			}
		}, func(s *state.Service) bool {
			return reflect.DeepEqual(*s.LoadBalancing, state.LoadBalancing{RoutingPreference: []state.LBScope{state.LBScopeRegion, state.LBScopeNetwork}, Mode: state.LBFailover, HealthPolicy: state.AllowAll})
		}, ""},
		{"unknown lb mode", func(p *workloadpb.Service) { p.LoadBalancing = &workloadpb.LoadBalancing{Mode: 9} }, nil, "unknown mode 9"},
		{"weighted waypoints", func(p *workloadpb.Service) {
			p.WeightedWaypoints = []*workloadpb.WeightedWaypoint{{Weight: 3, Destination: &workloadpb.GatewayAddress{Destination: &workloadpb.GatewayAddress_Address{Address: &workloadpb.NetworkAddress{Address: addr("10.0.0.5")}}}}}
		}, func(s *state.Service) bool {
			return len(s.WeightedWaypoints) == 1 && s.WeightedWaypoints[0].Weight == 3 && s.WeightedWaypoints[0].Gateway.Address == netip.MustParseAddr("10.0.0.5")
		}, ""},
		{"weighted waypoint without destination", func(p *workloadpb.Service) {
			p.WeightedWaypoints = []*workloadpb.WeightedWaypoint{{Weight: 3}}
		}, nil, "weighted_waypoints[0]"},
		{"target port out of range", func(p *workloadpb.Service) { p.Ports[0].TargetPort = 1 << 20 }, nil, "target_port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &workloadpb.Service{Name: "svc", Namespace: "ns", Hostname: "svc.ns.svc",
				Addresses: []*workloadpb.NetworkAddress{{Address: addr("10.96.0.1")}},
				Ports:     []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}
			tc.mod(p)
			s, err := ConvertService(p)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v; want containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.check(s) {
				t.Errorf("unexpected conversion: %+v", s)
			}
		})
	}
}

func TestConvertAuthorization(t *testing.T) {
	exact := func(s string) *securitypb.StringMatch {
		return &securitypb.StringMatch{MatchType: &securitypb.StringMatch_Exact{Exact: s}}
	}
	full := &securitypb.Authorization{
		Name: "p", Namespace: "ns", Scope: securitypb.Scope_WORKLOAD_SELECTOR, Action: securitypb.Action_DENY, DryRun: true,
		Rules: []*securitypb.Group{{Rules: []*securitypb.Rules{{Matches: []*securitypb.Match{{
			Namespaces:     []*securitypb.StringMatch{exact("a")},
			NotNamespaces:  []*securitypb.StringMatch{{MatchType: &securitypb.StringMatch_Prefix{Prefix: "kube-"}}},
			Principals:     []*securitypb.StringMatch{{MatchType: &securitypb.StringMatch_Suffix{Suffix: "/sa/x"}}},
			NotPrincipals:  []*securitypb.StringMatch{{MatchType: &securitypb.StringMatch_Presence{Presence: &emptypb.Empty{}}}},
			SourceIps:      []*securitypb.Address{{Address: addr("10.0.0.0"), Length: 8}},
			NotSourceIps:   []*securitypb.Address{{Address: addr("10.1.0.0"), Length: 16}},
			DestinationIps: []*securitypb.Address{{Address: addr("fd00::"), Length: 64}}, NotDestinationIps: []*securitypb.Address{{Address: addr("10.0.0.1"), Length: 32}},
			DestinationPorts: []uint32{8080}, NotDestinationPorts: []uint32{15021},
			ServiceAccounts: []*securitypb.ServiceAccountMatch{{Namespace: "ns", ServiceAccount: "sa"}}, NotServiceAccounts: []*securitypb.ServiceAccountMatch{{Namespace: "x", ServiceAccount: "y"}},
		}}}}}},
	}
	p, err := ConvertAuthorization(full)
	if err != nil {
		t.Fatal(err)
	}
	want := &state.Policy{Name: "p", Namespace: "ns", Scope: state.ScopeWorkloadSelector, Action: state.ActionDeny, DryRun: true,
		Rules: []state.Rule{{Clauses: []state.Clause{{Matches: []state.Match{{
			Namespaces:          []state.StringMatch{{Kind: state.MatchExact, Value: "a"}},
			NotNamespaces:       []state.StringMatch{{Kind: state.MatchPrefix, Value: "kube-"}},
			Principals:          []state.StringMatch{{Kind: state.MatchSuffix, Value: "/sa/x"}},
			NotPrincipals:       []state.StringMatch{{Kind: state.MatchPresence}},
			SourceIPs:           []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
			NotSourceIPs:        []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")},
			DestinationIPs:      []netip.Prefix{netip.MustParsePrefix("fd00::/64")},
			NotDestinationIPs:   []netip.Prefix{netip.MustParsePrefix("10.0.0.1/32")},
			DestinationPorts:    []uint16{8080},
			NotDestinationPorts: []uint16{15021},
			ServiceAccounts:     []state.ServiceAccountMatch{{Namespace: "ns", ServiceAccount: "sa"}},
			NotServiceAccounts:  []state.ServiceAccountMatch{{Namespace: "x", ServiceAccount: "y"}},
		}}}}}},
	}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("got %+v\nwant %+v", p, want)
	}
	for _, tc := range []struct {
		name string
		mod  func(*securitypb.Authorization)
		err  string
	}{
		{"no name", func(a *securitypb.Authorization) { a.Name = "" }, "name: empty"},
		{"bad scope", func(a *securitypb.Authorization) { a.Scope = 7 }, "unknown scope 7"},
		{"bad action (AUDIT)", func(a *securitypb.Authorization) { a.Action = 2 }, "unknown action 2"},
		{"empty string match", func(a *securitypb.Authorization) {
			a.Rules[0].Rules[0].Matches[0].Namespaces = []*securitypb.StringMatch{{}}
		}, "rules[0][0][0]: namespaces[0]: string match has no type"},
		{"bad prefix length", func(a *securitypb.Authorization) {
			a.Rules[0].Rules[0].Matches[0].SourceIps[0].Length = 33
		}, "source_ips[0]: bad prefix length 33"},
		{"bad port", func(a *securitypb.Authorization) {
			a.Rules[0].Rules[0].Matches[0].DestinationPorts = []uint32{65536}
		}, "destination_ports 65536 out of range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := proto.Clone(full).(*securitypb.Authorization)
			tc.mod(a)
			if _, err := ConvertAuthorization(a); err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err = %v; want containing %q", err, tc.err)
			}
		})
	}
}

func FuzzConvert(f *testing.F) {
	w, _ := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: baseWorkload()}})
	s, _ := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Service{Service: &workloadpb.Service{Hostname: "h", Addresses: []*workloadpb.NetworkAddress{{Address: addr("10.0.0.1")}}}}})
	a, _ := proto.Marshal(&securitypb.Authorization{Name: "p", Rules: []*securitypb.Group{{Rules: []*securitypb.Rules{{Matches: []*securitypb.Match{{SourceIps: []*securitypb.Address{{Address: addr("10.0.0.0"), Length: 8}}}}}}}}})
	f.Add(w)
	f.Add(s)
	f.Add(a)
	f.Add([]byte{0x0a, 0x03, 0x1a, 0x01, 0x01})
	f.Fuzz(func(t *testing.T, data []byte) {
		var addrMsg workloadpb.Address
		if proto.Unmarshal(data, &addrMsg) == nil {
			wl, svc, err := ConvertAddress(&addrMsg)
			if err == nil && (wl == nil) == (svc == nil) {
				t.Fatalf("ConvertAddress: no error but workload=%v service=%v", wl, svc)
			}
			if err == nil && wl != nil && wl.UID == "" {
				t.Fatal("workload without uid accepted")
			}
		}
		var authz securitypb.Authorization
		if proto.Unmarshal(data, &authz) == nil {
			if p, err := ConvertAuthorization(&authz); err == nil && p.Name == "" {
				t.Fatal("policy without name accepted")
			}
		}
	})
}

// A pod of a meta the push has seen costs two allocations: the workload with its addresses
// (one or two) in one object, and its uid's copy (its name is the uid's tail). Apart, the
// addresses were one more: a million more objects for the collector in a 1M push.
func TestConvertWorkloadAllocs(t *testing.T) {
	in := newInterner()
	for _, addrs := range [][][]byte{{addr("10.0.0.1")}, {addr("10.0.0.1"), addr("fd00::1")}} {
		p := baseWorkload()
		p.Uid, p.Addresses = "Kubernetes//Pod/ns/a", addrs
		w, err := convertWorkload(p, in) // files its meta
		if err != nil {
			t.Fatal(err)
		}
		if last, _ := ipFromBytes(addrs[len(addrs)-1]); len(w.Addresses) != len(addrs) || w.Addresses[len(addrs)-1] != last {
			t.Fatalf("addresses %v", w.Addresses)
		}
		if n := testing.AllocsPerRun(100, func() { _, _ = convertWorkload(p, in) }); n != 2 {
			t.Errorf("%d addresses: %v allocations a workload; want 2", len(addrs), n)
		}
	}
}
