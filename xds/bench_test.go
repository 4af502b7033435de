package xds

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
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

// BenchmarkHandlePush is a whole initial push through the client as it arrives
// (benchInitialPush).
func BenchmarkHandlePush(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			wire, err := proto.Marshal(genPush(b, n))
			if err != nil {
				b.Fatal(err)
			}
			benchInitialPush(b, wire, n)
		})
	}
}

// benchInitialPush runs wire, an initial push of n workloads, through a fresh client as it
// arrives: decoded in 16 KiB frames (the codec's path), converted and applied to an empty
// store.
func benchInitialPush(b *testing.B, wire []byte, n int) {
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
}

// genDeployments builds an Address response of n workloads in deployments of 15 pods, each
// deployment a service of its own with its pods in three zones, 100 pods to a namespace and
// to a node, dual-stack (internal/scaletest's mesh). In order, a deployment's pods come
// together at version "1"; shuffled, they come as istiod and go-control-plane send them: in
// map order, each at a version hashing its content.
func genDeployments(b *testing.B, n int, shuffled bool) *discoverypb.DeltaDiscoveryResponse {
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "n"}
	for i := range n {
		ns, app := "ns-"+strconv.Itoa(i/100), "app-"+strconv.Itoa(i/15)
		uid := "Kubernetes//Pod/" + ns + "/" + app + "-" + strconv.Itoa(i)
		w := &workloadpb.Workload{
			Uid: uid, Name: app + "-" + strconv.Itoa(i), Namespace: ns, ServiceAccount: app, WorkloadName: app,
			CanonicalName: app, CanonicalRevision: "v1", TrustDomain: "cluster.local", ClusterId: "Kubernetes",
			Addresses:      [][]byte{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).AsSlice(), netip.AddrFrom16([16]byte{0: 0xfd, 2: 1, 13: byte(i >> 16), 14: byte(i >> 8), 15: byte(i)}).AsSlice()},
			TunnelProtocol: workloadpb.TunnelProtocol_HBONE, Node: "node-" + strconv.Itoa(i/100), Status: workloadpb.WorkloadStatus_HEALTHY,
			Locality: &workloadpb.Locality{Region: "region-1", Zone: "zone-" + strconv.Itoa(i%3)},
			Services: map[string]*workloadpb.PortList{ns + "/svc-" + strconv.Itoa(i/15) + "." + ns + ".svc.cluster.local": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}, {ServicePort: 443, TargetPort: 8443}}}},
		}
		v, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
		if err != nil {
			b.Fatal(err)
		}
		version := "1"
		if shuffled {
			h := fnv.New64a()
			h.Write(v)
			version = strconv.FormatUint(h.Sum64(), 16)
		}
		resp.Resources = append(resp.Resources, &discoverypb.Resource{Name: uid, Version: version, Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: v}})
	}
	if shuffled {
		rand.Shuffle(n, func(i, j int) { resp.Resources[i], resp.Resources[j] = resp.Resources[j], resp.Resources[i] })
	}
	return resp
}

// BenchmarkHandlePushOrder is BenchmarkHandlePush's initial push for a mesh of deployments,
// its pods sent together or apart (genDeployments): a node's cost should not depend on the
// order its control plane sends in (issue 59).
func BenchmarkHandlePushOrder(b *testing.B) {
	const n = 100_000
	for _, shuffled := range []bool{false, true} {
		b.Run(fmt.Sprintf("%d/shuffled=%v", n, shuffled), func(b *testing.B) {
			wire, err := proto.Marshal(genDeployments(b, n, shuffled))
			if err != nil {
				b.Fatal(err)
			}
			benchInitialPush(b, wire, n)
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
