package proxy

import (
	"net/netip"
	"testing"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// Both ends' locality labels come from the workloads in the cache, and on inbound from the
// peer's baggage when the cache does not know the client (as the Rust ztunnel labels them).
func TestLocalityLabels(t *testing.T) {
	src := &state.Workload{Name: "client", WorkloadMeta: &state.WorkloadMeta{Namespace: "default", Locality: state.Locality{Region: "us-east1", Zone: "us-east1-b"}}}
	dst := &state.Workload{Name: "server", WorkloadMeta: &state.WorkloadMeta{Namespace: "default", Locality: state.Locality{Region: "eu-west1", Zone: "eu-west1-c"}}}
	var l metrics.Labels
	sourceLabels(&l, src)
	destLabels(&l, dst, nil)
	if l.SourceRegion != "us-east1" || l.SourceZone != "us-east1-b" || l.DestinationRegion != "eu-west1" || l.DestinationZone != "eu-west1-c" {
		t.Errorf("labels from the cache: %+v", l)
	}

	p := &Proxy{store: state.NewStore()}
	var in metrics.Labels
	p.inboundSourceLabels(&in, identity.ID{}, netip.MustParseAddr("10.0.0.9"), baggage(src))
	if in.SourceRegion != "us-east1" || in.SourceZone != "us-east1-b" {
		t.Errorf("labels from baggage %q: region %q zone %q", baggage(src), in.SourceRegion, in.SourceZone)
	}
}
