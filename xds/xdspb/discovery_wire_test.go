package xdspb_test

import (
	"testing"

	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

// wireFields splits b into its top-level fields: number -> list of (type, raw value bytes).
func wireFields(t *testing.T, b []byte) map[protowire.Number][][]byte {
	t.Helper()
	out := map[protowire.Number][][]byte{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		if typ != protowire.BytesType {
			t.Fatalf("field %d: wire type %d; every field here is length-delimited", num, typ)
		}
		v, m := protowire.ConsumeBytes(b)
		if m < 0 {
			t.Fatalf("field %d: %v", num, protowire.ParseError(m))
		}
		out[num] = append(out[num], v)
		b = b[m:]
	}
	return out
}

// TestDeltaRequestWire marshals a DeltaDiscoveryRequest with every field set and checks each
// lands on Envoy's field number (envoy/service/discovery/v3/discovery.proto, core/v3/base.proto).
func TestDeltaRequestWire(t *testing.T) {
	md, err := structpb.NewStruct(map[string]any{"CLUSTER_ID": "Kubernetes"})
	if err != nil {
		t.Fatal(err)
	}
	req := &discoverypb.DeltaDiscoveryRequest{
		Node:                     &discoverypb.Node{Id: "sidecar~10.0.0.1~n~ns.svc", Cluster: "c", Metadata: md, UserAgentName: "gozt"},
		TypeUrl:                  "type.googleapis.com/istio.workload.Address",
		ResourceNamesSubscribe:   []string{"sub"},
		ResourceNamesUnsubscribe: []string{"unsub"},
		InitialResourceVersions:  map[string]string{"w1": "v1"},
		ResponseNonce:            "nonce",
		ErrorDetail:              &statuspb.Status{Code: 3, Message: "bad"},
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	f := wireFields(t, b)
	if len(f) != 7 {
		t.Errorf("request has %d distinct fields on the wire; want 7", len(f))
	}
	for num, want := range map[protowire.Number]string{2: req.TypeUrl, 3: "sub", 4: "unsub", 6: "nonce"} {
		if len(f[num]) != 1 || string(f[num][0]) != want {
			t.Errorf("field %d = %q; want [%q]", num, f[num], want)
		}
	}
	if len(f[5]) != 1 {
		t.Fatalf("initial_resource_versions (5): %d entries; want 1", len(f[5]))
	}
	entry := wireFields(t, f[5][0]) // map entry: key=1, value=2
	if string(entry[1][0]) != "w1" || string(entry[2][0]) != "v1" {
		t.Errorf("map entry = %q", entry)
	}
	if len(f[1]) != 1 {
		t.Fatalf("node (1): %d; want 1", len(f[1]))
	}
	node := wireFields(t, f[1][0])
	for num, want := range map[protowire.Number]string{1: req.Node.Id, 2: "c", 6: "gozt"} {
		if len(node[num]) != 1 || string(node[num][0]) != want {
			t.Errorf("node field %d = %q; want [%q]", num, node[num], want)
		}
	}
	var gotMD structpb.Struct
	if len(node[3]) != 1 || proto.Unmarshal(node[3][0], &gotMD) != nil || gotMD.Fields["CLUSTER_ID"].GetStringValue() != "Kubernetes" {
		t.Errorf("node metadata (3) = %q", node[3])
	}
	var gotSt statuspb.Status
	if len(f[7]) != 1 || proto.Unmarshal(f[7][0], &gotSt) != nil || gotSt.Code != 3 || gotSt.Message != "bad" {
		t.Errorf("error_detail (7) = %q", f[7])
	}
}

// TestDeltaResponseWire checks the response and Resource numbers the same way.
func TestDeltaResponseWire(t *testing.T) {
	resp := &discoverypb.DeltaDiscoveryResponse{
		SystemVersionInfo: "sys",
		Resources: []*discoverypb.Resource{{
			Name: "n", Aliases: []string{"a"}, Version: "v",
			Resource: &anypb.Any{TypeUrl: "type.googleapis.com/x", Value: []byte{1}},
		}},
		TypeUrl:          "type.googleapis.com/x",
		Nonce:            "nonce",
		RemovedResources: []string{"gone"},
	}
	b, err := proto.Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	f := wireFields(t, b)
	for num, want := range map[protowire.Number]string{1: "sys", 4: resp.TypeUrl, 5: "nonce", 6: "gone"} {
		if len(f[num]) != 1 || string(f[num][0]) != want {
			t.Errorf("response field %d = %q; want [%q]", num, f[num], want)
		}
	}
	if len(f) != 5 || len(f[2]) != 1 {
		t.Fatalf("response fields = %v; want 1,2,4,5,6 with one resource", f)
	}
	r := wireFields(t, f[2][0])
	for num, want := range map[protowire.Number]string{1: "v", 3: "n", 4: "a"} {
		if len(r[num]) != 1 || string(r[num][0]) != want {
			t.Errorf("resource field %d = %q; want [%q]", num, r[num], want)
		}
	}
	var a anypb.Any
	if len(r[2]) != 1 || proto.Unmarshal(r[2][0], &a) != nil || a.TypeUrl != "type.googleapis.com/x" {
		t.Errorf("resource.resource (2) = %q", r[2])
	}
}

// TestDiscoveryNames pins what makes us interoperable with istiod beyond field numbers: the
// fully qualified names (the gRPC method path is built from them) and the reserved numbers.
func TestDiscoveryNames(t *testing.T) {
	if got, want := discoverypb.AggregatedDiscoveryService_DeltaAggregatedResources_FullMethodName,
		"/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"; got != want {
		t.Errorf("method = %q; want %q", got, want)
	}
	for _, c := range []struct {
		msg      proto.Message
		name     protoreflect.FullName
		reserved []protowire.Number
	}{
		{&discoverypb.DeltaDiscoveryRequest{}, "envoy.service.discovery.v3.DeltaDiscoveryRequest", []protowire.Number{8, 9}},
		{&discoverypb.DeltaDiscoveryResponse{}, "envoy.service.discovery.v3.DeltaDiscoveryResponse", []protowire.Number{7, 8, 9}},
		{&discoverypb.Resource{}, "envoy.service.discovery.v3.Resource", []protowire.Number{6, 7, 9}},
		{&discoverypb.Node{}, "envoy.config.core.v3.Node", []protowire.Number{4, 5, 7, 8, 9, 10, 11, 12}},
	} {
		d := c.msg.ProtoReflect().Descriptor()
		if d.FullName() != c.name {
			t.Errorf("%T is %s; want %s", c.msg, d.FullName(), c.name)
		}
		for _, n := range c.reserved {
			if !d.ReservedRanges().Has(n) {
				t.Errorf("%s: field %d not reserved", c.name, n)
			}
		}
	}
	// The status import resolves to genproto's registration, not a second copy of ours.
	fd, err := protoregistry.GlobalFiles.FindFileByPath("google/rpc/status.proto")
	if err != nil {
		t.Fatal(err)
	}
	if fd != (&statuspb.Status{}).ProtoReflect().Descriptor().ParentFile() {
		t.Error("google/rpc/status.proto registered by someone other than genproto")
	}
}
