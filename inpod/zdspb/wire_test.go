package zdspb_test

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/gozt/gozt/inpod/zdspb"
)

// TestWireNumbers pins every field number of istio/istio's pkg/zdsapi/zds.proto, so an edit of zds.proto cannot
// drift from istio-cni's wire.
func TestWireNumbers(t *testing.T) {
	fields := map[proto.Message]map[string]int{
		&zdspb.ZdsHello{}:         {"version": 1},
		&zdspb.WorkloadInfo{}:     {"name": 1, "namespace": 2, "service_account": 3},
		&zdspb.AddWorkload{}:      {"uid": 1, "workload_info": 2},
		&zdspb.KeepWorkload{}:     {"uid": 1},
		&zdspb.DelWorkload{}:      {"uid": 2},
		&zdspb.Ack{}:              {"error": 1},
		&zdspb.WorkloadRequest{}:  {"add": 1, "del": 2, "snapshot_sent": 3, "keep": 5},
		&zdspb.WorkloadResponse{}: {"ack": 1},
		&zdspb.SnapshotSent{}:     {},
	}
	for m, want := range fields {
		d := m.ProtoReflect().Descriptor()
		if got := d.FullName().Parent(); got != "istio.workload.zds" {
			t.Errorf("%s: package %s; want istio.workload.zds", d.FullName(), got)
		}
		if d.Fields().Len() != len(want) {
			t.Errorf("%s has %d fields; want %d", d.FullName(), d.Fields().Len(), len(want))
		}
		for name, num := range want {
			f := d.Fields().ByName(protoreflect.Name(name))
			if f == nil {
				t.Errorf("%s lacks field %s", d.FullName(), name)
			} else if int(f.Number()) != num {
				t.Errorf("%s.%s = %d; want %d", d.FullName(), name, f.Number(), num)
			}
		}
	}
	if v := zdspb.Version_V1; v != 1 {
		t.Errorf("V1 = %d; want 1", v)
	}
}

// TestWireBytes checks the encodings istio-cni sees: the hello is the bare bytes 08 01, and
// DelWorkload's uid travels as field 2.
func TestWireBytes(t *testing.T) {
	for _, tc := range []struct {
		m    proto.Message
		want []byte
	}{
		{&zdspb.ZdsHello{Version: zdspb.Version_V1}, []byte{0x08, 0x01}},
		{&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: "u"}}},
			[]byte{0x12, 0x03, 0x12, 0x01, 'u'}},
		{&zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{}}}, []byte{0x0a, 0x00}},
	} {
		got, err := proto.Marshal(tc.m)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, tc.want) {
			t.Errorf("%T: % x; want % x", tc.m, got, tc.want)
		}
	}
}
