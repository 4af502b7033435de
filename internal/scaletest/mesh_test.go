package scaletest

import (
	"fmt"
	"net/netip"
	"strconv"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// Mesh shape: 1 service per 15 workloads (66,666 at 1M), 100 pods per namespace and per
// node, a waypoint on 5% of workloads and services, dual-stack pods and services.
const (
	workloadsPerService   = 15
	workloadsPerNamespace = 100
	workloadsPerNode      = 100
	maxPolicies           = 1000
)

// mesh is a generated mesh as Address and Authorization resources, in the form the ADS
// server sends them.
type mesh struct {
	workloads int
	addresses []*discoverypb.Resource // workloads, then services
	policies  []*discoverypb.Resource
}

func ns(i int) string { return "ns-" + strconv.Itoa(i/workloadsPerNamespace) }

func workloadUID(i int) string {
	return "Kubernetes//Pod/" + ns(i) + "/app-" + strconv.Itoa(i/workloadsPerService) + "-" + strconv.Itoa(i)
}

func serviceHost(s int) string {
	return "svc-" + strconv.Itoa(s) + "." + ns(s*workloadsPerService) + ".svc.cluster.local"
}

func v4(base byte, i int) []byte { return []byte{base, byte(i >> 16), byte(i >> 8), byte(i)} }

func v6(base byte, i int) []byte {
	a := netip.MustParseAddr("fd00::").As16()
	a[2] = base
	a[12], a[13], a[14], a[15] = byte(i>>24), byte(i>>16), byte(i>>8), byte(i)
	return a[:]
}

// genWorkload is workload i at version gen; generations differ in their locality subzone
// (an incremental push changes a field without changing identity or addresses).
func genWorkload(i, gen int) *workloadpb.Workload {
	svc := i / workloadsPerService
	app := "app-" + strconv.Itoa(svc)
	w := &workloadpb.Workload{
		Uid: workloadUID(i), Name: app + "-" + strconv.Itoa(i), Namespace: ns(i),
		Addresses: [][]byte{v4(10, i), v6(1, i)},
		Network:   "", Node: "node-" + strconv.Itoa(i/workloadsPerNode),
		TrustDomain: "cluster.local", ServiceAccount: app,
		CanonicalName: app, CanonicalRevision: "v1", WorkloadName: app,
		WorkloadType:   workloadpb.WorkloadType_DEPLOYMENT,
		TunnelProtocol: workloadpb.TunnelProtocol_HBONE,
		ClusterId:      "Kubernetes",
		Status:         workloadpb.WorkloadStatus_HEALTHY,
		Locality:       &workloadpb.Locality{Region: "region-1", Zone: "zone-" + strconv.Itoa(i%3), Subzone: "gen-" + strconv.Itoa(gen)},
		Services: map[string]*workloadpb.PortList{
			ns(svc*workloadsPerService) + "/" + serviceHost(svc): {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}, {ServicePort: 443, TargetPort: 8443}}},
		},
	}
	if i%20 == 0 {
		w.Waypoint = waypoint(ns(i))
	}
	if p := i / workloadsPerNamespace; i%10 == 0 && p%2 == 1 && p < maxPolicies {
		w.AuthorizationPolicies = []string{ns(i) + "/allow-" + strconv.Itoa(p)}
	}
	return w
}

func waypoint(namespace string) *workloadpb.GatewayAddress {
	return &workloadpb.GatewayAddress{
		Destination:   &workloadpb.GatewayAddress_Hostname{Hostname: &workloadpb.NamespacedHostname{Namespace: namespace, Hostname: "waypoint." + namespace + ".svc.cluster.local"}},
		HboneMtlsPort: 15008,
	}
}

func genService(s int) *workloadpb.Service {
	n := ns(s * workloadsPerService)
	svc := &workloadpb.Service{
		Name: "svc-" + strconv.Itoa(s), Namespace: n, Hostname: serviceHost(s),
		Addresses:  []*workloadpb.NetworkAddress{{Address: v4(172, s)}, {Address: v6(2, s)}},
		Ports:      []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}, {ServicePort: 443, TargetPort: 8443}},
		IpFamilies: workloadpb.IPFamilies_DUAL,
	}
	if s%20 == 0 {
		svc.Waypoint = waypoint(n)
	}
	return svc
}

func genPolicy(p int) *securitypb.Authorization {
	n := ns(p * workloadsPerNamespace)
	a := &securitypb.Authorization{
		Name: "allow-" + strconv.Itoa(p), Namespace: n, Scope: securitypb.Scope_NAMESPACE, Action: securitypb.Action_ALLOW,
		Rules: []*securitypb.Group{{Rules: []*securitypb.Rules{{Matches: []*securitypb.Match{{
			Principals:       []*securitypb.StringMatch{{MatchType: &securitypb.StringMatch_Exact{Exact: "spiffe://cluster.local/ns/" + n + "/sa/client"}}},
			DestinationPorts: []uint32{8080, 8443},
		}}}}}},
	}
	if p%2 == 1 { // half select workloads: every tenth workload of the namespace names it
		a.Scope = securitypb.Scope_WORKLOAD_SELECTOR
	}
	return a
}

func addressResource(name, version string, a *workloadpb.Address) *discoverypb.Resource {
	b, err := proto.Marshal(a)
	if err != nil {
		panic(err) // generated values always marshal
	}
	return &discoverypb.Resource{Name: name, Version: version, Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: b}}
}

func workloadResource(i, gen int) *discoverypb.Resource {
	return addressResource(workloadUID(i), strconv.Itoa(gen), &workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: genWorkload(i, gen)}})
}

// genMesh generates n workloads, n/15 services and up to 1,000 namespace policies.
func genMesh(n int) *mesh {
	m := &mesh{workloads: n, addresses: make([]*discoverypb.Resource, 0, n+n/workloadsPerService)}
	for i := range n {
		m.addresses = append(m.addresses, workloadResource(i, 1))
	}
	for s := range n / workloadsPerService {
		svc := genService(s)
		m.addresses = append(m.addresses, addressResource(svc.Namespace+"/"+svc.Hostname, "1", &workloadpb.Address{Type: &workloadpb.Address_Service{Service: svc}}))
	}
	for p := range min(maxPolicies, max(1, n/workloadsPerNamespace)) {
		a := genPolicy(p)
		b, err := proto.Marshal(a)
		if err != nil {
			panic(err)
		}
		m.policies = append(m.policies, &discoverypb.Resource{Name: a.Namespace + "/" + a.Name, Version: "1", Resource: &anypb.Any{TypeUrl: xdspb.AuthorizationType, Value: b}})
	}
	return m
}

func (m *mesh) String() string {
	return fmt.Sprintf("%d workloads, %d services, %d policies", m.workloads, len(m.addresses)-m.workloads, len(m.policies))
}

// ns0Workload is the node's own workload (PROXY_WORKLOAD_INFO): the mesh's first.
var ns0Workload = ns(0) + "/app-0-0/app-0"
