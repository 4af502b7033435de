package xds

import (
	"fmt"
	"reflect"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// wireSamples are Workloads with every field the converter reads set in some of them.
func wireSamples() []*workloadpb.Workload {
	full := &workloadpb.Workload{
		Uid: "cluster1//v1/Pod/ns/a", Name: "a", Namespace: "ns", Hostname: "a.example",
		Addresses: [][]byte{addr("10.0.0.1"), addr("fd00::1")}, Network: "net1",
		TunnelProtocol: workloadpb.TunnelProtocol_HBONE, TrustDomain: "td", ServiceAccount: "sa",
		Waypoint: &workloadpb.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadpb.GatewayAddress_Address{
			Address: &workloadpb.NetworkAddress{Network: "net1", Address: addr("10.0.9.9"), Length: proto.Uint32(32)}}},
		NetworkGateway: &workloadpb.GatewayAddress{HboneMtlsPort: 15009, Destination: &workloadpb.GatewayAddress_Hostname{
			Hostname: &workloadpb.NamespacedHostname{Namespace: "istio-system", Hostname: "gw.example"}}},
		Node: "node1", CanonicalName: "app", CanonicalRevision: "v1", WorkloadType: workloadpb.WorkloadType_JOB,
		WorkloadName: "app-deploy", NativeTunnel: true,
		ApplicationTunnel: &workloadpb.ApplicationTunnel{Protocol: workloadpb.ApplicationTunnel_PROXY, Port: 15088},
		Services: map[string]*workloadpb.PortList{
			"ns/svc.example": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080, AppProtocol: workloadpb.AppProtocol_HTTP2}, {ServicePort: 443}}},
			"ns/empty":       {},
		},
		AuthorizationPolicies: []string{"ns/p1", "ns/p2"}, Status: workloadpb.WorkloadStatus_UNHEALTHY,
		ClusterId: "c1", Locality: &workloadpb.Locality{Region: "r", Zone: "z", Subzone: "s"},
		NetworkMode: workloadpb.NetworkMode_HOST_NETWORK, Capacity: wrapperspb.UInt32(3),
	}
	withExt := proto.Clone(full).(*workloadpb.Workload)
	withExt.Extensions = []*workloadpb.Extension{{Name: "x", Config: &anypb.Any{TypeUrl: "t", Value: []byte{1}}}}
	return []*workloadpb.Workload{
		{},
		{Uid: "u", Name: "pod", Namespace: "ns", Addresses: [][]byte{addr("10.0.0.2")}},
		{Uid: "u", Locality: &workloadpb.Locality{}, Capacity: wrapperspb.UInt32(0), ApplicationTunnel: &workloadpb.ApplicationTunnel{}},
		{Uid: "u", WorkloadType: workloadpb.WorkloadType(-1), TunnelProtocol: 7},
		full,
		withExt,
	}
}

// decodeBoth decodes b as an Address with proto.Unmarshal and with workloadDecoder. want
// is nil when proto.Unmarshal fails; got is nil when the fast path declines or fails.
func decodeBoth(t *testing.T, d *workloadDecoder, b []byte) (want, got *workloadpb.Workload, protoErr, wireErr error, ok bool) {
	t.Helper()
	var a workloadpb.Address
	if protoErr = (proto.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, &a); protoErr == nil { // the fast path keeps none
		want = a.GetWorkload()
		if want != nil {
			want.Extensions = nil // skipped unread by design
		}
	}
	got, ok, wireErr = d.workload(b)
	return want, got, protoErr, wireErr, ok
}

func marshalAddress(t *testing.T, w *workloadpb.Workload) []byte {
	t.Helper()
	b, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestWorkloadWireMatchesProto: the fast decoder yields what proto.Unmarshal does, for every
// sample, for pairs of them concatenated inside one Address (proto3 merges a message seen
// twice), and on one reused decoder (nothing of a previous workload leaks into the next).
func TestWorkloadWireMatchesProto(t *testing.T) {
	var d workloadDecoder
	samples := wireSamples()
	check := func(name string, b []byte) {
		want, got, perr, werr, ok := decodeBoth(t, &d, b)
		if perr != nil || werr != nil || !ok {
			t.Fatalf("%s: proto error %v, wire error %v, fast path taken %v", name, perr, werr, ok)
		}
		if !proto.Equal(want, got) {
			t.Errorf("%s:\nproto %v\nwire  %v", name, want, got)
		}
	}
	for i, w := range samples {
		check(fmt.Sprint("sample ", i), marshalAddress(t, w))
	}
	for i, a := range samples {
		for j, b := range samples {
			ab, err := proto.Marshal(a)
			if err != nil {
				t.Fatal(err)
			}
			bb, _ := proto.Marshal(b)
			// One Address whose workload field is the two messages' bytes back to back.
			body := append(append([]byte{}, ab...), bb...)
			msg := appendBytesField(nil, addrWorkload, body)
			check(fmt.Sprint("merge ", i, j), msg)
		}
	}
}

// TestWorkloadWireDeclines: a service, an empty Address and a workload split over two
// fields go to proto.Unmarshal; bad bytes are an error.
func TestWorkloadWireDeclines(t *testing.T) {
	var d workloadDecoder
	svc, _ := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Service{Service: &workloadpb.Service{Name: "s"}}})
	w, _ := proto.Marshal(&workloadpb.Workload{Uid: "u"})
	split := appendBytesField(appendBytesField(nil, addrWorkload, w), addrWorkload, w)
	for name, b := range map[string][]byte{"service": svc, "empty": nil, "split": split} {
		if _, ok, err := d.workload(b); ok || err != nil {
			t.Errorf("%s: fast path %v, error %v; want it declined", name, ok, err)
		}
	}
	bad := appendBytesField(nil, addrWorkload, appendBytesField(nil, wlUID, []byte{0xff, 0xfe}))
	if _, _, err := d.workload(bad); err == nil {
		t.Error("a uid of invalid UTF-8 decoded")
	}
	if _, _, err := d.workload([]byte{0x0a, 0x05, 1}); err == nil {
		t.Error("a truncated message decoded")
	}
}

