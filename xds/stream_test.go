package xds

import (
	"net/netip"
	"reflect"
	"strconv"
	"testing"
	"unsafe"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

func streamTestPush(t testing.TB) *discoverypb.DeltaDiscoveryResponse {
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "7", SystemVersionInfo: "v", RemovedResources: []string{"gone-1", "gone-2"}}
	for i := range 20 {
		uid := "Kubernetes//Pod/ns/pod-" + strconv.Itoa(i)
		w := &workloadpb.Workload{Uid: uid, Name: "pod-" + strconv.Itoa(i), Namespace: "ns",
			Addresses: [][]byte{netip.AddrFrom4([4]byte{10, 0, 0, byte(i)}).AsSlice()}, TunnelProtocol: workloadpb.TunnelProtocol_HBONE}
		name := uid
		if i == 5 {
			name = "not-the-uid" // rejected: name and uid differ
		}
		v, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
		if err != nil {
			t.Fatal(err)
		}
		resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: name, Version: strconv.Itoa(i % 3), Aliases: []string{"alias-" + name}, Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: v}})
	}
	return resp
}

// chunked splits b into buffers of at most n bytes, as gRPC hands over DATA frames.
func chunked(b []byte, n int) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		k := min(n, len(b))
		s = append(s, mem.SliceBuffer(b[:k:k]))
		b = b[k:]
	}
	return s
}

func decodeStream(t *testing.T, wire []byte, chunk int) *response {
	t.Helper()
	r := &response{collectNames: true}
	if err := newStreamCodec().Unmarshal(chunked(wire, chunk), r); err != nil {
		t.Fatalf("chunks of %d: %v", chunk, err)
	}
	return r
}

// The streaming decoder gives what decoding the whole message gives, however the message
// is split into buffers, with the type URL after the resources (as Go marshals it) or
// before them.
func TestStreamDecodeMatchesProto(t *testing.T) {
	m := streamTestPush(t)
	want := fromProto(m, true, nil)
	if len(want.d.errs) != 1 || len(want.d.accepted) != 19 {
		t.Fatalf("reference decode: %d errors, %d accepted; want 1 and 19", len(want.d.errs), len(want.d.accepted))
	}
	ordered, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	// The same message with type_url and nonce first.
	typeFirst := protowire.AppendTag(nil, respTypeURL, protowire.BytesType)
	typeFirst = protowire.AppendString(typeFirst, m.TypeUrl)
	typeFirst = protowire.AppendTag(typeFirst, respNonce, protowire.BytesType)
	typeFirst = protowire.AppendString(typeFirst, m.Nonce)
	rest, err := proto.Marshal(&discoverypb.DeltaDiscoveryResponse{Resources: m.Resources, RemovedResources: m.RemovedResources, SystemVersionInfo: m.SystemVersionInfo})
	if err != nil {
		t.Fatal(err)
	}
	typeFirst = append(typeFirst, rest...)
	for _, wire := range [][]byte{ordered, typeFirst} {
		for _, chunk := range []int{1, 2, 7, 64, 333, len(wire)} {
			got := decodeStream(t, wire, chunk)
			if got.typeURL != want.typeURL || got.nonce != want.nonce || got.bytes != len(wire) ||
				!reflect.DeepEqual(got.removed, want.removed) || !reflect.DeepEqual(got.d.accepted, want.d.accepted) ||
				!reflect.DeepEqual(got.d.errs, want.d.errs) || !reflect.DeepEqual(got.d.names, want.d.names) ||
				!reflect.DeepEqual(got.d.batch, want.d.batch) {
				t.Fatalf("chunks of %d: streaming decode differs:\n got %+v %+v\nwant %+v %+v", chunk, got, got.d, want, want.d)
			}
		}
	}
}

