package xds

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/xdspb"
)

// The metrics package registers the xDS families with the rest of Istio's; the client must
// share them rather than fail on the one registry a node has.
func TestClientMetricsShareRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	metrics.New(reg, "test")
	cm, err := newClientMetrics(reg)
	if err != nil {
		t.Fatalf("newClientMetrics on a registry the metrics package filled: %v", err)
	}
	cm.messages.WithLabelValues(xdspb.AddressType).Inc()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "istio_xds_message_total" {
			if got := f.GetMetric()[0].GetCounter().GetValue(); got != 1 {
				t.Fatalf("istio_xds_message_total = %v; want 1", got)
			}
			return
		}
	}
	t.Fatal("istio_xds_message_total not gathered")
}
