package xdspb_test

import (
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	_ "github.com/gozt/gozt/xds/xdspb/securitypb"
	_ "github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// TestWireNumbers pins every field number and enum value of Istio's istio.workload and
// istio.security protos, so an edit of the .proto files cannot drift from the wire.
func TestWireNumbers(t *testing.T) {
	fields := map[string]map[string]int{
		"istio.workload.Address": {"workload": 1, "service": 2},
		"istio.workload.Service": {"name": 1, "namespace": 2, "hostname": 3, "addresses": 4, "ports": 5, "subject_alt_names": 6,
			"waypoint": 7, "load_balancing": 8, "ip_families": 9, "extensions": 10, "canonical": 11, "ingress_use_waypoint": 12,
			"weighted_waypoints": 13, "visibility": 14},
		"istio.workload.Workload": {"uid": 20, "name": 1, "namespace": 2, "addresses": 3, "hostname": 21, "network": 4,
			"tunnel_protocol": 5, "trust_domain": 6, "service_account": 7, "waypoint": 8, "network_gateway": 19, "node": 9,
			"canonical_name": 10, "canonical_revision": 11, "workload_type": 12, "workload_name": 13, "native_tunnel": 14,
			"application_tunnel": 23, "services": 22, "authorization_policies": 16, "status": 17, "cluster_id": 18,
			"locality": 24, "network_mode": 25, "extensions": 26, "capacity": 27},
		"istio.workload.Locality":           {"region": 1, "zone": 2, "subzone": 3},
		"istio.workload.PortList":           {"ports": 1},
		"istio.workload.Port":               {"service_port": 1, "target_port": 2, "app_protocol": 3},
		"istio.workload.GatewayAddress":     {"hostname": 1, "address": 2, "hbone_mtls_port": 3},
		"istio.workload.WeightedWaypoint":   {"destination": 1, "weight": 2},
		"istio.workload.NetworkAddress":     {"network": 1, "address": 2, "length": 3},
		"istio.workload.NamespacedHostname": {"namespace": 1, "hostname": 2},
		"istio.workload.ApplicationTunnel":  {"protocol": 1, "port": 2},
		"istio.workload.LoadBalancing":      {"routing_preference": 1, "mode": 2, "health_policy": 3},
		"istio.workload.Extension":          {"name": 1, "config": 2},
		"istio.security.Authorization":      {"name": 1, "namespace": 2, "scope": 3, "action": 4, "rules": 5, "dry_run": 6, "extensions": 7},
		"istio.security.Group":              {"rules": 1},
		"istio.security.Rules":              {"matches": 2},
		"istio.security.Match": {"namespaces": 1, "not_namespaces": 2, "principals": 3, "not_principals": 4, "source_ips": 5,
			"not_source_ips": 6, "destination_ips": 7, "not_destination_ips": 8, "destination_ports": 9,
			"not_destination_ports": 10, "service_accounts": 11, "not_service_accounts": 12, "extensions": 13},
		"istio.security.Address":             {"address": 1, "length": 2},
		"istio.security.ServiceAccountMatch": {"namespace": 1, "serviceAccount": 2},
		"istio.security.StringMatch":         {"exact": 1, "prefix": 2, "suffix": 3, "presence": 4},
	}
	for msg, want := range fields {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(msg))
		if err != nil {
			t.Errorf("%s: %v", msg, err)
			continue
		}
		md := d.(protoreflect.MessageDescriptor)
		if md.Fields().Len() != len(want) {
			t.Errorf("%s has %d fields; want %d", msg, md.Fields().Len(), len(want))
		}
		for name, num := range want {
			f := md.Fields().ByName(protoreflect.Name(name))
			if f == nil || int(f.Number()) != num {
				t.Errorf("%s.%s: got %v; want number %d", msg, name, f, num)
			}
		}
	}
	enums := map[string]map[string]int{
		"istio.workload.Service.Visibility":         {"PUBLIC": 0, "NAMESPACE": 1},
		"istio.workload.IPFamilies":                 {"AUTOMATIC": 0, "IPV4_ONLY": 1, "IPV6_ONLY": 2, "DUAL": 3},
		"istio.workload.NetworkMode":                {"STANDARD": 0, "HOST_NETWORK": 1},
		"istio.workload.LoadBalancing.Scope":        {"UNSPECIFIED_SCOPE": 0, "REGION": 1, "ZONE": 2, "SUBZONE": 3, "NODE": 4, "CLUSTER": 5, "NETWORK": 6},
		"istio.workload.LoadBalancing.Mode":         {"UNSPECIFIED_MODE": 0, "STRICT": 1, "FAILOVER": 2, "PASSTHROUGH": 3},
		"istio.workload.LoadBalancing.HealthPolicy": {"ONLY_HEALTHY": 0, "ALLOW_ALL": 1},
		"istio.workload.WorkloadStatus":             {"HEALTHY": 0, "UNHEALTHY": 1},
		"istio.workload.WorkloadType":               {"DEPLOYMENT": 0, "CRONJOB": 1, "POD": 2, "JOB": 3},
		"istio.workload.AppProtocol":                {"UNKNOWN": 0, "HTTP11": 1, "HTTP2": 2, "GRPC": 3, "TCP": 4, "TLS": 5},
		"istio.workload.TunnelProtocol":             {"NONE": 0, "HBONE": 1, "LEGACY_ISTIO_MTLS": 2},
		"istio.workload.ApplicationTunnel.Protocol": {"NONE": 0, "PROXY": 1},
		"istio.security.Scope":                      {"GLOBAL": 0, "NAMESPACE": 1, "WORKLOAD_SELECTOR": 2},
		"istio.security.Action":                     {"ALLOW": 0, "DENY": 1},
	}
	for enum, want := range enums {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(enum))
		if err != nil {
			t.Errorf("%s: %v", enum, err)
			continue
		}
		ed := d.(protoreflect.EnumDescriptor)
		if ed.Values().Len() != len(want) {
			t.Errorf("%s has %d values; want %d", enum, ed.Values().Len(), len(want))
		}
		for name, num := range want {
			v := ed.Values().ByName(protoreflect.Name(name))
			if v == nil || int(v.Number()) != num {
				t.Errorf("%s.%s: got %v; want %d", enum, name, v, num)
			}
		}
	}
	// Field 15 of Workload and 4 of GatewayAddress are reserved upstream.
	wd, _ := protoregistry.GlobalFiles.FindDescriptorByName("istio.workload.Workload")
	if !wd.(protoreflect.MessageDescriptor).ReservedRanges().Has(15) {
		t.Error("Workload field 15 not reserved")
	}
}