// A message cut short is an error, wherever it is cut.
func TestStreamDecodeTruncated(t *testing.T) {
	wire, err := proto.Marshal(streamTestPush(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{1, 2, 10, len(wire) / 2, len(wire) - 1} {
		if err := newStreamCodec().Unmarshal(chunked(wire[:n], 16), &response{}); err == nil {
			t.Errorf("decode of the first %d of %d bytes succeeded", n, len(wire))
		}
	}
}

// The codec drops each buffer once past it and leaves gRPC's later Free of the slice
// harmless.
func TestStreamDecodeDropsBuffers(t *testing.T) {
	wire, err := proto.Marshal(streamTestPush(t))
	if err != nil {
		t.Fatal(err)
	}
	pool := mem.DefaultBufferPool()
	var data mem.BufferSlice
	for b := wire; len(b) > 0; {
		k := min(100, len(b))
		data = append(data, mem.Copy(b[:k], pool))
		b = b[k:]
	}
	if err := newStreamCodec().Unmarshal(data, &response{}); err != nil {
		t.Fatal(err)
	}
	data.Free() // as gRPC does after Unmarshal: must not free a buffer twice (that panics)
}

func FuzzStreamDecode(f *testing.F) {
	wire, err := proto.Marshal(streamTestPush(f))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(wire, 16)
	f.Fuzz(func(t *testing.T, wire []byte, chunk int) {
		chunk = 1 + abs(chunk)%64
		got := &response{collectNames: true}
		gerr := newStreamCodec().Unmarshal(chunked(wire, chunk), got)
		var m discoverypb.DeltaDiscoveryResponse
		if perr := proto.Unmarshal(wire, &m); perr != nil {
			return // the streaming decoder checks less (unknown fields, UTF-8); nothing to compare
		}
		if gerr != nil {
			t.Fatalf("proto decodes it, the streaming decoder fails: %v", gerr)
		}
		want := fromProto(&m, true, nil)
		if got.typeURL != want.typeURL || !reflect.DeepEqual(got.d.accepted, want.d.accepted) || !reflect.DeepEqual(got.d.errs, want.d.errs) {
			t.Fatalf("streaming decode differs: %+v vs %+v", got.d, want.d)
		}
	})
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// Within one push, workloads of one service share their services map and repeated strings.
func TestPushInternsShared(t *testing.T) {
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType}
	for i := range 2 {
		uid := "Kubernetes//Pod/ns/pod-" + strconv.Itoa(i)
		w := &workloadpb.Workload{Uid: uid, Name: "pod-" + strconv.Itoa(i), Namespace: "ns", Node: "node-1", ServiceAccount: "sa",
			Addresses: [][]byte{{10, 0, 0, byte(i)}}, TunnelProtocol: workloadpb.TunnelProtocol_HBONE,
			Services: map[string]*workloadpb.PortList{"ns/svc.ns.svc.cluster.local": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}}}
		v, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
		if err != nil {
			t.Fatal(err)
		}
		resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: uid, Version: "1", Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: v}})
	}
	wire, err := proto.Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	r := decodeStream(t, wire, 16)
	ws := r.d.batch.Workloads
	if len(ws) != 2 {
		t.Fatalf("%d workloads; want 2 (errors: %v)", len(ws), r.d.errs)
	}
	if reflect.ValueOf(ws[0].Services).UnsafePointer() != reflect.ValueOf(ws[1].Services).UnsafePointer() {
		t.Error("services maps not shared")
	}
	for _, f := range []func(w *state.Workload) string{
		func(w *state.Workload) string { return w.Namespace },
		func(w *state.Workload) string { return w.Node },
		func(w *state.Workload) string { return w.ServiceAccount },
	} {
		if unsafe.StringData(f(ws[0])) != unsafe.StringData(f(ws[1])) {
			t.Errorf("%q not shared", f(ws[0]))
		}
	}
	if ws[0].Services["ns/svc.ns.svc.cluster.local"][80] != 8080 {
		t.Errorf("services %v", ws[0].Services)
	}
}