func appendBytesField(b []byte, num protowire.Number, v []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, num, protowire.BytesType), v)
}

// FuzzWorkloadWire: on any bytes, the fast decoder never panics, fails only where
// proto.Unmarshal fails too, and yields what it yields.
func FuzzWorkloadWire(f *testing.F) {
	for _, w := range wireSamples() {
		b, _ := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
		f.Add(b)
	}
	var d workloadDecoder
	f.Fuzz(func(t *testing.T, b []byte) {
		want, got, perr, werr, ok := decodeBoth(t, &d, b)
		if werr != nil && perr == nil {
			t.Fatalf("wire error %v where proto.Unmarshal succeeds", werr)
		}
		if ok && want != nil && !proto.Equal(want, got) {
			t.Fatalf("\nproto %v\nwire  %v", want, got)
		}
	})
}

// TestInternedServicesMatch: a push's interned services map equals the plain conversion,
// a repeated service port keeping its last target port, and a bad port is the same error.
func TestInternedServicesMatch(t *testing.T) {
	p := &workloadpb.Workload{Uid: "u", Services: map[string]*workloadpb.PortList{
		"ns/a": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 1}, {ServicePort: 443, TargetPort: 2}, {ServicePort: 80, TargetPort: 3}}},
		"ns/b": nil,
	}}
	plain, err := convertWorkload(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := newInterner()
	interned, err := convertWorkload(p, in)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(plain.Services, interned.Services) || interned.Services["ns/a"][80] != 3 {
		t.Errorf("interned %v, plain %v", interned.Services, plain.Services)
	}
	again, _ := convertWorkload(p, in)
	if reflect.ValueOf(again.Services).UnsafePointer() != reflect.ValueOf(interned.Services).UnsafePointer() {
		t.Error("an equal services map is not shared")
	}
	p.Services["ns/b"] = &workloadpb.PortList{Ports: []*workloadpb.Port{{ServicePort: 70000}}}
	_, perr := convertWorkload(p, nil)
	_, ierr := convertWorkload(p, in)
	if perr == nil || ierr == nil || perr.Error() != ierr.Error() {
		t.Errorf("bad port: plain %v, interned %v", perr, ierr)
	}
}

// TestDecodedKeepsNoAlias: what a push decodes to holds no string or slice of the message's
// buffers (the decoder's strings alias them; gRPC reuses them): scribbling over the buffers
// afterwards changes nothing decoded.
func TestDecodedKeepsNoAlias(t *testing.T) {
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "n"}
	for i, w := range wireSamples()[1:] {
		w = proto.Clone(w).(*workloadpb.Workload)
		w.Uid, w.TunnelProtocol = fmt.Sprint("cluster1//v1/Pod/ns/a", i), workloadpb.TunnelProtocol_HBONE
		v := marshalAddress(t, w)
		resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: w.Uid, Version: fmt.Sprint("v", i), Aliases: []string{"alias"}, Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: v}})
	}
	svc := &workloadpb.Service{Name: "s", Namespace: "ns", Hostname: "s.ns.svc", Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}
	sv, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Service{Service: svc}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: "ns/s.ns.svc", Version: "v9", Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: sv}})
	wire, err := proto.Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	want := fromProto(resp, true, nil)
	got := decodeStream(t, wire, 64)
	for i := range wire {
		wire[i] = 'X'
	}
	if len(got.d.errs) != 0 || len(got.d.batch.Workloads) != len(resp.Resources)-1 {
		t.Fatalf("errors %v, %d workloads", got.d.errs, len(got.d.batch.Workloads))
	}
	if !reflect.DeepEqual(got.d.batch.Workloads, want.d.batch.Workloads) || !reflect.DeepEqual(got.d.batch.Services, want.d.batch.Services) ||
		!reflect.DeepEqual(got.d.accepted, want.d.accepted) || !reflect.DeepEqual(got.d.names, want.d.names) {
		t.Errorf("decoded values changed with the buffers:\n%+v\nwant\n%+v", got.d.accepted, want.d.accepted)
	}
}
