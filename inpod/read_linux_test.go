//go:build linux

package inpod

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/inpod/zdspb"
)

// FuzzParse: no packet crashes the parser, and one without fds is never an accepted Add.
func FuzzParse(f *testing.F) {
	for _, req := range []*zdspb.WorkloadRequest{
		{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{Uid: "u", WorkloadInfo: &zdspb.WorkloadInfo{Name: "n"}}}},
		{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: "u"}}},
		{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: "u"}}},
		{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}},
	} {
		b, _ := proto.Marshal(req)
		f.Add(b)
	}
	f.Add([]byte{0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		req, fd, err := parse(b, 0, nil, nil)
		if err != nil {
			return
		}
		if fd != -1 || req.GetPayload() == nil || req.GetAdd() != nil {
			t.Fatalf("parse(% x) = %v, fd %d; want Keep, Del or SnapshotSent without an fd", b, req, fd)
		}
	})
}
