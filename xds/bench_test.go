package xds

import (
	"fmt"
	"net/netip"
	"strconv"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// genPush builds an Address response of n workloads as istiod would send them.
func genPush(b *testing.B, n int) *discoverypb.DeltaDiscoveryResponse { return genPushAt(b, n, 1) }

// genPushAt is genPush with every workload at revision gen (its bytes differ by gen).
func genPushAt(b *testing.B, n, gen int) *discoverypb.DeltaDiscoveryResponse {
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "n"}
	for i := range n {
		uid := "Kubernetes//v1/Pod/ns" + strconv.Itoa(i%50) + "/pod-" + strconv.Itoa(i)
		w := &workloadpb.Workload{
			Uid: uid, Name: "pod-" + strconv.Itoa(i), Namespace: "ns" + strconv.Itoa(i%50),
			Addresses:      [][]byte{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).AsSlice()},
			TunnelProtocol: workloadpb.TunnelProtocol_HBONE, ServiceAccount: "sa" + strconv.Itoa(i%1000),
			Node: "node-" + strconv.Itoa(i%500), CanonicalName: "app" + strconv.Itoa(i%1000), CanonicalRevision: "v" + strconv.Itoa(gen),
			Services: map[string]*workloadpb.PortList{"ns/svc" + strconv.Itoa(i%1000) + ".svc.cluster.local": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}},
		}
		v, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
		if err != nil {
			b.Fatal(err)
		}
		resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: uid, Version: strconv.Itoa(gen), Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: v}})
	}
	return resp
}

// BenchmarkHandlePush is a whole initial push through the client as it arrives: decoded
// from the wire in 16 KiB frames (the codec's path), converted (no lock) and applied to an
// empty store.
func BenchmarkHandlePush(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			wire, err := proto.Marshal(genPush(b, n))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}}, state.NewStore(), nil)
				if err != nil {
					b.Fatal(err)
				}
				resp := &response{held: c.store}
				if err := newStreamCodec().Unmarshal(chunked(wire, 16<<10), resp); err != nil {
					b.Fatal(err)
				}
				if ack := c.apply(resp); ack.GetErrorDetail() != nil {
					b.Fatal(ack.GetErrorDetail())
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/workload")
		})
	}
}

// BenchmarkHandleFullPush is every workload pushed again into a store that holds them all
// (a control plane's full push after a restart), changed (every workload's bytes differ
// from the stored ones: decode, convert, apply over the old) and unchanged (the same bytes
// at a new version: only hashed and looked up).
func BenchmarkHandleFullPush(b *testing.B) {
	const n = 100_000
	for _, changed := range []bool{true, false} {
		b.Run(fmt.Sprintf("%d/changed=%v", n, changed), func(b *testing.B) {
			pushes := []*discoverypb.DeltaDiscoveryResponse{genPushAt(b, n, 1), genPushAt(b, n, 2)}
			c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}}, state.NewStore(), nil)
			if err != nil {
				b.Fatal(err)
			}
			c.handle(pushes[0])
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if changed {
					i++
				}
				if ack := c.handle(pushes[i%2]); ack.GetErrorDetail() != nil {
					b.Fatal(ack.GetErrorDetail())
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/workload")
		})
	}
}
