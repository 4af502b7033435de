package proxy

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/netip"
	"strings"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// forwardedNetworkHeader names the client's network on double HBONE's inner CONNECT, so
// the destination knows the client came through a gateway (the Rust ztunnel's
// X_FORWARDED_NETWORK_HEADER; its comments call it x-istio-origin-network).
const forwardedNetworkHeader = "X-Forwarded-Network"

// hboneHeaders are the request headers of an outbound CONNECT: baggage describing the
// source workload, forwarded naming the client, and a fresh traceparent.
func hboneHeaders(src *state.Workload, client netip.AddrPort, svc *state.Service) http.Header {
	h := make(http.Header, 3)
	if b := baggage(src); b != "" {
		h["Baggage"] = []string{b}
	}
	fwd := `for="` + client.String() + `"`
	if svc != nil {
		fwd += ";host=" + svc.Hostname
	}
	h["Forwarded"] = []string{fwd}
	h["Traceparent"] = []string{traceparent()}
	return h
}

// baggage is the W3C baggage ztunnel sends: only non-empty keys.
func baggage(w *state.Workload) string {
	if w == nil {
		return ""
	}
	var b strings.Builder
	add := func(k, v string) {
		if v == "" {
			return
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(v)
	}
	add("k8s.cluster.name", w.ClusterID)
	add("k8s.namespace.name", w.Namespace)
	add("k8s."+strings.ToLower(w.WorkloadType.String())+".name", w.WorkloadName)
	add("service.name", w.CanonicalName)
	add("service.version", w.CanonicalRevision)
	add("cloud.region", w.Locality.Region)
	add("cloud.availability_zone", w.Locality.Zone)
	return b.String()
}

// peerBaggage is what a peer's baggage header says of its workload: the keys baggage
// writes, as the Rust ztunnel's parse_baggage_header reads them.
type peerBaggage struct {
	cluster, namespace, workload, service, version, region, zone string
}

// parseBaggage reads the keys of a peer's baggage header that feed metric labels.
func parseBaggage(h string) peerBaggage {
	var b peerBaggage
	for _, kv := range strings.Split(h, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(kv), "=")
		switch k {
		case "k8s.cluster.name":
			b.cluster = v
		case "k8s.namespace.name":
			b.namespace = v
		case "k8s.deployment.name", "k8s.cronjob.name", "k8s.pod.name", "k8s.job.name":
			b.workload = v
		case "service.name":
			b.service = v
		case "service.version":
			b.version = v
		case "cloud.region":
			b.region = v
		case "cloud.availability_zone":
			b.zone = v
		}
	}
	return b
}

// derivedDestLabels replaces the destination workload's labels with what the destination
// said of itself in its answer's baggage, as the Rust ztunnel's with_derived_destination
// does on double HBONE: across networks the local view of the destination is the remote
// network's gateway's pick, not the workload that answered. The principal stays the TLS
// peer's (the caller's). workload_name feeds destination_app too, as in the Rust ztunnel.
func derivedDestLabels(l *metrics.Labels, bag string) {
	b := parseBaggage(bag)
	l.DestinationWorkload = b.workload
	l.DestinationCanonicalService = b.service
	l.DestinationCanonicalRevision = b.version
	l.DestinationWorkloadNamespace = b.namespace
	l.DestinationApp = b.workload
	l.DestinationVersion = b.version
	l.DestinationCluster = b.cluster
	l.DestinationRegion, l.DestinationZone = b.region, b.zone
}

func traceparent() string {
	var b [24]byte
	_, _ = rand.Read(b[:])
	return "00-" + hex.EncodeToString(b[:16]) + "-" + hex.EncodeToString(b[16:]) + "-00"
}

// sourceLabels and destLabels fill one side of the traffic labels from the cache.
func sourceLabels(l *metrics.Labels, w *state.Workload) {
	if w == nil {
		return
	}
	l.SourceWorkload = firstNonEmpty(w.WorkloadName, w.Name)
	l.SourceWorkloadNamespace = w.Namespace
	l.SourceCanonicalService = firstNonEmpty(w.CanonicalName, w.Name)
	l.SourceCanonicalRevision = w.CanonicalRevision
	l.SourceApp = l.SourceCanonicalService
	l.SourceVersion = w.CanonicalRevision
	l.SourceCluster = w.ClusterID
	l.SourceRegion, l.SourceZone = w.Locality.Region, w.Locality.Zone
}

func destLabels(l *metrics.Labels, w *state.Workload, svc *state.Service) {
	if w != nil {
		l.DestinationWorkload = firstNonEmpty(w.WorkloadName, w.Name)
		l.DestinationWorkloadNamespace = w.Namespace
		l.DestinationCanonicalService = firstNonEmpty(w.CanonicalName, w.Name)
		l.DestinationCanonicalRevision = w.CanonicalRevision
		l.DestinationApp = l.DestinationCanonicalService
		l.DestinationVersion = w.CanonicalRevision
		l.DestinationCluster = w.ClusterID
		l.DestinationRegion, l.DestinationZone = w.Locality.Region, w.Locality.Zone
	}
	if svc != nil {
		l.DestinationService = svc.Hostname
		l.DestinationServiceName = svc.Name
		l.DestinationServiceNamespace = svc.Namespace
	}
}

func firstNonEmpty(v, fallback string) string {
	if v != "" {
		return v
	}
	return fallback
}
